"""The cluster's admin routes: `POST /v1/cluster/workers/{name}/drain` (optional body
`{"timeout_s": T}`) drains one worker and answers what happened to its requests, and
`POST /v1/cluster/scale` (body `{"prefill": P, "decode": D}`, either optional, plus `timeout_s`
for the drains) brings each role to that many workers (coordinator.drain does both). They sit
behind the same API key as every other route (coordinator.guard, checked by the HTTP layer's
middleware before any handler runs). A server without a key keeps them shut (403 naming the flags
that open them) unless started with `--admin`: otherwise any local process, or a web page in the
operator's browser, could scale or drain the cluster. A backend without workers (the in-process
engine) answers 404. Bodies are JSON only: a request without `Content-Type: application/json` is
415, so no HTML form (the only cross-site POST a browser sends without asking the server first)
reaches a handler. Bodies are bounded like every other (size by the app, read time by
`read_timeout_s`, nesting and encoding by coordinator.fields.json_object).
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


class AdminDisabled(APIError):
    """403: no API key and no `--admin`: the admin routes are shut."""

    status, type, kind = 403, "permission_error", "admin_disabled"


class NotJSON(APIError):
    """415: an admin request whose body is not declared JSON."""

    status, type, kind = 415, "invalid_request_error", "unsupported_media_type"


ADMIN_DISABLED = ("the admin routes (drain, scale) are shut: this server has no API key. Restart it with "
                  "--api-key-file F (or $PDSERVE_API_KEY) and call with that key, or with --admin to open "
                  "them to every local process without a key")


@runtime_checkable
class Scalable(Protocol):
    """A backend whose workers can be drained and scaled (coordinator.cluster.ClusterBackend)."""

    async def drain_worker(self, name: str, timeout_s: float | None = None) -> dict: ...

    async def scale(self, targets: dict, timeout_s: float | None = None) -> dict: ...


def admin_routes(backend, read_timeout_s: float, enabled: bool) -> list[web.RouteDef]:
    """The admin routes over `backend`, for `app.router.add_routes`; `enabled`: an API key is set
    or the operator passed `--admin` (else every call is 403)."""

    def scalable(request: web.Request):
        if not isinstance(backend, Scalable):
            raise NotACluster("this server runs an in-process engine: there are no workers to drain or scale")
        if not enabled:
            raise AdminDisabled(ADMIN_DISABLED)
        if request.content_type != "application/json":
            raise NotJSON(f"admin requests must be 'Content-Type: application/json', got "
                          f"'{request.content_type[:64]}'")
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
        cluster = scalable(request)
        fields = await body(request)
        result = await cluster.drain_worker(request.match_info["name"], timeout_field(fields))
        return web.json_response(result)

    async def scale(request: web.Request) -> web.Response:
        cluster = scalable(request)
        fields = await body(request)
        targets = {role: count for role, count in fields.items() if role != "timeout_s"}
        result = await cluster.scale(targets, timeout_field(fields))
        return web.json_response(result)

    return [web.post("/v1/cluster/workers/{name}/drain", drain), web.post("/v1/cluster/scale", scale)]
