"""The HTTP listener's connection bounds: at most `max_connections` open connections (one more is
answered 503 with the OpenAI error body and closed within a second, its request never read), and
every connection must send complete request headers within `header_timeout_s` of opening, or of
its previous response (aiohttp's keep-alive timer, which also fires on a connection that has not
finished its first request: a slowloris client trickling header bytes is closed then; a request
already being handled is not). Bodies have their own bound (HTTPConfig.read_timeout_s, 408), and
so do streamed writes. `BoundedSite` is an aiohttp `TCPSite` whose protocol factory counts
connections through a thin delegating protocol, so the count is exact even when many
connections are accepted in one event-loop turn.
"""

from __future__ import annotations

import asyncio
import json

from aiohttp import web

_BUSY_BODY = json.dumps({"error": {"message": "too many open connections: retry shortly",
                                   "type": "service_unavailable", "param": None, "code": None}}).encode()
BUSY_RESPONSE = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                 b"Retry-After: 1\r\nConnection: close\r\nContent-Length: " + str(len(_BUSY_BODY)).encode()
                 + b"\r\n\r\n" + _BUSY_BODY)


REFUSED_LINGER_S = 1.0  # a refused connection is closed this long after its 503 at the latest


class _Refused(asyncio.Protocol):
    """A connection past the cap: one 503, our side shut, closed within REFUSED_LINGER_S."""

    def __init__(self, on_refused):
        self.on_refused = on_refused

    def connection_made(self, transport) -> None:
        self.on_refused()
        transport.write(BUSY_RESPONSE)
        # NOTE: half-close, not close: closing with the client's request unread sends a reset
        # that can reach the client before the 503 does
        if transport.can_write_eof():
            transport.write_eof()
        asyncio.get_running_loop().call_later(REFUSED_LINGER_S, transport.close)

    def data_received(self, data: bytes) -> None:
        pass  # read and dropped, so nothing is left unread at close


class _Counted(asyncio.Protocol):
    """Delegates every protocol call to aiohttp's handler; frees its slot when the connection ends."""

    def __init__(self, inner, release):
        self.inner, self.release = inner, release

    def connection_made(self, transport) -> None:
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self.inner.data_received(data)

    def eof_received(self):
        return self.inner.eof_received()

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def connection_lost(self, exc) -> None:
        if self.release is not None:
            self.release()
            self.release = None
        self.inner.connection_lost(exc)


class BoundedSite(web.TCPSite):
    """A TCPSite that keeps at most `max_connections` connections open (see module docstring)."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, *, max_connections: int):
        super().__init__(runner, host, port)
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        self.max_connections, self.open, self.refused = max_connections, 0, 0

    def _release(self) -> None:
        self.open -= 1

    def _refused(self) -> None:
        self.refused += 1

    def _factory(self) -> asyncio.Protocol:
        if self.open >= self.max_connections:
            return _Refused(self._refused)
        self.open += 1
        return _Counted(self._runner.server(), self._release)

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with its runner (TCPSite.start, own factory)
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._factory, self._host, self._port, backlog=self._backlog)
        self._bound_port = self._server.sockets[0].getsockname()[1]
