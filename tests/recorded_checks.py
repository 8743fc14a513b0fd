"""Shape checks of the OpenAI answers the load generators and eval tools parse (guidellm, aiperf,
lm-eval, the openai client), shared by tests/test_recorded_traffic.py for `serve` and `up`:
`check_answer(request, status, raw)` asserts what those tools read, for completions and chat,
streamed and not (usage with prompt_tokens_details.cached_tokens, usage on every chunk under
continuous_usage_stats, logprobs in the route's shape, min_tokens honoured), and returns the
completion's token ids."""

from __future__ import annotations

import json
import math
from pathlib import Path

RECORDED = json.loads((Path(__file__).parent / "data" / "recorded_requests.json").read_text())["requests"]
USAGE_KEYS = ("prompt_tokens", "completion_tokens", "total_tokens")


def sse_events(raw: bytes) -> list[dict]:
    lines = [line[6:] for line in raw.decode().split("\n") if line.startswith("data: ")]
    assert lines and lines[-1] == "[DONE]", lines[-3:]
    return [json.loads(x) for x in lines[:-1]]


def _usage(usage: dict, final: bool) -> None:
    assert all(isinstance(usage[k], int) for k in USAGE_KEYS), usage
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    if final:
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        assert isinstance(cached, int) and 0 <= cached <= usage["prompt_tokens"]


def _logprobs_text(lp: dict, n_tokens: int, top: int) -> None:
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == n_tokens
    assert len(lp["top_logprobs"]) == n_tokens
    for value, alts in zip(lp["token_logprobs"], lp["top_logprobs"]):
        assert value <= 0 and math.isfinite(value) and top <= len(alts) <= top + 1


def _logprobs_chat(lp: dict, n_tokens: int, top: int) -> None:
    assert len(lp["content"]) == n_tokens
    for item in lp["content"]:
        assert isinstance(item["token"], str) and item["logprob"] <= 0 and isinstance(item["bytes"], list)
        assert len(item["top_logprobs"]) == top


def check_answer(req: dict, status: int, raw: bytes) -> list[int]:
    body, chat = req["body"], req["path"].endswith("chat/completions")
    assert status == 200, raw[:300]
    want = body.get("max_tokens") or body.get("max_completion_tokens")
    top = body.get("top_logprobs", 0) if chat else body.get("logprobs")
    ids: list[int] = []
    if body.get("stream"):
        events = sse_events(raw)
        continuous = (body.get("stream_options") or {}).get("continuous_usage_stats")
        counts = []
        for e in events:
            assert e["object"] == ("chat.completion.chunk" if chat else "text_completion")
            for c in e["choices"]:
                ids += c["token_ids"]
                assert isinstance(c["delta"]["content"] if chat else c["text"], str)
                if body.get("logprobs"):
                    (_logprobs_chat if chat else _logprobs_text)(c["logprobs"], len(c["token_ids"]), top)
            if continuous and e["choices"]:
                _usage(e["usage"], final=False)
                counts.append(e["usage"]["completion_tokens"])
        assert counts == sorted(counts)
        usage = events[-1]["usage"]
    else:
        answer = json.loads(raw)
        assert answer["object"] == ("chat.completion" if chat else "text_completion")
        c = answer["choices"][0]
        assert isinstance(c["message"]["content"] if chat else c["text"], str)
        ids = c["token_ids"]
        if body.get("logprobs"):
            (_logprobs_chat if chat else _logprobs_text)(c["logprobs"], len(ids), top)
        usage = answer["usage"]
    _usage(usage, final=True)
    assert usage["completion_tokens"] == len(ids)
    if body.get("ignore_eos") or body.get("min_tokens"):
        assert len(ids) == want
    return ids
