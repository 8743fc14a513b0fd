"""The coordinator's HTTP API end to end: a real aiohttp server on a loopback port over a
LocalEngineBackend with the tiny model, driven by the real `openai` client and by raw HTTP.

Reference outputs come from a second LLMEngine sharing the backend's model (what
`pdserve generate --local` runs), so every comparison is against the engine itself.
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
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from coordinator.backend import LocalEngineBackend
from coordinator.detokenize import Detokenizer
from coordinator.http import HTTPConfig, make_app, start_server
from coordinator.protocol import InvalidRequest, parse_completion_request
from engine.engine import EngineConfig, LLMEngine
from engine.sampling import SamplingParams
from engine.tokenizer import ByteTokenizer

CFG = EngineConfig(model="tiny", num_blocks=256)
POLL_S = 20.0  # bound on waiting for the server to settle after a disconnect


class Server:
    def __init__(self, loop, backend, runner, port):
        self.loop, self.backend, self.runner, self.port = loop, backend, runner, port
        self.url = f"http://127.0.0.1:{port}"
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=60)

    def get(self, path: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=30) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def post(self, body: bytes | dict, path: str = "/v1/completions") -> tuple[int, bytes]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def metric(self, name: str, **labels) -> float:
        _, body = self.get("/metrics")
        for fam in text_string_to_metric_families(body.decode()):
            for s in fam.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    return s.value
        return 0.0


@pytest.fixture(scope="module")
def loop():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model on a shared CPU: thread spin-waiting costs more than it gives
    lp = asyncio.new_event_loop()
    t = threading.Thread(target=lp.run_forever, daemon=True)
    t.start()
    yield lp
    lp.call_soon_threadsafe(lp.stop)
    t.join(10)
    lp.close()
    torch.set_num_threads(threads)


def _serve(loop, backend) -> Server:
    app = make_app(backend, HTTPConfig(stall_timeout_s=30))
    runner, port = asyncio.run_coroutine_threadsafe(start_server(app, "127.0.0.1", 0), loop).result(30)
    return Server(loop, backend, runner, port)


@pytest.fixture(scope="module")
def server(loop):
    backend = LocalEngineBackend(CFG).start()
    srv = _serve(loop, backend)
    yield srv
    asyncio.run_coroutine_threadsafe(srv.runner.cleanup(), loop).result(30)
    backend.close()


@pytest.fixture(scope="module")
def ref(server):
    """An engine sharing the server's model: the `--local` reference."""
    e = server.backend.engine
    return LLMEngine(CFG, loaded=(e.model, e.model_config, e.tokenizer))


def _ref_choices(ref, prompt: str, **kw) -> list[dict]:
    [done] = ref.generate([ref.tokenizer.encode(prompt)], SamplingParams(**kw))
    return done.choices


def _settled(server: Server) -> bool:
    info = server.backend.info()
    return info["ledger"]["active_requests"] == 0 and server.backend.engine.kv.allocator.num_used == 0


def _wait_settled(server: Server) -> None:
    deadline = time.monotonic() + POLL_S
    while not _settled(server) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _settled(server), server.backend.info()


# ---- detokenisation (no server) ------------------------------------------------------------
def test_detokenizer_holds_split_characters_and_cuts_stop_strings():
    tok = ByteTokenizer(512, 256, (257,))
    text = "héllo € wörld 😀 end"
    d = Detokenizer(tok)
    deltas = []
    for b in tok.encode(text, add_special_tokens=False):
        assert d.push([b]) == 1
        deltas.append(d.take())
    d.finish()
    deltas.append(d.take(final=True))
    assert all("\ufffd" not in x for x in deltas)
    assert "".join(deltas) == text
    # a stop string completed by the 3rd byte of a multi-byte character, offered in one batch
    d = Detokenizer(tok, stop=("€ w",))
    ids = tok.encode(text, add_special_tokens=False)
    taken = d.push(ids)
    assert d.stopped and d.text == "héllo "
    assert tok.decode(ids[:taken]).endswith("€ w") and "€ w" not in tok.decode(ids[:taken - 1])
    # a cut-off character at the end is flushed as the tokenizer renders it
    d = Detokenizer(tok)
    d.push(list("ab€".encode())[:-1])
    assert d.take() == "ab"
    d.finish()
    assert d.take(final=True) == "\ufffd"


def test_protocol_names_what_it_refuses():
    assert parse_completion_request({"prompt": ["one"]}).prompt == "one"
    assert parse_completion_request({"prompt": [[5, 6]]}).prompt_ids == (5, 6)
    for body, word in [({"prompt": ["a", "b"]}, "batched"), ({"prompt": "a", "echo": True}, "echo"),
                       ({"prompt": "a", "best_of": 3, "logprobs": 2}, "best_of, logprobs"),
                       ({"prompt": "a", "foo": 1}, "foo"), ({"prompt": "a", "stop": ["1"] * 5}, "stop"),
                       ({"prompt": "a", "max_tokens": True}, "max_tokens")]:
        with pytest.raises(InvalidRequest, match=word):
            parse_completion_request(body)


