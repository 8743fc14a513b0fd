"""The OpenAI `POST /v1/completions` request as the coordinator understands it, and its errors.

`parse_completion_request(raw)` turns the raw HTTP body (bytes or an already decoded dict) into
a frozen `CompletionRequest`, checking every field's type and range and refusing fields this
server does not implement (echo, logprobs, best_of, suffix, penalties, logit_bias) by name.
`resolve_prompt` then fixes the prompt's token ids (encoding text with the backend's tokenizer)
and checks them against the vocabulary and the model's context. Every refusal is an `APIError`
subclass carrying the HTTP status and the OpenAI error body
`{"error": {"message", "type", "param", "code"}}`; backends raise the same classes (e.g.
`ServiceUnavailable("no live prefill worker")`), so the HTTP layer maps errors in one place.
Nothing here imports the engine or touches tensors.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, replace

from protocol.sampling import MAX_N, MAX_STOP_STRINGS, MAX_TEMPERATURE, SamplingParams

DEFAULT_MAX_TOKENS = 16

# ---- errors -------------------------------------------------------------------------------


class APIError(Exception):
    """An error the client sees as the OpenAI error body with `status`."""

    status = 500
    type = "internal_error"
    kind = "internal"  # the `kind` label of pdserve_errors_total

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


class InvalidRequest(APIError):
    """400: malformed JSON, missing or out-of-range fields, prompt beyond the context."""

    status, type, kind = 400, "invalid_request_error", "invalid_request"


class ModelNotFound(APIError):
    """404: the `model` field names no model this server serves."""

    status, type, kind = 404, "invalid_request_error", "model_not_found"

    def __init__(self, message: str, **kw):
        kw.setdefault("param", "model")
        kw.setdefault("code", "model_not_found")
        super().__init__(message, **kw)


class ServiceUnavailable(APIError):
    """503: no live worker can take the request (the backend's message says which role)."""

    status, type, kind = 503, "service_unavailable", "unavailable"


class Timeout(APIError):
    """504: the backend produced nothing within the configured bound."""

    status, type, kind = 504, "timeout", "timeout"


class InternalError(APIError):
    """500: a bug or a failed component; the message says what failed."""


# ---- the request --------------------------------------------------------------------------


@dataclass(frozen=True)
class CompletionRequest:
    """One validated completion request (a single prompt).

    request_id: unique id, also the response's `id` ("cmpl-...").
    model: the model name asked for ('' = the server's default).
    prompt: the prompt text, or None when the client sent token ids.
    prompt_ids: the prompt's token ids; empty until `resolve_prompt` encodes a text prompt.
    max_tokens, temperature, top_p, top_k, n, seed, stop, stop_token_ids, ignore_eos: sampling
        settings with the meaning of protocol.sampling.SamplingParams (top_k, stop_token_ids and
        ignore_eos are extensions of the OpenAI API).
    stream: answer with server-sent events.
    include_usage: stream_options.include_usage (usage is sent on the last chunk regardless).
    add_special_tokens: let the tokenizer add its special tokens (e.g. BOS) when encoding the
        prompt text; False for a prompt rendered by a chat template, which writes them itself.
    """

    request_id: str
    model: str
    prompt: str | None
    prompt_ids: tuple[int, ...] = ()
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    n: int = 1
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    stream: bool = False
    include_usage: bool = False
    add_special_tokens: bool = True

    def sampling_params(self) -> SamplingParams:
        """The request's sampling settings; InvalidRequest if they break a bound."""
        try:
            return SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                                  top_k=self.top_k, n=self.n, seed=self.seed, stop=tuple(self.stop),
                                  stop_token_ids=tuple(self.stop_token_ids), ignore_eos=self.ignore_eos)
        except ValueError as e:
            raise InvalidRequest(str(e)) from None


# Fields accepted, and fields refused only when set to something other than their no-op value.
_KNOWN = {"model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "seed", "stop", "stream",
          "stream_options", "stop_token_ids", "ignore_eos", "user"}
_UNSUPPORTED_NOOP = {"echo": (None, False), "logprobs": (None,), "best_of": (None, 1), "suffix": (None, ""),
                     "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
                     "logit_bias": (None, {})}


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _int(body: dict, name: str, default, lo: int, hi: int | None = None):
    v = body.get(name)
    if v is None:
        return default
    if not _is_int(v) or v < lo or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in {lo}..{hi}"
        raise InvalidRequest(f"'{name}' must be an integer {rng}, got {v!r}", param=name)
    return v


