"""Issue 49, item 5: a prompt far too long for the context is refused before the tokenizer
reads all of it (the same 400 `context_length_exceeded`), and `cache_salt` separates prefix
caches, so `usage.prompt_tokens_details.cached_tokens` tells no client another's prompt. On the
in-process tiny model (one engine, the same prefix cache a prefill worker has); the salt's path
through the cluster's Submit is checked on the wire."""

from __future__ import annotations

import dataclasses
import json

import msgpack
import pytest
from http_harness import CONFIG, LocalEngineBackend, serve

from coordinator.completion_request import (
    InvalidRequest,
    parse_completion_request,
    resolve_prompt,
)
from protocol.codec import MESSAGE_EXT, _default, decode, encode
from protocol.messages import Submit
from protocol.prefix_hash import hash_chain, salt_key
from protocol.sampling import SamplingParams


class CountingTokenizer:
    """A byte-level tokenizer (the tiny model's scheme: UTF-8 bytes, BOS 256), counting the
    characters it was asked to encode."""

    def __init__(self):
        self.encoded_chars = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.encoded_chars += len(text)
        return [256] * add_special_tokens + list(text.encode("utf-8"))


def test_a_prompt_far_past_the_context_is_refused_before_it_is_all_encoded():
    tok = CountingTokenizer()
    creq = parse_completion_request({"prompt": "word " * 200_000, "max_tokens": 16})  # 1 MB of text
    with pytest.raises(InvalidRequest) as e:
        resolve_prompt(creq, tok, max_context=2048, vocab_size=260)
    assert e.value.status == 400 and e.value.code == "context_length_exceeded" and e.value.param == "prompt"
    assert 0 < tok.encoded_chars < len(creq.prompt) // 10  # its first piece, not the megabyte


def test_prompts_that_fit_or_just_miss_are_judged_exactly():
    tok = CountingTokenizer()
    fits = parse_completion_request({"prompt": "a" * 2000, "max_tokens": 16})
    assert len(resolve_prompt(fits, tok, 2048, 260).prompt_ids) == 2001  # BOS + 2000 bytes
    just_over = parse_completion_request({"prompt": "a" * 2040, "max_tokens": 16})
    with pytest.raises(InvalidRequest, match=r"prompt \(2041 tokens\)"):
        resolve_prompt(just_over, tok, 2048, 260)


@pytest.fixture(scope="module")
def server(http_loop):
    backend = LocalEngineBackend(CONFIG).start()
    served = serve(http_loop, backend)
    yield served
    import asyncio
    asyncio.run_coroutine_threadsafe(served.runner.cleanup(), http_loop).result(30)
    backend.close()


def test_a_megabyte_prompt_gets_the_context_error_over_http(server):
    status, raw = server.post({"prompt": "x" * 1_000_000, "max_tokens": 2})
    error = json.loads(raw)["error"]
    assert status == 400 and error["code"] == "context_length_exceeded", error


PREFIX = [(7 * i) % 200 + 3 for i in range(96)]  # six 16-token blocks of shared prefix


def _cached(server, tail: int, salt: str | None) -> int:
    body = {"prompt": PREFIX + [tail, tail + 1], "max_tokens": 1, "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    status, raw = server.post(body)
    assert status == 200, raw
    return json.loads(raw)["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_cache_salt_separates_prefix_caches(server):
    _cached(server, 210, "alice")
    assert _cached(server, 220, "mallory") == 0      # another salt: no hit, nothing learnt
    assert _cached(server, 230, None) == 0           # no salt: a cache of its own too
    assert _cached(server, 240, "alice") >= 64       # the same salt: the prefix is reused
    assert _cached(server, 250, "mallory") >= 64


def test_cache_salt_is_bounded_and_a_string(server):
    for bad in (5, "s" * 257):
        status, raw = server.post({"prompt": [1, 2], "max_tokens": 1, "cache_salt": bad})
        assert status == 400 and json.loads(raw)["error"]["param"] == "cache_salt"


def test_the_salt_changes_every_block_hash_and_rides_submit_as_a_digest():
    assert salt_key("") == ""
    key = salt_key("alice")
    assert key != salt_key("mallory") and "alice" not in key and len(key) < 64
    plain, salted = hash_chain(PREFIX, 16), hash_chain(PREFIX, 16, key)
    assert len(plain) == 6 and not set(plain) & set(salted)
    cmd = Submit("r", PREFIX, SamplingParams(), prefix_key=key)
    assert decode(encode(cmd)) == cmd
    old = {f.name: getattr(cmd, f.name) for f in dataclasses.fields(cmd) if f.name != "prefix_key"}
    inner = msgpack.packb(["Submit", old], default=_default, use_bin_type=True)
    legacy = msgpack.packb(msgpack.ExtType(MESSAGE_EXT, inner), use_bin_type=True)
    assert decode(legacy) == Submit("r", PREFIX, SamplingParams())  # a sender without the field


def test_a_prefill_worker_keys_its_prefix_cache_by_the_submits_prefix_key():
    """The cluster's path: Submit.prefix_key reaches the prefill worker's engine (in process, no
    Ray); its Tokens events report cached_tokens per key. The decode side is unreachable here, so
    each request's blocks stay held for a resend: still in the prefix cache."""
    from worker_harness import in_process

    from prefill_worker.worker import PrefillWorker
    from protocol.messages import Tokens

    config = {"name": "p", "engine": {"model": "tiny", "num_blocks": 64}, "transfer_timeout_s": 1.0,
              "hold_s": 30.0}
    with in_process(PrefillWorker, config) as (worker, reports):
        def cached(rid: str, salt: str) -> int:
            cmd = Submit(rid, PREFIX + [len(rid)], SamplingParams(max_tokens=2), "decode-x",
                         "tcp://127.0.0.1:9", 1, prefix_key=salt_key(salt))  # nothing listens there
            assert decode(worker.command(encode(cmd))).error == ""

            def first() -> list:
                return [e for e in reports.events if isinstance(e, Tokens) and e.request_id == rid]

            reports.until(lambda: first())
            return first()[0].cached_tokens

        assert cached("a", "alice") == 0
        assert cached("bb", "mallory") == 0
        assert cached("ccc", "alice") == len(PREFIX)