# ---- completions --------------------------------------------------------------------------
def test_greedy_completion_equals_local_engine(server, ref):
    r = server.client.completions.create(model="tiny", prompt="Hello world", max_tokens=20, temperature=0,
                                         extra_body={"ignore_eos": True})
    [want] = _ref_choices(ref, "Hello world", max_tokens=20, ignore_eos=True)
    c = r.choices[0]
    assert (c.text, c.token_ids, c.finish_reason) == (want["text"], want["token_ids"], "length")
    prompt_len = len(ref.tokenizer.encode("Hello world"))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == \
        (prompt_len, 20, prompt_len + 20)
    assert r.object == "text_completion" and r.model == "tiny" and r.id.startswith("cmpl-")


def test_token_id_prompt(server, ref):
    ids = [256, 72, 105, 33]
    r = server.client.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0)
    [done] = ref.generate([ids], SamplingParams(max_tokens=8))
    assert r.choices[0].token_ids == done.choices[0]["token_ids"] and r.usage.prompt_tokens == 4


def test_stream_equals_non_stream(server):
    kw = dict(model="tiny", prompt="Streaming: ünïcode", max_tokens=24, temperature=0,
              extra_body={"ignore_eos": True})
    whole = server.client.completions.create(**kw)
    chunks = list(server.client.completions.create(stream=True, **kw))
    assert len(chunks) > 1
    assert "".join(ch.choices[0].text for ch in chunks) == whole.choices[0].text
    assert sum((ch.choices[0].token_ids for ch in chunks), []) == whole.choices[0].token_ids
    assert [ch.choices[0].finish_reason for ch in chunks] == [None] * (len(chunks) - 1) + ["length"]
    assert chunks[-1].usage.completion_tokens == 24 and all(ch.usage is None for ch in chunks[:-1])
    # the raw event stream: `data: {...}` events, ending with `data: [DONE]`
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        body = json.dumps({"prompt": "raw", "max_tokens": 3, "stream": True}).encode()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        raw = b""
        while chunk := s.recv(65536):
            raw += chunk
    head, _, events = raw.partition(b"\r\n\r\n")
    assert b"200" in head.split(b"\r\n")[0] and b"text/event-stream" in head
    datas = [line for line in events.split(b"\n") if line.startswith(b"data: ")]
    assert datas[-1] == b"data: [DONE]" and len(datas) >= 2


def test_n2_and_seed_reproducible(server, ref):
    kw = dict(model="tiny", prompt="Sample me", max_tokens=12, temperature=1.0, n=2, seed=7,
              extra_body={"ignore_eos": True})
    a = server.client.completions.create(**kw)
    b = server.client.completions.create(**kw)
    want = _ref_choices(ref, "Sample me", max_tokens=12, temperature=1.0, n=2, seed=7, ignore_eos=True)
    got = sorted(a.choices, key=lambda c: c.index)
    assert [c.index for c in got] == [0, 1]
    assert [c.token_ids for c in got] == [w["token_ids"] for w in want]
    assert [c.text for c in got] == [w["text"] for w in want]
    assert [c.token_ids for c in sorted(b.choices, key=lambda c: c.index)] == [c.token_ids for c in got]
    assert a.usage.completion_tokens == 24
    streamed: dict[int, list[int]] = {0: [], 1: []}
    for ch in server.client.completions.create(stream=True, **kw):
        for c in ch.choices:
            streamed[c.index] += c.token_ids
    assert [streamed[0], streamed[1]] == [c.token_ids for c in got]


