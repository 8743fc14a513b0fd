"""The coordinator's OpenAI-compatible HTTP API (aiohttp).

Routes: `POST /v1/completions` and `POST /v1/chat/completions` (JSON, or server-sent events
with `stream`; a chat request is rendered to a prompt with the model's chat template by
coordinator.chat), `GET /v1/models`, `GET /health`, `GET /metrics` (Prometheus text),
`GET /v1/cluster` (the backend's `info()`; the drain and scale routes: coordinator.admin).
The layer sees only `CompletionRequest`s, backend events and the backend methods documented in
coordinator.backend, so the in-process engine and the Ray cluster serve the same API. Text is
produced here, incrementally per choice (coordinator.detokenize): multi-byte characters split
across tokens are held back until complete, stop strings cut the text and the token ids at the
same token. Every error, from bad JSON to a dead worker, is the OpenAI error body with its
status; every wait on the backend is bounded by `HTTPConfig.stall_timeout_s`; a client that
goes away (disconnect or cancellation) closes the backend's event stream, which aborts the
request and frees its blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from dataclasses import dataclass

from aiohttp import web

from coordinator.admin import admin_routes
from coordinator.bounded import bounded
from coordinator.chat import CHAT, parse_chat_request
from coordinator.completion import TEXT, CompletionRun, Delta, ResponseFormat
from coordinator.completion_request import (
    APIError,
    InternalError,
    ModelNotFound,
    parse_completion_request,
    resolve_prompt,
)
from coordinator.connections import BoundedSite, ConnectionTable
from coordinator.guard import InFlightLimit, authorization_bytes, check_api_key
from coordinator.metrics import CONTENT_TYPE, Metrics
from protocol.sampling import MAX_N

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HTTPConfig:
    host: str = "127.0.0.1"        # where `serve` binds (loopback unless told otherwise)
    port: int = 8000
    max_n: int = MAX_N             # largest `n` accepted
    max_body_bytes: int = 1 << 20  # larger request bodies get 413
    stall_timeout_s: float = 60.0  # longest wait for the backend's next event before the request fails (504)
    api_key: str | None = None     # bearer token every route but /health requires (None: no auth)
    admin: bool = False            # without api_key, open the admin routes (drain, scale) anyway
    max_active: int = 256          # completion requests in flight; beyond, 429 with Retry-After
    read_timeout_s: float = 30.0   # longest wait for a request body (a slow client gets 408)
    header_timeout_s: float = 15.0  # a connection must finish its request headers this soon after opening
                                    # or after its last response (else closed; also the keep-alive bound)
    max_connections: int = 1024    # connections served at once; more wait in a queue while an idle or
                                   # suspect one is evicted for them (coordinator.connections)
    max_queued: int = 4096         # connections waiting for a slot at most; one more gets 503 and is closed
    write_timeout_s: float = 30.0  # a client that takes none of its unsent bytes (any response, any
                                   # streamed chunk) for this long is cut
    max_pipelined: int = 4         # requests a connection may send ahead of reading their answers;
                                   # one more is answered 429 and the connection closed
    # once every choice finished here, how long to wait for the backend's closing FinalEvent before
    # closing its stream (which aborts the backend request)
    final_event_timeout_s: float = 1.0


BACKEND = web.AppKey("backend", object)
CONFIG = web.AppKey("config", HTTPConfig)
METRICS = web.AppKey("metrics", Metrics)
IN_FLIGHT = web.AppKey("in_flight", InFlightLimit)
CONNECTIONS = web.AppKey("connections", ConnectionTable)


class Pipelined(APIError):
    """429: a connection sent more requests ahead of reading their answers than allowed."""

    status, type, kind = 429, "rate_limit_error", "pipelined"


def _error_response(e: APIError) -> web.Response:
    return web.json_response(e.body(), status=e.status, headers=getattr(e, "headers", None))


def _status_label(status: int) -> str:
    return "client_error" if status < 500 else "server_error"


@web.middleware
async def _connection_bounds(request: web.Request, handler):
    """Tells the connection table when each request starts and ends (coordinator.connections);
    a request past the pipelining bound is answered 429 and its connection closed."""
    table = request.app[CONNECTIONS]
    conn = table.find(request.transport)
    if conn is None:  # not served through BoundedSite (aiohttp's own test server)
        return await handler(request)
    try:
        if not table.begin(conn):
            request.app[METRICS].count_error(Pipelined.kind)
            resp = _error_response(Pipelined(f"more than {table.max_pipelined} requests sent ahead of "
                                              "reading their answers: read each answer before sending more"))
            resp.force_close()
            return resp
        return await handler(request)
    finally:
        table.finish(conn)


@web.middleware
async def _errors(request: web.Request, handler):
    """Every failure leaves as the OpenAI error body."""
    metrics = request.app[METRICS]
    try:
        check_api_key(request.app[CONFIG].api_key, request.path, authorization_bytes(request.raw_headers))
        return await handler(request)
    except APIError as e:
        metrics.count_error(e.kind)
        return _error_response(e)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        metrics.count_error(f"http_{e.status}")
        body = {"error": {"message": e.reason, "type": "invalid_request_error" if e.status < 500 else
                          "internal_error", "param": None, "code": None}}
        return web.json_response(body, status=e.status)
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        incident = uuid.uuid4().hex[:12]  # the client gets this id; the log has the details
        log.exception("unhandled error on %s (incident %s)", request.path, incident)
        metrics.count_error("internal")
        return _error_response(InternalError(f"internal error (incident {incident})"))


async def _completions(request: web.Request) -> web.StreamResponse:
    cfg = request.app[CONFIG]
    return await _answer(request, TEXT, lambda raw, backend: parse_completion_request(raw, max_n=cfg.max_n))


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    cfg = request.app[CONFIG]

    def parse(raw: bytes, backend):
        template = getattr(backend.tokenizer, "chat_template", None)
        return parse_chat_request(raw, template, max_n=cfg.max_n)

    return await _answer(request, CHAT, parse)


async def _answer(request: web.Request, shape: ResponseFormat, parse) -> web.StreamResponse:
    """One completion request, parsed by `parse(raw body, backend)` and answered in `shape`."""
    app = request.app
    backend, cfg, metrics = app[BACKEND], app[CONFIG], app[METRICS]
    names = backend.model_names()

    def prepare(raw: bytes):  # NOTE: on a thread: templates and tokenizers must not stall the event loop
        creq = parse(raw, backend)
        if creq.model and creq.model not in names:
            raise ModelNotFound(f"the model '{creq.model}' does not exist; this server serves: "
                                f"{', '.join(names)}")
        return resolve_prompt(creq, backend.tokenizer, backend.max_context, backend.vocab_size)

    try:
        try:
            raw = await bounded(request.read(), cfg.read_timeout_s)
        except asyncio.TimeoutError:
            raise web.HTTPRequestTimeout(reason=f"request body not received within {cfg.read_timeout_s:g}s") \
                from None
        creq = await asyncio.to_thread(prepare, raw)
        app[IN_FLIGHT].enter()
    except (APIError, web.HTTPException) as e:
        metrics.request_refused(_status_label(e.status))
        raise
    try:
        return await _run(request, creq, creq.model or names[0], shape)
    finally:
        app[IN_FLIGHT].leave()


async def _run(request: web.Request, creq, model: str, shape: ResponseFormat) -> web.StreamResponse:
    app = request.app
    backend, cfg, metrics = app[BACKEND], app[CONFIG], app[METRICS]
    metrics.request_admitted(len(creq.prompt_ids))
    run = CompletionRun(backend, cfg, metrics, creq, shape)
    status = "aborted"
    try:
        if creq.stream:
            resp = await _stream(request, run, model, shape)
        else:
            resp = await _whole(run, model, shape)
        status = "ok" if run.error is None else _status_label(run.error.status)
        return resp
    except APIError as e:
        status = _status_label(e.status)
        raise
    except ConnectionResetError:  # the client went away mid-answer
        raise
    except Exception:
        status = "server_error"
        raise
    finally:  # CancelledError / ConnectionResetError (client gone) leave status "aborted"
        run.record(status)


def _head(run: CompletionRun, model: str, object_name: str) -> dict:
    return {"id": run.creq.request_id, "object": object_name, "created": int(time.time()), "model": model,
            "system_fingerprint": run.system_fingerprint()}


async def _whole(run: CompletionRun, model: str, shape: ResponseFormat) -> web.Response:
    texts = [""] * len(run.choices)
    async for d in run.deltas():
        texts[d.index] += d.text
    choices = [shape.choice(i, texts[i], c.ids, c.finish_reason, run.choice_logprobs(i))
               for i, c in enumerate(run.choices)]
    return web.json_response({**_head(run, model, shape.object), "choices": choices, "usage": run.usage(),
                              "pdserve": run.timing()})


async def _write(resp: web.StreamResponse, data: bytes, timeout_s: float) -> None:
    """One chunk to a client that must take it within timeout_s (else the stream is dropped)."""
    try:
        await bounded(resp.write(data), timeout_s)
    except asyncio.TimeoutError:
        raise ConnectionResetError(f"the client took no data for {timeout_s:g}s") from None


def _sse(obj) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"


async def _stream(request: web.Request, run: CompletionRun, model: str,
                  shape: ResponseFormat) -> web.StreamResponse:
    """Each delta is written as soon as it exists; only the one that finishes the last choice
    waits for the end of the backend's stream, so it can carry usage and timings."""
    it = run.deltas().__aiter__()
    async with contextlib.aclosing(it):
        first = await it.__anext__()  # errors before the first token still get their own status
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        head = _head(run, model, shape.chunk_object)
        last: dict | None = None
        delta: Delta | None = first
        started: set[int] = set()  # choices that already sent a chunk
        try:
            while delta is not None:
                choice = shape.chunk_choice(delta.index, delta.text, delta.token_ids, delta.finish_reason,
                                            delta.index not in started, delta.logprobs)
                started.add(delta.index)
                chunk = {**head, "choices": [choice]}
                if run.creq.continuous_usage:  # vLLM's stream_options.continuous_usage_stats
                    chunk["usage"] = run.usage()
                if all(c.finish_reason is not None for c in run.choices):
                    last = chunk  # the final delta: held until the final event has been read
                else:
                    await _write(resp, _sse(chunk), request.app[CONFIG].write_timeout_s)
                delta = await anext(it, None)
            last = last or {**head, "choices": []}
            last["usage"] = run.usage()
            last["pdserve"] = run.timing()
            await resp.write(_sse(last))
        except APIError as e:  # mid-stream failure: the status is already sent, say it in the stream
            request.app[METRICS].count_error(e.kind)
            run.error = e
            await resp.write(_sse(e.body()))
        await resp.write(_sse(b"[DONE]"))
        await resp.write_eof()
        return resp


