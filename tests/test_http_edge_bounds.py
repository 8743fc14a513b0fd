"""Issue 28, items 3 and 11: every field is bounded at the HTTP edge, and each bad one is a 400
with the OpenAI error body, never a 500, a dead engine or a crashed encoder: integers past the
vocabulary or msgpack's int64, lone surrogates in any string, nesting 200k deep (refused before
`json.loads` could recurse), non-UTF-8 bytes in `Authorization`; and connections that never finish
their headers are closed, with a cap on open connections (503 past it)."""

from __future__ import annotations

import json
import socket

import pytest
from http_harness import CONFIG, serve

from coordinator.edge import json_depth_exceeds
from coordinator.http import HTTPConfig
from deploy.in_process import LocalEngineBackend
from protocol.codec import encode
from protocol.messages import Submit


@pytest.fixture(scope="module")
def backend():
    local = LocalEngineBackend(CONFIG).start()
    yield local
    local.close()


@pytest.fixture(scope="module")
def server(http_loop, backend):
    served = serve(http_loop, backend)
    yield served
    _stop(served, http_loop)


def _stop(served, loop) -> None:
    import asyncio
    asyncio.run_coroutine_threadsafe(served.runner.cleanup(), loop).result(30)


def _error(status: int, raw: bytes) -> dict:
    body = json.loads(raw)
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"]), body
    return body["error"]