def test_stop_string_cuts_text_and_ids_like_the_engine(server, ref):
    prompt, kw = "1, 2, 3,", dict(max_tokens=32, ignore_eos=True)
    full = server.client.completions.create(model="tiny", prompt=prompt, temperature=0,
                                            extra_body={"ignore_eos": True}, max_tokens=32).choices[0]
    stops = [full.text[k:k + 2] for k in range(1, len(full.text) - 1)
             if "\ufffd" not in full.text[k:k + 2] and full.text.find(full.text[k:k + 2]) == k]
    assert stops, f"no usable stop string in {full.text!r}"
    stop = stops[0]
    [want] = _ref_choices(ref, prompt, stop=(stop,), **kw)
    r = server.client.completions.create(model="tiny", prompt=prompt, temperature=0, stop=stop, max_tokens=32,
                                         extra_body={"ignore_eos": True}).choices[0]
    assert r.finish_reason == "stop" == want["finish_reason"]
    assert r.text == full.text[:full.text.find(stop)] == want["text"]
    assert r.token_ids == want["token_ids"] == full.token_ids[:len(r.token_ids)]
    chunks = list(server.client.completions.create(model="tiny", prompt=prompt, temperature=0, stop=[stop],
                                                   max_tokens=32, stream=True,
                                                   extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == r.text
    assert sum((c.choices[0].token_ids for c in chunks), []) == r.token_ids


def test_sixteen_concurrent_requests(server, ref):
    prompts = [f"request number {i}" for i in range(16)]
    want = ref.generate([ref.tokenizer.encode(p) for p in prompts], SamplingParams(max_tokens=8))

    def one(i: int) -> list[int]:
        kw = dict(model="tiny", prompt=prompts[i], max_tokens=8, temperature=0)
        if i % 2:
            chunks = server.client.completions.create(stream=True, **kw)
            return sum((c.choices[0].token_ids for c in chunks), [])
        return server.client.completions.create(**kw).choices[0].token_ids

    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(one, range(16)))
    assert got == [w.choices[0]["token_ids"] for w in want]
    _wait_settled(server)


# ---- the other routes ----------------------------------------------------------------------
def test_models_health_cluster_and_metrics(server):
    server.client.completions.create(model="tiny", prompt="count me", max_tokens=4, temperature=0)
    assert [m.id for m in server.client.models.list().data] == ["tiny"]
    status, body = server.get("/health")
    assert status == 200 and json.loads(body)["status"] == "ok"
    status, body = server.get("/v1/cluster")
    info = json.loads(body)
    [w] = info["workers"]
    assert status == 200 and w["role"] == "colocated" and w["block_size"] == 16 and w["total_blocks"] == 256
    assert w["free_blocks"] + w["cached_blocks"] + w["used_blocks"] == 256
    assert info["ledger"] == {"active_requests": 0, "owned_blocks": 0}
    assert server.metric("pdserve_time_to_first_token_seconds_count") > 0
    assert server.metric("pdserve_time_per_output_token_seconds_count") > 0
    assert server.metric("pdserve_requests_total", status="ok") > 0
    assert server.metric("pdserve_generation_tokens_total") >= 4
    assert server.metric("pdserve_pool_blocks", worker="local-0", state="total") == 256
    assert server.metric("pdserve_queue_depth") == 0 and server.metric("pdserve_requests_in_flight") == 0


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
def test_bad_input_gets_openai_error_and_server_stays_healthy(server, body, status, param):
    kind = KIND[status]
    before = server.metric("pdserve_errors_total", kind=kind)
    got, raw = server.post(body)
    err = json.loads(raw)["error"]
    assert got == status and err["message"] and err["type"] and "code" in err and err["param"] == param
    assert server.metric("pdserve_errors_total", kind=kind) == before + 1
    assert server.get("/health")[0] == 200
    r = server.client.completions.create(model="tiny", prompt="still fine", max_tokens=2, temperature=0)
    assert r.usage.completion_tokens == len(r.choices[0].token_ids) > 0


def test_openai_client_sees_typed_errors(server):
    with pytest.raises(openai.BadRequestError, match="temperature"):
        server.client.completions.create(model="tiny", prompt="x", temperature=-1)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        server.client.completions.create(model="nope", prompt="x")


def _open_request(server: Server, body: dict) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    data = json.dumps(body).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    return s


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_frees_every_block(server, stream):
    aborted = server.backend.aborted
    gone = server.metric("pdserve_requests_total", status="aborted")
    s = _open_request(server, {"model": "tiny", "prompt": "a long one", "max_tokens": 1500, "stream": stream,
                               "ignore_eos": True})
    if stream:
        got = b""
        while b"data: " not in got:
            got += s.recv(4096)
    deadline = time.monotonic() + POLL_S  # the backend's stats snapshot trails the first token
    while server.backend.info()["ledger"]["active_requests"] == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.backend.info()["ledger"]["active_requests"] == 1  # it is running when the client leaves
    s.close()
    _wait_settled(server)
    assert server.backend.aborted == aborted + 1
    assert server.metric("pdserve_requests_total", status="aborted") == gone + 1
    assert server.get("/health")[0] == 200


def test_backend_down_is_503_fast(loop, server):
    e = server.backend.engine
    down = LocalEngineBackend(engine=LLMEngine(CFG, loaded=(e.model, e.model_config, e.tokenizer)))  # idle
    srv = _serve(loop, down)
    try:
        status, raw = srv.post({"model": "tiny", "prompt": "x"})
        assert status == 503 and "not running" in json.loads(raw)["error"]["message"]
        assert srv.get("/health")[0] == 503
    finally:
        asyncio.run_coroutine_threadsafe(srv.runner.cleanup(), loop).result(30)


def test_serve_cli_answers_and_stops_on_sigint():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "pdserve_cli.main", "serve", "--port", "0", "--num-blocks", "64"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        seen, m, deadline = "", None, time.monotonic() + 120
        while m is None and time.monotonic() < deadline and proc.poll() is None:
            if select.select([proc.stdout], [], [], 1.0)[0]:
                seen += proc.stdout.readline()
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
