"""The cluster's admin routes: `POST /v1/cluster/workers/{name}/drain` (optional body
`{"timeout_s": T}`) drains one worker and answers what happened to its requests, and
`POST /v1/cluster/scale` (body `{"prefill": P, "decode": D}`, either optional, plus `timeout_s`
for the drains) brings each role to that many workers (coordinator.drain does both). They sit
behind the same API key as every other route (coordinator.guard, checked by the HTTP layer's
middleware before any handler runs); a backend without workers (the in-process engine) answers
404. Bodies are bounded like every other (size by the app, read time by `read_timeout_s`, nesting
and encoding by coordinator.fields.json_object).
"""

from __future__ import annotations

import asyncio
from typing import Protocol, runtime_checkable

from aiohttp import web

from coordinator.bounded import bounded
from coordinator.errors import APIError
from coordinator.fields import json_object, num_field

MAX_DRAIN_TIMEOUT_S = 3600.0


class NotACluster(APIError):
    """404: the backend has no workers to drain or scale."""

    status, type, kind = 404, "invalid_request_error", "not_a_cluster"


@runtime_checkable
class Scalable(Protocol):
    """A backend whose workers can be drained and scaled (coordinator.cluster.ClusterBackend)."""

    async def drain_worker(self, name: str, timeout_s: float | None = None) -> dict: ...

    async def scale(self, targets: dict, timeout_s: float | None = None) -> dict: ...


def admin_routes(backend, read_timeout_s: float) -> list[web.RouteDef]:
    """The admin routes over `backend`, for `app.router.add_routes`."""

    def scalable():
        if not isinstance(backend, Scalable):
            raise NotACluster("this server runs an in-process engine: there are no workers to drain or scale")
        return backend

    async def body(request: web.Request) -> dict:
        if not request.can_read_body:
            return {}
        try:
            raw = await bounded(request.read(), read_timeout_s)
        except asyncio.TimeoutError:
            raise web.HTTPRequestTimeout(reason=f"request body not received within {read_timeout_s:g}s") \
                from None
        return json_object(raw) if raw.strip() else {}

    def timeout_field(fields: dict) -> float | None:
        if fields.get("timeout_s") is None:
            return None
        return num_field(fields, "timeout_s", 0.0, 0.0, MAX_DRAIN_TIMEOUT_S)

    async def drain(request: web.Request) -> web.Response:
        cluster = scalable()
        fields = await body(request)
        result = await cluster.drain_worker(request.match_info["name"], timeout_field(fields))
        return web.json_response(result)

    async def scale(request: web.Request) -> web.Response:
        cluster = scalable()
        fields = await body(request)
        targets = {role: count for role, count in fields.items() if role != "timeout_s"}
        result = await cluster.scale(targets, timeout_field(fields))
        return web.json_response(result)

    return [web.post("/v1/cluster/workers/{name}/drain", drain), web.post("/v1/cluster/scale", scale)]