def _raw_request(port: int, head: bytes, body: bytes = b"") -> tuple[int, bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(head + body)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    status = int(data.split(b" ", 2)[1])
    return status, data.split(b"\r\n\r\n", 1)[1]


def _healthy(server) -> None:
    status, raw = server.post({"prompt": [72, 105], "max_tokens": 2, "temperature": 0})
    assert status == 200 and len(json.loads(raw)["choices"][0]["token_ids"]) == 2
    assert server.backend.health() == (True, "ok")


@pytest.mark.parametrize("field,value", [
    ("top_k", 10**30), ("top_k", 2**63), ("seed", 2**64), ("seed", -1), ("max_tokens", 10**30),
    ("n", 10**30), ("min_tokens", 10**30), ("logprobs", 10**30), ("logprobs", 21),
    ("stop_token_ids", [2**40]), ("prompt", [2**64]), ("temperature", 10**400),
])
def test_huge_integers_are_400(server, field, value):
    body = {"prompt": [72, 105], "max_tokens": 2, field: value}
    status, raw = server.post(body)
    assert status == 400, raw
    assert _error(status, raw)["param"] == field


def test_top_k_bounded_by_the_vocabulary(server, backend):
    vocab = backend.vocab_size
    status, raw = server.post({"prompt": [72, 105], "max_tokens": 2, "top_k": vocab + 1})
    error = _error(status, raw)
    assert status == 400 and error["param"] == "top_k" and "vocabulary" in error["message"]
    status, _ = server.post({"prompt": [72, 105], "max_tokens": 2, "top_k": vocab})
    assert status == 200
    _healthy(server)


LONE = '"\\ud800"'  # JSON text of a lone surrogate: json.loads makes it a str UTF-8 cannot encode


@pytest.mark.parametrize("path,template,param", [
    ("/v1/completions", '{"prompt": [72, 105], "stop": [%s]}', "stop"),
    ("/v1/completions", '{"prompt": %s}', "prompt"),
    ("/v1/completions", '{"prompt": "ok", "model": %s}', "model"),
    ("/v1/completions", '{"prompt": "ok", "user": %s}', "user"),
    ("/v1/completions", '{"prompt": "ok", %s: 1}', "\\ud800"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": %s}]}', "messages"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "stop": %s}', "stop"),
])
def test_lone_surrogates_are_400(server, path, template, param):
    status, raw = server.post((template % LONE).encode(), path)
    assert status == 400, raw
    assert _error(status, raw)["param"] == param
    _healthy(server)


def test_valid_surrogate_pairs_pass(server):
    pair = b'"\\ud83d\\ude00"'  # one character, as JSON writes it outside the BMP
    status, raw = server.post(b'{"prompt": ' + pair + b', "max_tokens": 2, "stop": [' + pair + b']}')
    assert status == 200, raw


def test_submit_with_a_lone_surrogate_cannot_be_encoded():
    """What the edge protects: the worker protocol cannot carry such a string (the SamplingParams
    refuse it themselves, one bound for every layer)."""
    from protocol.sampling import SamplingParams
    with pytest.raises(ValueError, match="Unicode"):
        SamplingParams(stop=("\ud800",))
    with pytest.raises(UnicodeEncodeError):
        encode(Submit("r", [1], SamplingParams(), decode_worker="\ud800"))


def test_depth_scan_respects_strings_and_escapes():
    assert not json_depth_exceeds(b'{"a": "[[[[[[[[[["}', 2)
    assert not json_depth_exceeds(b'{"a": "\\"[[[[[[[["}', 2)
    assert json_depth_exceeds(b'{"a": [[["x"]]]}', 3)
    assert not json_depth_exceeds(b'{"a": [[["x"]]]}', 4)
    assert not json_depth_exceeds(b'[[]' + b'[]' * 1000 + b']', 2)
    assert not json_depth_exceeds(b'"' + b'\\"' * 100000, 2)  # unterminated: one linear pass


@pytest.mark.parametrize("path,make", [
    ("/v1/completions", lambda deep: b'{"prompt": ' + deep + b'}'),
    ("/v1/completions", lambda deep: deep),
    ("/v1/chat/completions", lambda deep: b'{"messages": [{"role": "user", "content": ' + deep + b'}]}'),
])
def test_deep_nesting_is_400_before_parsing(server, path, make):
    deep = b"[" * 200_000 + b"]" * 200_000
    status, raw = server.post(make(deep), path)
    assert status == 400, raw[:200]
    assert "deeper than" in _error(status, raw)["message"]
    _healthy(server)


def test_moderate_nesting_is_judged_on_its_fields(server):
    nested = b"[" * 30 + b"]" * 30
    status, raw = server.post(b'{"prompt": [72, 105], "max_tokens": 2, "stop": ' + nested + b"}")
    assert status == 400 and _error(status, raw)["param"] == "stop"


def test_non_utf8_authorization_is_401(http_loop, backend):
    served = serve(http_loop, backend, HTTPConfig(api_key="s3cret"))
    try:
        body = json.dumps({"prompt": [72, 105], "max_tokens": 2}).encode()
        for auth in (b"Bearer \xff\xfe\x80", b"\xff\xfe \xc3", b"Bearer s3cret\xff"):
            head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Authorization: " + auth + b"\r\nContent-Length: " + str(len(body)).encode()
                    + b"\r\nConnection: close\r\n\r\n")
            status, raw = _raw_request(served.port, head, body)
            assert status == 401, raw
            assert _error(status, raw)["type"] == "authentication_error"
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer s3cret\r\n"
                b"Content-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n")
        assert _raw_request(served.port, head, body)[0] == 200
    finally:
        _stop(served, http_loop)


def _closed_by_server(s: socket.socket) -> bool:
    """True once the server closed the connection (bounded by the socket's timeout)."""
    try:
        while s.recv(4096):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


HEALTH = b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"


def test_slowloris_connections_are_closed_and_capped(http_loop, backend):
    served = serve(http_loop, backend, HTTPConfig(header_timeout_s=1.0, max_connections=4, max_queued=0))
    slow = []
    try:
        for _ in range(4):
            s = socket.create_connection(("127.0.0.1", served.port), timeout=30)
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # headers never finished
            slow.append(s)
        # past the cap: answered 503 at once, with the OpenAI error body
        status, raw = _raw_request(served.port, HEALTH)
        assert status == 503 and _error(status, raw)["type"] == "service_unavailable"
        for s in slow:  # the header timeout closes each (the socket's 30 s timeout only bounds the wait)
            try:
                s.sendall(b"X-Slow: 1\r\n")
            except OSError:  # already closed by the server
                continue
            assert _closed_by_server(s)
        status, _ = _raw_request(served.port, HEALTH)
        assert status == 200  # the slots came back
    finally:
        for s in slow:
            s.close()
        _stop(served, http_loop)
