"""The connection-holding attack of issue 49 and what legitimate clients see during it.

`HoldAttack` keeps `connections` sockets open to a coordinator; each sends `pipelined` requests
(`GET /v1/models` without a key: answered 401) in one go and never reads an answer. When the
server cuts one (peer shutdown, reset, refusal), it reconnects at once. It runs on one thread
with non-blocking sockets, so a few thousand connections cost one core at most.
`probe` meanwhile sends legitimate requests one after another, each on a new connection, as a
client would: `GET /health` and an authorized `GET /v1/models`, and records status and latency.

Run against a server: `python -m bench.hold --url http://127.0.0.1:8000 --api-key-file F`
(prints requests answered and /health latency p50/p99). Loopback only: traffic is bounded by
`--seconds`.
"""

from __future__ import annotations

import argparse
import errno
import json
import select
import socket
import threading
import time
import urllib.parse

from bench.flood import _pct, call

_ERROR_EVENTS = select.POLLHUP | select.POLLERR | select.POLLRDHUP | select.POLLNVAL


class HoldAttack:
    """`connections` sockets that pipeline `pipelined` requests each and never read (see module doc)."""

    def __init__(self, host: str, port: int, connections: int, pipelined: int = 1000,
                 path: str = "/v1/models"):
        self.address, self.connections = (host, port), connections
        self.burst = (f"GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n" * pipelined).encode()
        self.connects = self.cuts = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hold-attack", daemon=True)

    def start(self) -> HoldAttack:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def _open(self, poller, socks: dict) -> None:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setblocking(False)
        err = s.connect_ex(self.address)
        if err not in (0, errno.EINPROGRESS):
            s.close()
            return
        self.connects += 1
        socks[s.fileno()] = [s, 0]  # socket, bytes of the burst sent
        poller.register(s, select.POLLOUT | select.POLLRDHUP)

    def _run(self) -> None:
        poller, socks = select.poll(), {}
        try:
            while not self._stop.is_set():
                while len(socks) < self.connections:
                    before = len(socks)
                    self._open(poller, socks)
                    if len(socks) == before:  # cannot connect now (e.g. out of ports): retry next turn
                        break
                for fd, events in poller.poll(50):
                    s, sent = socks[fd]
                    if events & _ERROR_EVENTS:  # cut, refused or reset: reconnect at once
                        poller.unregister(fd)
                        del socks[fd]
                        s.close()
                        self.cuts += 1
                    elif events & select.POLLOUT:
                        try:
                            sent += s.send(self.burst[sent:])
                        except BlockingIOError:
                            continue
                        except OSError:
                            continue  # the error event follows
                        socks[fd][1] = sent
                        if sent >= len(self.burst):  # all sent: now only wait for the cut
                            poller.modify(fd, select.POLLRDHUP)
        finally:
            for s, _ in socks.values():
                s.close()


def probe(url: str, key: str | None, seconds: float | None = None, timeout_s: float = 10.0,
          count: int | None = None) -> list[dict]:
    """Legitimate requests for `seconds` (a benchmark) or `count` of them (a test), one after
    another, alternating /health and an authorized /v1/models; each {path, status (None: no
    answer within timeout_s), seconds}."""
    out, i = [], 0
    end = time.monotonic() + seconds if seconds is not None else None
    while (len(out) < count) if count is not None else (time.monotonic() < end):
        path = "/health" if i % 2 == 0 else "/v1/models"
        r = call(url, "GET", path, key=key if path != "/health" else None, timeout=timeout_s)
        out.append({"path": path, "status": r.status, "seconds": round(r.seconds, 4), "error": r.error})
        i += 1
    return out


def summary(records: list[dict]) -> dict:
    """Fraction of requests answered 200, and /health latency percentiles (ms, answered or not)."""
    health = sorted(r["seconds"] * 1000 for r in records if r["path"] == "/health")
    ok = sum(r["status"] == 200 for r in records)
    statuses: dict[str, int] = {}
    for r in records:
        statuses[str(r["status"])] = statuses.get(str(r["status"]), 0) + 1
    errors = sorted({r["error"] for r in records if r.get("error")})
    return {"requests": len(records), "answered_200": ok, "errors": errors,
            "answered_fraction": round(ok / max(1, len(records)), 4),
            "statuses": statuses, "health_probes": len(health),
            "health_p50_ms": round(_pct(health, 50), 1) if health else None,
            "health_p99_ms": round(_pct(health, 99), 1) if health else None}


def measure(url: str, key: str | None, connections: int, pipelined: int, warmup_s: float,
            seconds: float) -> dict:
    """The attack for warmup_s, then `probe` for `seconds` while it goes on."""
    u = urllib.parse.urlsplit(url)
    attack = HoldAttack(u.hostname, u.port or 80, connections, pipelined).start()
    try:
        time.sleep(warmup_s)  # NOTE: a benchmark's warm-up, not a test's wait
        records = probe(url, key, seconds)
    finally:
        attack.stop()
    return {**summary(records), "attack_connects": attack.connects, "attack_cuts": attack.cuts}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--api-key-file", help="the key for the legitimate /v1/models requests")
    p.add_argument("--connections", type=int, default=1024)
    p.add_argument("--pipelined", type=int, default=2000, help="requests each attacker connection sends")
    p.add_argument("--warmup-s", type=float, default=5.0)
    p.add_argument("--seconds", type=float, default=20.0)
    args = p.parse_args()
    key = open(args.api_key_file).read().strip() if args.api_key_file else None
    print(json.dumps(measure(args.url, key, args.connections, args.pipelined, args.warmup_s, args.seconds),
                     indent=1))


if __name__ == "__main__":
    main()
