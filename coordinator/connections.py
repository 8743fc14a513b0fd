"""The HTTP listener's connection bounds, so that no client can hold connections others need.

- At most `max_connections` connections hold a slot (are read and answered). One more waits in
  a queue (its reading paused, in arrival order, at most `max_queued` of them) while the table
  frees a slot by evicting (aborting) a connection that serves nobody: first one marked suspect
  (it pipelined requests ahead of reading the answers, or its client stopped taking bytes),
  oldest mark first; then the one idle longest between requests; then one that has not finished
  a request FRESH_GRACE_S after getting its slot (a slowloris; the time it waited in the
  queue does not count, or a client queued behind an attack would lose its slot at once). A
  connection whose request is being handled is never evicted unless it is marked suspect (a
  stalled writer, or a pipeliner). A queued connection without a slot after MAX_QUEUE_WAIT_S, or
  one past a full queue, is answered 503 with the OpenAI error body and closed within
  REFUSED_LINGER_S, its request never read.
- Every response has a write timeout: a connection whose transport holds unsent bytes that its
  client has not taken for `write_timeout_s` is aborted (checked every SWEEP_S), whatever wrote
  them: a whole response, a stream, an error page, the flush before a close.
- At most `max_pipelined` requests per connection may arrive ahead of their answers (a request
  counts when no byte came from the client between the previous answer and its start: the
  client sent it before reading). Past the bound the request is answered 429 and the
  connection closed (the HTTP layer's middleware asks `begin`).
- Every connection must send complete request headers within `header_timeout_s` of getting its
  slot or of its previous response (aiohttp's keep-alive timer, set by coordinator.http).

`BoundedSite` is an aiohttp `TCPSite` whose protocol factory goes through the table, with a thin
delegating protocol per connection, so the count is exact even when many connections are
accepted in one event-loop turn.
"""

from __future__ import annotations

import asyncio
import json
import time

from aiohttp import web

_BUSY_BODY = json.dumps({"error": {"message": "too many open connections: retry shortly",
                                   "type": "service_unavailable", "param": None, "code": None}}).encode()
BUSY_RESPONSE = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                 b"Retry-After: 1\r\nConnection: close\r\nContent-Length: " + str(len(_BUSY_BODY)).encode()
                 + b"\r\n\r\n" + _BUSY_BODY)


REFUSED_LINGER_S = 1.0  # a refused connection is closed this long after its 503 at the latest
SWEEP_S = 1.0           # how often the write timeout and the queue's wait are checked
FRESH_GRACE_S = 1.0     # a connection that never finished a request is evictable this long after its slot
MAX_QUEUE_WAIT_S = 5.0  # a queued connection not given a slot this soon is answered 503
# NOTE: the kernel's queue of connections not yet accepted (capped by net.core.somaxconn). At
# aiohttp's 128, a client reconnecting as fast as it is cut fills it, and every other client's
# SYN is dropped and only retried after a second
LISTEN_BACKLOG = 4096


def refuse(transport) -> None:
    """One 503, our side shut, the connection closed within REFUSED_LINGER_S."""
    transport.write(BUSY_RESPONSE)
    # NOTE: half-close, not close: closing with the client's request unread sends a reset
    # that can reach the client before the 503 does
    try:
        if transport.can_write_eof():
            transport.write_eof()
    except OSError:  # the client is gone already
        transport.abort()
        return
    asyncio.get_running_loop().call_later(REFUSED_LINGER_S, transport.close)


class Connection:
    """One accepted connection's state, as the table and the HTTP middleware see it."""

    def __init__(self, opened_at: float, on_admit):
        self.opened_at = opened_at
        self.admitted_at: float | None = None  # when it got its slot
        self.on_admit = on_admit       # called once the connection has a slot and is made
        self.transport: asyncio.Transport | None = None  # set once the connection is made
        self.admitted = False          # holds a slot (else it waits in the queue)
        self.handling = False          # a request of this connection is being handled
        self.answered = 0              # requests handled to the end
        self.pipelined = 0             # of those, requests that arrived ahead of the previous answer
        self.data_seen = False         # bytes came from the client since the last answer
        self.stalled_since: float | None = None  # unsent bytes waiting for the client since then
        self.buffered = 0              # unsent bytes at the last sweep
        self.closed = False


