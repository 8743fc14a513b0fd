"""Issue 49, item 1: no client can hold the HTTP connections others need. An attacker keeps 200
connections (8x the server's cap of 25) each pipelining 1,000 unauthorized `GET /v1/models` and
never reading, reconnecting as soon as it is cut (bench.hold); legitimate clients, one request
per connection, still get their answers. The pieces are tested on their own too: the write
timeout cuts a client that reads nothing, the pipelining bound answers 429 and closes, eviction
picks idle and suspect connections and never one whose request is being handled."""

from __future__ import annotations

import re
import socket
import time

import pytest
from http_harness import CONFIG, LocalEngineBackend, serve

from bench.hold import HoldAttack, probe, summary
from coordinator.connections import ConnectionTable
from coordinator.http import CONNECTIONS, HTTPConfig

KEY = "K"
WAIT_S = 30.0  # bound on every wait for a condition below


@pytest.fixture(scope="module")
def backend():
    local = LocalEngineBackend(CONFIG).start()
    yield local
    local.close()


def _stop(served, loop) -> None:
    import asyncio
    asyncio.run_coroutine_threadsafe(served.runner.cleanup(), loop).result(30)


def _wait(condition, what: str) -> None:
    end = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < end, f"not within {WAIT_S:g}s: {what}"
        time.sleep(0.02)


def test_legitimate_requests_are_answered_while_connections_are_held(http_loop, backend):
    served = serve(http_loop, backend, HTTPConfig(api_key=KEY, max_connections=25))
    table = served.runner.app[CONNECTIONS]
    attack = HoldAttack("127.0.0.1", served.port, connections=200, pipelined=1000).start()
    try:
        _wait(lambda: table.open == table.max_connections and attack.connects >= 200,
              "the attack fills the server's connections")
        records = probe(served.url, KEY, count=20, timeout_s=WAIT_S)  # a count, not a time: no pace assumed
    finally:
        attack.stop()
        _stop(served, http_loop)
    s = summary(records)
    assert s["requests"] == 20, s
    assert s["answered_fraction"] >= 0.95, s
    assert set(s["statuses"]) <= {"200", "None"}, s  # never a 503: a held connection gave way


def _pipeline(port: int, n: int, path: bytes = b"/v1/models") -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
    s.sendall((b"GET " + path + b" HTTP/1.1\r\nHost: x\r\n\r\n") * n)
    return s


def _read_all(s: socket.socket) -> bytes:
    data = b""
    try:
        while chunk := s.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def test_pipelining_past_the_bound_is_answered_429_and_closed(http_loop, backend):
    served = serve(http_loop, backend, HTTPConfig(max_pipelined=3))
    try:
        with _pipeline(served.port, 10, b"/health") as s:
            data = _read_all(s)  # ends: the server closed the connection
        statuses = [int(code) for code in re.findall(rb"HTTP/1\.1 (\d{3}) ", data)]
        assert statuses == [200, 200, 200, 200, 429], data[-400:]  # the first and 3 ahead, then refused
        assert b"ahead of reading" in data
        assert served.get("/health")[0] == 200
    finally:
        _stop(served, http_loop)


class _Transport:
    def __init__(self):
        self.aborted, self.buffered = False, 0

    def abort(self):
        self.aborted = True

    def get_write_buffer_size(self):
        return self.buffered


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _made(table: ConnectionTable, admitted: list) -> tuple:
    conn = table.admit(lambda: admitted.append(conn))
    assert conn is not None
    transport = _Transport()
    table.made(conn, transport)
    return conn, transport


def test_eviction_takes_suspects_then_kept_then_stale_fresh_never_a_busy_one():
    clock, admitted = _Clock(), []
    table = ConnectionTable(max_connections=4, max_queued=4, max_pipelined=0, write_timeout_s=1.0,
                            clock=clock)
    busy, busy_t = _made(table, admitted)
    kept, kept_t = _made(table, admitted)
    piped, piped_t = _made(table, admitted)
    fresh, fresh_t = _made(table, admitted)
    assert admitted == [busy, kept, piped, fresh]
    assert table.begin(busy)
    assert table.begin(kept)
    table.finish(kept)
    assert table.begin(piped)
    table.finish(piped)
    assert not table.begin(piped)  # answered before and no byte since: pipelined, past a bound of 0
    table.finish(piped)

    first, _ = _made(table, admitted)   # the suspect goes first
    assert piped_t.aborted and admitted[-1] is first
    second, _ = _made(table, admitted)  # then the one kept alive between requests
    assert kept_t.aborted and admitted[-1] is second
    third, _ = _made(table, admitted)   # queued: the fresh ones are in their grace
    assert admitted[-1] is second and not fresh_t.aborted and table.open == 4
    clock.now = 1.5
    table.sweep(clock.now)              # past the grace, the oldest fresh one goes
    assert fresh_t.aborted and admitted[-1] is third and not busy_t.aborted
    assert table.evicted == 3 and table.open == 4


def test_the_grace_of_a_fresh_connection_counts_from_its_slot_not_its_arrival():
    clock, admitted = _Clock(), []
    table = ConnectionTable(max_connections=1, max_queued=4, max_pipelined=0, write_timeout_s=1.0,
                            clock=clock)
    slow, slow_t = _made(table, admitted)
    clock.now = 0.5
    queued, queued_t = table.admit(lambda: admitted.append(queued)), _Transport()
    table.made(queued, queued_t)     # waits: the slow one is in its grace
    assert admitted == [slow]
    clock.now = 1.2
    table.sweep(clock.now)           # the slow one's grace is over: the queued one gets its slot
    assert slow_t.aborted and admitted == [slow, queued]
    clock.now = 1.6                  # 1.1 s since it arrived, 0.4 s since its slot
    late = table.admit(lambda: admitted.append(late))
    table.made(late, _Transport())
    assert not queued_t.aborted and admitted == [slow, queued] and table.evicted == 1


def test_the_write_timeout_restarts_when_the_client_takes_bytes():
    table = ConnectionTable(max_connections=2, max_queued=2, max_pipelined=16, write_timeout_s=1.0)
    conn, transport = _made(table, [])
    transport.buffered = 100
    table.sweep(0.0)
    transport.buffered = 50   # the client took some
    table.sweep(0.9)
    table.sweep(1.5)
    assert not transport.aborted
    table.sweep(2.0)
    assert transport.aborted and table.write_timeouts == 1 and table.open == 0


def test_a_newcomer_waits_for_a_slowloris_slot_instead_of_getting_503(http_loop, backend):
    served = serve(http_loop, backend, HTTPConfig(max_connections=4))
    table = served.runner.app[CONNECTIONS]
    slow = []
    try:
        for _ in range(4):
            s = socket.create_connection(("127.0.0.1", served.port), timeout=WAIT_S)
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # headers never finished
            slow.append(s)
        _wait(lambda: table.open == 4, "the slow connections hold every slot")
        assert served.get("/health")[0] == 200  # queued, then given the oldest slow one's slot
        assert table.evicted == 1 and table.refused == 0
    finally:
        for s in slow:
            s.close()
        _stop(served, http_loop)
