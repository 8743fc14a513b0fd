"""The HTTP front door against the in-process engine: with an API key, every route but /health
wants the bearer token (401 otherwise); beyond `max_active` requests in flight a new one gets
429 with Retry-After at once; an unhandled error answers 500 with an incident id, never the
exception's text; a slow body gets 408; tokenizing a prompt never stalls the event loop."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest
from http_harness import CONFIG, serve

from coordinator.http import HTTPConfig
from deploy.in_process import LocalEngineBackend


@pytest.fixture(scope="module")
def backend():
    local = LocalEngineBackend(CONFIG).start()
    yield local
    local.close()


def _call(url: str, body: dict | None = None, key: str | None = None, timeout: float = 60):
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(url, json.dumps(body).encode() if body else None, headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def _stop(server, loop) -> None:
    asyncio.run_coroutine_threadsafe(server.runner.cleanup(), loop).result(30)


def test_api_key_guards_every_route_but_health(http_loop, backend):
    server = serve(http_loop, backend, HTTPConfig(api_key="s3cret"))
    try:
        body = {"prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0}
        for key in (None, "wrong"):
            status, _, raw = _call(server.url + "/v1/completions", body, key)
            assert status == 401 and json.loads(raw)["error"]["type"] == "authentication_error"
        for path in ("/v1/models", "/metrics", "/v1/cluster"):
            assert _call(server.url + path)[0] == 401
            assert _call(server.url + path, key="s3cret")[0] == 200
        assert _call(server.url + "/health")[0] == 200
        status, _, raw = _call(server.url + "/v1/completions", body, "s3cret")
        assert status == 200 and len(json.loads(raw)["choices"][0]["token_ids"]) == 2
    finally:
        _stop(server, http_loop)


def test_beyond_max_active_requests_get_429_with_retry_after(http_loop, backend):
    server = serve(http_loop, backend, HTTPConfig(max_active=2))
    long = {"prompt": [5, 6, 7], "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            running = [pool.submit(_call, server.url + "/v1/completions", long) for _ in range(2)]
            deadline = time.monotonic() + 30
            while backend.info()["ledger"]["active_requests"] < 2 and time.monotonic() < deadline:
                time.sleep(0.02)
            status, headers, raw = _call(server.url + "/v1/completions", {"prompt": [1], "max_tokens": 1})
            assert status == 429 and headers.get("Retry-After") == "1"
            assert json.loads(raw)["error"]["type"] == "rate_limit_error"
            assert all(f.result(timeout=120)[0] == 200 for f in running)
        assert _call(server.url + "/v1/completions", {"prompt": [1], "max_tokens": 1})[0] == 200
    finally:
        _stop(server, http_loop)


class _Broken:
    """A backend whose info() fails with a message that must not reach clients."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def info(self):
        raise RuntimeError("secret detail of the failure")


def test_an_unhandled_error_answers_500_with_an_incident_id_only(http_loop, backend):
    server = serve(http_loop, _Broken(backend))
    try:
        status, _, raw = _call(server.url + "/v1/cluster")
        message = json.loads(raw)["error"]["message"]
        assert status == 500 and "incident" in message and "secret" not in message
    finally:
        _stop(server, http_loop)


def test_a_body_that_never_arrives_gets_408(http_loop, backend):
    server = serve(http_loop, backend, HTTPConfig(read_timeout_s=0.5))
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{")
            assert sock.recv(64).startswith(b"HTTP/1.1 408")
    finally:
        _stop(server, http_loop)


def test_tokenizing_a_prompt_does_not_block_the_event_loop(http_loop, backend):
    """A tokenizer held inside encode() must not keep /health from answering."""
    release, entered = threading.Event(), threading.Event()

    class HeldTokenizer:
        def __getattr__(self, name):
            return getattr(backend.tokenizer, name)

        def encode(self, text, *args, **kwargs):
            entered.set()
            release.wait(60)
            return backend.tokenizer.encode(text, *args, **kwargs)

    class Held(_Broken):
        tokenizer = HeldTokenizer()

        def info(self):
            return self.inner.info()

    server = serve(http_loop, Held(backend))
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            answer = pool.submit(_call, server.url + "/v1/completions", {"prompt": "hello", "max_tokens": 1})
            assert entered.wait(30)
            # answered while encode() is still held: a blocked loop would time this call out
            assert _call(server.url + "/health", timeout=10)[0] == 200
            release.set()
            assert answer.result(timeout=90)[0] == 200
    finally:
        release.set()
        _stop(server, http_loop)