def _num(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if not _is_num(v) or v != v or v > hi or v < lo or (lo_open and v == lo):
        rng = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
        raise InvalidRequest(f"'{name}' must be a number in {rng}, got {v!r}", param=name)
    return float(v)


def _prompt(body: dict) -> tuple[str | None, tuple[int, ...]]:
    if "prompt" not in body or body["prompt"] is None:
        raise InvalidRequest("'prompt' is required", param="prompt")
    p = body["prompt"]
    if isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):
        if len(p) > 1:
            raise InvalidRequest("batched prompts are not supported: send one prompt per request",
                                 param="prompt")
        p = p[0]  # a batch of one is just that prompt
    if isinstance(p, str):
        if not p:
            raise InvalidRequest("'prompt' is empty", param="prompt")
        return p, ()
    if isinstance(p, list):
        if not p:
            raise InvalidRequest("'prompt' is empty", param="prompt")
        if not all(_is_int(t) and t >= 0 for t in p):
            raise InvalidRequest("'prompt' must be a string or a list of non-negative integer token ids",
                                 param="prompt")
        return None, tuple(p)
    raise InvalidRequest("'prompt' must be a string or a list of integer token ids", param="prompt")


def _stop(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise InvalidRequest("'stop' must be a non-empty string or a list of non-empty strings", param="stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"'stop' takes at most {MAX_STOP_STRINGS} strings, got {len(stops)}",
                             param="stop")
    return tuple(stops)


def _bool(body: dict, name: str) -> bool:
    v = body.get(name)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise InvalidRequest(f"'{name}' must be a boolean, got {v!r}", param=name)
    return v


def json_object(raw: bytes | str | dict) -> dict:
    """The request body as a dict; InvalidRequest when it is not a JSON object."""
    if isinstance(raw, (bytes, str)):
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, ValueError) as e:
            raise InvalidRequest(f"request body is not valid JSON: {e}") from None
    else:
        body = raw
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    return body


def parse_completion_request(raw: bytes | str | dict, *, max_n: int = MAX_N,
                             request_id: str | None = None) -> CompletionRequest:
    """Validate a completions body; raises InvalidRequest naming the offending field."""
    body = json_object(raw)
    unsupported = sorted(k for k, ok in _UNSUPPORTED_NOOP.items() if k in body and body[k] not in ok)
    if unsupported:
        raise InvalidRequest(f"unsupported field(s): {', '.join(unsupported)}", param=unsupported[0])
    unknown = sorted(set(body) - _KNOWN - set(_UNSUPPORTED_NOOP))
    if unknown:
        raise InvalidRequest(f"unrecognized field(s): {', '.join(unknown)}", param=unknown[0])
    model = body.get("model") or ""
    if not isinstance(model, str):
        raise InvalidRequest(f"'model' must be a string, got {model!r}", param="model")
    prompt, ids = _prompt(body)
    n = body.get("n")
    if n is not None and _is_int(n) and n > max_n:
        raise InvalidRequest(f"'n' = {n} is too large: this server allows at most {max_n}", param="n")
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(_is_int(t) and t >= 0 for t in stop_ids):
        raise InvalidRequest("'stop_token_ids' must be a list of non-negative integers",
                             param="stop_token_ids")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict) or set(opts) - {"include_usage"}:
        raise InvalidRequest("'stream_options' may only hold 'include_usage'", param="stream_options")
    return CompletionRequest(
        request_id=request_id or f"cmpl-{uuid.uuid4().hex}",
        model=model, prompt=prompt, prompt_ids=ids,
        max_tokens=_int(body, "max_tokens", DEFAULT_MAX_TOKENS, 1),
        temperature=_num(body, "temperature", 1.0, 0.0, MAX_TEMPERATURE),
        top_p=_num(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        top_k=_int(body, "top_k", 0, -1),
        n=_int(body, "n", 1, 1, max_n),
        seed=_int(body, "seed", None, 0, 2**63 - 1),
        stop=_stop(body), stop_token_ids=tuple(stop_ids), ignore_eos=_bool(body, "ignore_eos"),
        stream=_bool(body, "stream"), include_usage=bool(opts.get("include_usage", False)))


def resolve_prompt(creq: CompletionRequest, tokenizer, max_context: int,
                   vocab_size: int) -> CompletionRequest:
    """A copy with prompt_ids filled (text encoded as `pdserve generate --local` does) and checked:
    ids inside the vocabulary, prompt + max_tokens within the model's context."""
    ids = creq.prompt_ids
    if creq.prompt is not None:
        ids = tuple(tokenizer.encode(creq.prompt, add_special_tokens=creq.add_special_tokens))
        if not ids:
            raise InvalidRequest("'prompt' encodes to no tokens", param="prompt")
    bad = [t for t in ids if t >= vocab_size]
    if bad:
        raise InvalidRequest(f"prompt token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}",
                             param="prompt")
    bad_stop = [t for t in creq.stop_token_ids if t >= vocab_size]
    if bad_stop:
        raise InvalidRequest(f"stop_token_ids outside the vocabulary [0, {vocab_size}): {bad_stop[:5]}",
                             param="stop_token_ids")
    if len(ids) + creq.max_tokens > max_context:
        raise InvalidRequest(f"prompt ({len(ids)} tokens) + max_tokens ({creq.max_tokens}) exceeds the "
                             f"model's context of {max_context} tokens", param="prompt",
                             code="context_length_exceeded")
    return replace(creq, prompt_ids=ids)
