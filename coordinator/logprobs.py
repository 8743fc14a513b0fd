"""Token log-probabilities in the two OpenAI shapes.

The engine sends, per sampled token, a `protocol.messages.TokenLogprobs` (its log-probability
and the top-N alternatives by id); here they become text. `/v1/completions` uses the legacy
columnar object `{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}`
(the sampled token is always in its position's dict, as vLLM does; text_offset counts the
characters of the token strings before it, from `offset`); `/v1/chat/completions` uses
`{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}`.
A token's string is the tokenizer's decoding of that id alone (special tokens included), so a
byte-level piece of a multi-byte character shows as U+FFFD, as in vLLM; `bytes` are that
string's UTF-8. An entry missing from a worker (None) is written with a null logprob.
"""

from __future__ import annotations


def token_string(tokenizer, token_id: int) -> str:
    try:
        return tokenizer.decode([token_id], skip_special_tokens=False)
    except TypeError:  # a tokenizer without the keyword
        return tokenizer.decode([token_id])


def text_logprobs(tokenizer, token_ids: list[int], entries: list, offset: int = 0) -> tuple[dict, int]:
    """The completions `logprobs` object of these tokens, and the text offset after them."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tid, entry in zip(token_ids, entries):
        text = token_string(tokenizer, tid)
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        if entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(entry.logprob)
        top = {token_string(tokenizer, t): lp for t, lp in zip(entry.top_ids, entry.top_logprobs)}
        top.setdefault(text, entry.logprob)
        out["top_logprobs"].append(top)
    return out, offset


def _item(tokenizer, token_id: int, logprob) -> dict:
    text = token_string(tokenizer, token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "replace"))}


def chat_logprobs(tokenizer, token_ids: list[int], entries: list, offset: int = 0) -> tuple[dict, int]:
    """The chat `logprobs` object of these tokens (offset is unused: chat has no text offsets)."""
    content = []
    for tid, entry in zip(token_ids, entries):
        item = _item(tokenizer, tid, None if entry is None else entry.logprob)
        item["top_logprobs"] = [] if entry is None else \
            [_item(tokenizer, t, lp) for t, lp in zip(entry.top_ids, entry.top_logprobs)]
        content.append(item)
    return {"content": content}, offset