async def _models(request: web.Request) -> web.Response:
    b = request.app[BACKEND]
    data = [{"id": name, "object": "model", "created": 0, "owned_by": "pdserve",
             "max_model_len": b.max_context} for name in b.model_names()]
    return web.json_response({"object": "list", "data": data})


async def _health(request: web.Request) -> web.Response:
    ok, msg = request.app[BACKEND].health()
    return web.json_response({"status": "ok" if ok else "unhealthy", "message": msg},
                             status=200 if ok else 503)


async def _metrics(request: web.Request) -> web.Response:
    body = request.app[METRICS].render() + request.app[BACKEND].metrics_text().encode()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def _cluster(request: web.Request) -> web.Response:
    return web.json_response(request.app[BACKEND].info())


def make_app(backend, config: HTTPConfig = HTTPConfig(), metrics: Metrics | None = None) -> web.Application:
    """The web app over `backend`; pass `metrics` to share one Metrics with a cluster backend."""
    app = web.Application(middlewares=[_connection_bounds, _errors], client_max_size=config.max_body_bytes)
    app[BACKEND], app[CONFIG], app[METRICS] = backend, config, metrics or Metrics()
    app[CONNECTIONS] = ConnectionTable(config.max_connections, config.max_queued, config.max_pipelined,
                                       config.write_timeout_s)
    app[IN_FLIGHT] = InFlightLimit(config.max_active)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _chat_completions)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/v1/cluster", _cluster)
    # drain, scale: coordinator.admin
    app.router.add_routes(admin_routes(backend, config.read_timeout_s, bool(config.api_key) or config.admin))
    return app


async def start_server(app: web.Application, host: str = "127.0.0.1", port: int = 8000,
                       shutdown_timeout_s: float = 5.0) -> tuple[web.AppRunner, int]:
    """Start listening; returns the runner (call `cleanup()` to stop) and the bound port."""
    cfg = app[CONFIG]
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                           shutdown_timeout=shutdown_timeout_s, keepalive_timeout=cfg.header_timeout_s)
    await runner.setup()
    await BoundedSite(runner, host, port, table=app[CONNECTIONS]).start()
    return runner, runner.addresses[0][1]


async def serve(app: web.Application, host: str = "127.0.0.1", port: int = 8000, ready=None) -> None:
    """Serve until cancelled; `ready(port)` is called once listening."""
    runner, bound = await start_server(app, host, port)
    log.info("pdserve API listening on http://%s:%d", host, bound)
    try:
        if ready is not None:
            ready(bound)
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