class ConnectionTable:
    """Every connection of one listener: slots, the queue, eviction, the pipelining bound and
    the write timeout (see the module docstring)."""

    def __init__(self, max_connections: int, max_queued: int, max_pipelined: int, write_timeout_s: float,
                 clock=time.monotonic):
        if max_connections < 1 or max_queued < 0 or max_pipelined < 0 or write_timeout_s <= 0:
            raise ValueError("need max_connections >= 1, max_queued >= 0, max_pipelined >= 0, "
                             f"write_timeout_s > 0; got {max_connections}, {max_queued}, {max_pipelined}, "
                             f"{write_timeout_s}")
        self.max_connections, self.max_queued, self.max_pipelined = max_connections, max_queued, max_pipelined
        self.write_timeout_s, self.clock = write_timeout_s, clock
        self.open = 0  # connections holding a slot
        self.refused = self.evicted = self.write_timeouts = self.pipelining_closed = 0
        self._by_transport: dict[asyncio.BaseTransport, Connection] = {}
        # NOTE: dicts keep insertion order: the first key is the oldest mark / the longest idle
        self._suspect: dict[Connection, None] = {}  # pipelined ahead, or its client takes no bytes
        self._kept: dict[Connection, None] = {}     # idle between requests (keep-alive)
        self._fresh: dict[Connection, None] = {}    # no request handled yet
        self._waiting: dict[Connection, None] = {}  # no slot yet, in arrival order

    # ---- the listener's side ----

    def admit(self, on_admit) -> Connection | None:
        """A new connection: with a slot, or queued for one (`on_admit` is called once it has
        the slot and is made); None when the queue is full too (refuse it)."""
        if self.open >= self.max_connections and len(self._waiting) >= self.max_queued:
            self.refused += 1
            return None
        conn = Connection(self.clock(), on_admit)
        self._waiting[conn] = None
        self._make_room()
        return conn

    def made(self, conn: Connection, transport: asyncio.Transport) -> None:
        conn.transport = transport
        if conn.closed:  # evicted before its connection was made
            transport.abort()
            return
        self._by_transport[transport] = conn
        if conn.admitted:
            conn.on_admit()

    def lost(self, conn: Connection) -> None:
        """The connection ended: its slot goes to the queue. Idempotent."""
        if self._drop(conn):
            self._make_room()

    def _drop(self, conn: Connection) -> bool:
        """Forget `conn`; whether it held a slot (now free)."""
        if conn.closed:
            return False
        conn.closed = True
        for tier in (self._suspect, self._kept, self._fresh, self._waiting):
            tier.pop(conn, None)
        if conn.transport is not None:
            self._by_transport.pop(conn.transport, None)
        if conn.admitted:
            self.open -= 1
        return conn.admitted

    def _victim(self, now: float) -> Connection | None:
        victim = next(iter(self._suspect), None) or next(iter(self._kept), None)
        if victim is None:
            oldest = next(iter(self._fresh), None)
            if oldest is not None and now - oldest.admitted_at >= FRESH_GRACE_S:
                victim = oldest
        return victim

    def _make_room(self) -> None:
        """Slots to the queue's head while there are free ones or connections to evict."""
        now = self.clock()
        while self._waiting:
            if self.open >= self.max_connections:
                victim = self._victim(now)
                if victim is None:
                    return
                self.evicted += 1
                self._abort(victim)
            conn = next(iter(self._waiting))
            del self._waiting[conn]
            conn.admitted, conn.admitted_at = True, now
            self.open += 1
            self._fresh[conn] = None
            if conn.transport is not None:
                conn.on_admit()

    def _abort(self, conn: Connection) -> None:
        transport = conn.transport
        self._drop(conn)
        if transport is not None:
            transport.abort()  # connection_lost follows; the slot is free already

    def sweep(self, now: float) -> None:
        """The write timeout: abort each connection whose unsent bytes have waited for its client
        write_timeout_s without any being taken, and mark the waiting ones suspect; refuse the
        queued connections that waited MAX_QUEUE_WAIT_S."""
        for conn in list(self._by_transport.values()):
            size = conn.transport.get_write_buffer_size() if conn.admitted else 0
            if size == 0:
                conn.stalled_since = None
            elif conn.stalled_since is None or size < conn.buffered:
                conn.stalled_since = now  # newly waiting, or the client took some: the clock restarts
                self._suspect.setdefault(conn, None)
            elif now - conn.stalled_since >= self.write_timeout_s:
                self.write_timeouts += 1
                self._abort(conn)  # its slot goes to the queue below
            conn.buffered = size
        for conn in [c for c in self._waiting if now - c.opened_at >= MAX_QUEUE_WAIT_S]:
            self.refused += 1
            transport = conn.transport
            self._drop(conn)
            if transport is not None:
                refuse(transport)
        self._make_room()

    def close_queue(self) -> None:
        """Abort every queued connection (the listener stops: aiohttp never saw them)."""
        for conn in list(self._waiting):
            self._abort(conn)

    # ---- the HTTP layer's side (coordinator.http's middleware) ----

    def find(self, transport) -> Connection | None:
        return self._by_transport.get(transport)

    def begin(self, conn: Connection) -> bool:
        """A request of `conn` starts; False when it is past the pipelining bound (answer it with
        an error and close the connection)."""
        conn.handling = True
        self._kept.pop(conn, None)
        self._fresh.pop(conn, None)
        if conn.answered and not conn.data_seen:  # sent before the previous answer was written
            conn.pipelined += 1
            self._suspect.setdefault(conn, None)
            self._make_room()
            if conn.pipelined > self.max_pipelined:
                self.pipelining_closed += 1
                return False
        return True

    def finish(self, conn: Connection) -> None:
        """`conn`'s request was handled (its answer is being written)."""
        conn.handling, conn.data_seen = False, False
        conn.answered += 1
        if not conn.closed and conn not in self._suspect:
            self._kept[conn] = None


