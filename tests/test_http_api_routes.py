"""The coordinator's HTTP API end to end, everything but completions: /v1/models, /health,
/v1/cluster and /metrics, OpenAI-style errors for bad input (the server stays healthy), typed
errors in the `openai` client, a client disconnect freeing every block, 503 from a backend that
is not running, and `pdserve serve` answering and stopping on SIGINT. The server harness is
`http_harness`; completions are in test_http_api.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import time

import openai
import pytest
from http_harness import CONFIG, POLL_S, Server, serve, wait_settled

from deploy.in_process import LocalEngineBackend
from engine.engine import LLMEngine


# ---- the other routes ----------------------------------------------------------------------
def test_models_health_cluster_and_metrics(http_server):
    http_server.client.completions.create(model="tiny", prompt="count me", max_tokens=4, temperature=0)
    assert [m.id for m in http_server.client.models.list().data] == ["tiny"]
    status, body = http_server.get("/health")
    assert status == 200 and json.loads(body)["status"] == "ok"
    status, body = http_server.get("/v1/cluster")
    info = json.loads(body)
    [w] = info["workers"]
    assert status == 200 and w["role"] == "colocated" and w["block_size"] == 16 and w["total_blocks"] == 256
    assert w["free_blocks"] + w["cached_blocks"] + w["used_blocks"] == 256
    assert info["ledger"] == {"active_requests": 0, "owned_blocks": 0}
    assert http_server.metric("pdserve_time_to_first_token_seconds_count") > 0
    assert http_server.metric("pdserve_time_per_output_token_seconds_count") > 0
    assert http_server.metric("pdserve_requests_total", status="ok") > 0
    assert http_server.metric("pdserve_generation_tokens_total") >= 4
    assert http_server.metric("pdserve_pool_blocks", worker="local-0", state="total") == 256
    assert http_server.metric("pdserve_queue_depth") == 0
    assert http_server.metric("pdserve_requests_in_flight") == 0


BAD = [
    (b"{not json", 400, None),
    ({"model": "tiny", "max_tokens": 4}, 400, "prompt"),
    ({"model": "tiny", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"model": "tiny", "prompt": "x", "n": 100}, 400, "n"),
    ({"model": "tiny", "prompt": [65] * 2040, "max_tokens": 16}, 400, "prompt"),
    ({"model": "tiny", "prompt": [600]}, 400, "prompt"),
    ({"model": "tiny", "prompt": "x", "n": 16, "max_tokens": 300}, 400, "prompt"),  # refused by the engine
    ({"model": "gpt-17", "prompt": "x"}, 404, "model"),
    ({"model": "tiny", "prompt": "x", "echo": True}, 400, "echo"),
    ({"model": "tiny", "prompt": ["a", "b"]}, 400, "prompt"),
    (b'{"prompt": "' + b"x" * (2 << 20) + b'"}', 413, None),
]
KIND = {400: "invalid_request", 404: "model_not_found", 413: "http_413"}


@pytest.mark.parametrize("body,status,param", BAD)
def test_bad_input_gets_openai_error_and_server_stays_healthy(http_server, body, status, param):
    kind = KIND[status]
    before = http_server.metric("pdserve_errors_total", kind=kind)
    got, raw = http_server.post(body)
    err = json.loads(raw)["error"]
    assert got == status and err["message"] and err["type"] and "code" in err and err["param"] == param
    assert http_server.metric("pdserve_errors_total", kind=kind) == before + 1
    assert http_server.get("/health")[0] == 200
    r = http_server.client.completions.create(model="tiny", prompt="still fine", max_tokens=2, temperature=0)
    assert r.usage.completion_tokens == len(r.choices[0].token_ids) > 0


def test_openai_client_sees_typed_errors(http_server):
    with pytest.raises(openai.BadRequestError, match="temperature"):
        http_server.client.completions.create(model="tiny", prompt="x", temperature=-1)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        http_server.client.completions.create(model="nope", prompt="x")


def _open_request(http_server: Server, body: dict) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", http_server.port), timeout=30)
    data = json.dumps(body).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    return s


@pytest.fixture(scope="module")
def roomy_server(http_loop):
    """A server whose pool holds 16 choices of 2,000 tokens: a request that outlasts any delay in
    noticing the client leave (the default pool would finish a long request in ~2 s)."""
    from dataclasses import replace

    backend = LocalEngineBackend(replace(CONFIG, num_blocks=2100)).start()
    served = serve(http_loop, backend)
    yield served
    asyncio.run_coroutine_threadsafe(served.runner.cleanup(), http_loop).result(30)
    backend.close()


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_frees_every_block(roomy_server, stream):
    http_server = roomy_server
    aborted = http_server.backend.aborted
    gone = http_server.metric("pdserve_requests_total", status="aborted")
    s = _open_request(http_server, {"model": "tiny", "prompt": "a long one", "max_tokens": 2000, "n": 16,
                                    "temperature": 1.0, "stream": stream, "ignore_eos": True})
    if stream:
        got = b""
        while b"data: " not in got:
            got += s.recv(4096)
    deadline = time.monotonic() + POLL_S  # the backend's stats snapshot trails the first token
    while http_server.backend.info()["ledger"]["active_requests"] == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    # it is running when the client leaves
    assert http_server.backend.info()["ledger"]["active_requests"] == 1
    s.close()
    wait_settled(http_server)
    assert http_server.backend.aborted == aborted + 1
    assert http_server.metric("pdserve_requests_total", status="aborted") == gone + 1
    assert http_server.get("/health")[0] == 200


def test_backend_down_is_503_fast(http_loop, http_server):
    e = http_server.backend.engine
    down = LocalEngineBackend(engine=LLMEngine(CONFIG, loaded=(e.model, e.model_config, e.tokenizer)))  # idle
    srv = serve(http_loop, down)
    try:
        status, raw = srv.post({"model": "tiny", "prompt": "x"})
        assert status == 503 and "not running" in json.loads(raw)["error"]["message"]
        assert srv.get("/health")[0] == 503
    finally:
        asyncio.run_coroutine_threadsafe(srv.runner.cleanup(), http_loop).result(30)


def test_serve_cli_answers_and_stops_on_sigint():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "pdserve_cli.main", "serve", "--model", "tiny", "--port", "0",
           "--num-blocks", "64"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        seen, m, deadline = "", None, time.monotonic() + 120
        while m is None and time.monotonic() < deadline and proc.poll() is None:
            # all that arrived, not one line: lines left in a reader buffer are invisible to select
            if select.select([proc.stdout], [], [], 1.0)[0]:
                seen += os.read(proc.stdout.fileno(), 1 << 16).decode(errors="replace")
                m = re.search(r"http://127\.0\.0\.1:(\d+)/v1", seen)
        assert m, seen
        srv = Server(None, None, None, int(m.group(1)))
        status, raw = srv.post({"model": "tiny", "prompt": "hi", "max_tokens": 3, "temperature": 0})
        assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 3
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0 and "stopped" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
