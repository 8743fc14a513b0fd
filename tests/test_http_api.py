"""The coordinator's HTTP API end to end, completions: a real aiohttp server on a loopback port
over a LocalEngineBackend with the tiny model (`http_harness`), driven by the real `openai`
client and by raw HTTP, plus the detokenizer and request parsing it relies on. The other routes,
bad input, disconnects and `pdserve serve` are in test_http_api_routes.py.

Reference outputs come from a second LLMEngine sharing the backend's model (what
`pdserve generate --local` runs), so every comparison is against the engine itself.
"""

from __future__ import annotations

import json
import socket
from concurrent.futures import ThreadPoolExecutor

import pytest
from http_harness import CONFIG, wait_settled

from coordinator.completion_request import InvalidRequest, parse_completion_request
from coordinator.detokenize import Detokenizer
from engine.engine import LLMEngine
from engine.sampling import SamplingParams
from model_files.tokenizer import ByteTokenizer


@pytest.fixture(scope="module")
def reference(http_server):
    """An engine sharing the server's model: the `--local` reference."""
    engine = http_server.backend.engine
    return LLMEngine(CONFIG, loaded=(engine.model, engine.model_config, engine.tokenizer))


def reference_choices(reference, prompt: str, **kw) -> list[dict]:
    [done] = reference.generate([reference.tokenizer.encode(prompt)], SamplingParams(**kw))
    return done.choices


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
                       ({"prompt": "a", "best_of": 3, "logprobs": 2}, "best_of"),
                       ({"prompt": "a", "foo": 1}, "foo"), ({"prompt": "a", "stop": ["1"] * 5}, "stop"),
                       ({"prompt": "a", "max_tokens": True}, "max_tokens")]:
        with pytest.raises(InvalidRequest, match=word):
            parse_completion_request(body)


# ---- completions --------------------------------------------------------------------------
def test_greedy_completion_equals_local_engine(http_server, reference):
    r = http_server.client.completions.create(model="tiny", prompt="Hello world", max_tokens=20,
                                              temperature=0, extra_body={"ignore_eos": True})
    [want] = reference_choices(reference, "Hello world", max_tokens=20, ignore_eos=True)
    c = r.choices[0]
    assert (c.text, c.token_ids, c.finish_reason) == (want["text"], want["token_ids"], "length")
    prompt_len = len(reference.tokenizer.encode("Hello world"))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == \
        (prompt_len, 20, prompt_len + 20)
    assert r.object == "text_completion" and r.model == "tiny" and r.id.startswith("cmpl-")


def test_token_id_prompt(http_server, reference):
    ids = [256, 72, 105, 33]
    r = http_server.client.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0)
    [done] = reference.generate([ids], SamplingParams(max_tokens=8))
    assert r.choices[0].token_ids == done.choices[0]["token_ids"] and r.usage.prompt_tokens == 4


def test_stream_equals_non_stream(http_server):
    kw = dict(model="tiny", prompt="Streaming: ünïcode", max_tokens=24, temperature=0,
              extra_body={"ignore_eos": True})
    whole = http_server.client.completions.create(**kw)
    chunks = list(http_server.client.completions.create(stream=True, **kw))
    assert len(chunks) > 1
    assert "".join(ch.choices[0].text for ch in chunks) == whole.choices[0].text
    assert sum((ch.choices[0].token_ids for ch in chunks), []) == whole.choices[0].token_ids
    assert [ch.choices[0].finish_reason for ch in chunks] == [None] * (len(chunks) - 1) + ["length"]
    assert chunks[-1].usage.completion_tokens == 24 and all(ch.usage is None for ch in chunks[:-1])
    # the raw event stream: `data: {...}` events, ending with `data: [DONE]`
    with socket.create_connection(("127.0.0.1", http_server.port), timeout=30) as s:
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


def test_n2_and_seed_reproducible(http_server, reference):
    kw = dict(model="tiny", prompt="Sample me", max_tokens=12, temperature=1.0, n=2, seed=7,
              extra_body={"ignore_eos": True})
    a = http_server.client.completions.create(**kw)
    b = http_server.client.completions.create(**kw)
    want = reference_choices(reference, "Sample me", max_tokens=12, temperature=1.0, n=2, seed=7,
                             ignore_eos=True)
    got = sorted(a.choices, key=lambda c: c.index)
    assert [c.index for c in got] == [0, 1]
    assert [c.token_ids for c in got] == [w["token_ids"] for w in want]
    assert [c.text for c in got] == [w["text"] for w in want]
    assert [c.token_ids for c in sorted(b.choices, key=lambda c: c.index)] == [c.token_ids for c in got]
    assert a.usage.completion_tokens == 24
    streamed: dict[int, list[int]] = {0: [], 1: []}
    for ch in http_server.client.completions.create(stream=True, **kw):
        for c in ch.choices:
            streamed[c.index] += c.token_ids
    assert [streamed[0], streamed[1]] == [c.token_ids for c in got]


def test_stop_string_cuts_text_and_ids_like_the_engine(http_server, reference):
    prompt, kw = "1, 2, 3,", dict(max_tokens=32, ignore_eos=True)
    full = http_server.client.completions.create(model="tiny", prompt=prompt, temperature=0,
                                                 extra_body={"ignore_eos": True}, max_tokens=32).choices[0]
    stops = [full.text[k:k + 2] for k in range(1, len(full.text) - 1)
             if "\ufffd" not in full.text[k:k + 2] and full.text.find(full.text[k:k + 2]) == k]
    assert stops, f"no usable stop string in {full.text!r}"
    stop = stops[0]
    [want] = reference_choices(reference, prompt, stop=(stop,), **kw)
    r = http_server.client.completions.create(model="tiny", prompt=prompt, temperature=0, stop=stop,
                                              max_tokens=32, extra_body={"ignore_eos": True}).choices[0]
    assert r.finish_reason == "stop" == want["finish_reason"]
    assert r.text == full.text[:full.text.find(stop)] == want["text"]
    assert r.token_ids == want["token_ids"] == full.token_ids[:len(r.token_ids)]
    chunks = list(http_server.client.completions.create(model="tiny", prompt=prompt, temperature=0,
                                                        stop=[stop], max_tokens=32, stream=True,
                                                        extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == r.text
    assert sum((c.choices[0].token_ids for c in chunks), []) == r.token_ids


def test_sixteen_concurrent_requests(http_server, reference):
    prompts = [f"request number {i}" for i in range(16)]
    want = reference.generate([reference.tokenizer.encode(p) for p in prompts], SamplingParams(max_tokens=8))

    def one(i: int) -> list[int]:
        kw = dict(model="tiny", prompt=prompts[i], max_tokens=8, temperature=0)
        if i % 2:
            chunks = http_server.client.completions.create(stream=True, **kw)
            return sum((c.choices[0].token_ids for c in chunks), [])
        return http_server.client.completions.create(**kw).choices[0].token_ids

    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(one, range(16)))
    assert got == [w.choices[0]["token_ids"] for w in want]
    wait_settled(http_server)