class _Refused(asyncio.Protocol):
    """A connection past the cap and a full queue: refused at once."""

    def connection_made(self, transport) -> None:
        refuse(transport)

    def data_received(self, data: bytes) -> None:
        pass  # read and dropped, so nothing is left unread at close


class _Counted(asyncio.Protocol):
    """Delegates every protocol call to aiohttp's handler once the connection has a slot (until
    then its reading is paused and what came is kept), telling the table what it sees."""

    def __init__(self, inner, table: ConnectionTable):
        self.inner, self.table = inner, table
        self.transport = None
        self.early = b""  # bytes received while queued
        self.started = False
        # NOTE: the table may admit from inside another connection's callbacks: start on the loop
        self.conn = table.admit(lambda: asyncio.get_running_loop().call_soon(self._admitted))

    def connection_made(self, transport) -> None:
        self.transport = transport
        if not self.conn.admitted:
            transport.pause_reading()
        self.table.made(self.conn, transport)

    def _admitted(self) -> None:
        if self.conn.closed or self.started:
            return
        self.started = True
        self.inner.connection_made(self.transport)
        self.transport.resume_reading()
        if self.early:
            data, self.early = self.early, b""
            self.data_received(data)

    def data_received(self, data: bytes) -> None:
        if not self.started:
            self.early += data
            return
        self.conn.data_seen = True
        self.inner.data_received(data)

    def eof_received(self):
        return self.inner.eof_received() if self.started else None

    def pause_writing(self) -> None:
        if self.started:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.conn.stalled_since = None  # the client took bytes
        if self.started:
            self.inner.resume_writing()

    def connection_lost(self, exc) -> None:
        self.table.lost(self.conn)
        if self.started:
            self.inner.connection_lost(exc)


class BoundedSite(web.TCPSite):
    """A TCPSite whose connections go through `table` (see the module docstring)."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, *, table: ConnectionTable):
        super().__init__(runner, host, port, backlog=LISTEN_BACKLOG)
        self.table = table
        self._sweeper: asyncio.TimerHandle | None = None

    def _factory(self) -> asyncio.Protocol:
        counted = _Counted(self._runner.server(), self.table)
        return _Refused() if counted.conn is None else counted

    def _sweep(self) -> None:
        self.table.sweep(self.table.clock())
        delay = min(SWEEP_S, self.table.write_timeout_s / 4)
        self._sweeper = asyncio.get_running_loop().call_later(delay, self._sweep)

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with its runner (TCPSite.start, own factory)
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._factory, self._host, self._port, backlog=self._backlog)
        self._bound_port = self._server.sockets[0].getsockname()[1]
        self._sweep()

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        self.table.close_queue()
        await super().stop()
