"""The OpenAI `POST /v1/completions` request as the coordinator understands it, and its errors.

`parse_completion_request(raw)` turns the raw HTTP body (bytes or an already decoded dict) into
a frozen `CompletionRequest`, checking every field's type and range and refusing fields this
server does not implement (echo, best_of, suffix, penalties, logit_bias) by name. Every integer
is bounded (top_k later by the vocabulary), every string UTF-8 encodable, the body's nesting
bounded before parsing (coordinator.fields, coordinator.edge).
`resolve_prompt` then fixes the prompt's token ids (encoding text with the backend's tokenizer)
and checks them against the vocabulary and the model's context. Every refusal is an `APIError`
subclass carrying the HTTP status and the OpenAI error body
`{"error": {"message", "type", "param", "code"}}`; backends raise the same classes (e.g.
`ServiceUnavailable("no live prefill worker")`), so the HTTP layer maps errors in one place.
Nothing here imports the engine or touches tensors.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, replace

from coordinator.errors import (  # noqa: F401  (re-exported: the API's errors live with the protocol)
    APIError,
    InternalError,
    InvalidRequest,
    ModelNotFound,
    ServiceUnavailable,
    Timeout,
)
from coordinator.fields import (  # noqa: F401  (json_object re-exported for coordinator.chat)
    bool_field,
    int_field,
    json_object,
    num_field,
    prompt_field,
    stop_field,
    str_field,
    token_ids_field,
)
from protocol.sampling import (
    MAX_LOGPROBS,
    MAX_N,
    MAX_SEED,
    MAX_TEMPERATURE,
    MAX_TOKENS,
    MAX_TOP_K,
    SamplingParams,
)

DEFAULT_MAX_TOKENS = 16

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
    min_tokens, logprobs: as in SamplingParams (vLLM's min_tokens; logprobs = how many top
        alternatives per token, None for no logprobs; chat's `logprobs`/`top_logprobs` map to it).
    stream: answer with server-sent events.
    include_usage: stream_options.include_usage (usage is sent on the last chunk regardless).
    continuous_usage: stream_options.continuous_usage_stats (vLLM): usage on every chunk.
    cache_salt: separates prefix caches (vLLM's and SGLang's field): only requests with the same
        salt share cached prompt blocks, so `cached_tokens` tells no client another's prompt.
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
    min_tokens: int = 0
    logprobs: int | None = None
    continuous_usage: bool = False
    cache_salt: str = ""

    def sampling_params(self) -> SamplingParams:
        """The request's sampling settings; InvalidRequest if they break a bound."""
        try:
            return SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                                  top_k=self.top_k, n=self.n, seed=self.seed, stop=tuple(self.stop),
                                  stop_token_ids=tuple(self.stop_token_ids), ignore_eos=self.ignore_eos,
                                  min_tokens=self.min_tokens, logprobs=self.logprobs)
        except ValueError as e:
            raise InvalidRequest(str(e)) from None


# Fields accepted, and fields refused only when set to something other than their no-op value.
_KNOWN = {"model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "seed", "stop", "stream",
          "stream_options", "stop_token_ids", "ignore_eos", "user", "min_tokens", "logprobs",
          "max_completion_tokens", "cache_salt"}
_STREAM_OPTIONS = ("include_usage", "continuous_usage_stats")
MAX_NAME_CHARS = 256  # `model`, `user` and `cache_salt`
# NOTE: echo stays refused: prompt logprobs need the logits of every prompt position, which
# prefill never computes (it keeps the last row only); see the message below.
_ECHO_REFUSAL = ("'echo' is not supported: it would need the logits of every prompt position "
                 "(prompt logprobs), which prefill does not compute")
_UNSUPPORTED_NOOP = {"echo": (None, False), "best_of": (None, 1), "suffix": (None, ""),
                     "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
                     "logit_bias": (None, {})}


def parse_completion_request(raw: bytes | str | dict, *, max_n: int = MAX_N,
                             request_id: str | None = None) -> CompletionRequest:
    """Validate a completions body; raises InvalidRequest naming the offending field."""
    body = json_object(raw)
    unsupported = sorted(k for k, ok in _UNSUPPORTED_NOOP.items() if k in body and body[k] not in ok)
    if unsupported:
        if unsupported == ["echo"]:
            raise InvalidRequest(_ECHO_REFUSAL, param="echo")
        raise InvalidRequest(f"unsupported field(s): {', '.join(unsupported)}", param=unsupported[0])
    unknown = sorted(set(body) - _KNOWN - set(_UNSUPPORTED_NOOP))
    if unknown:
        raise InvalidRequest(f"unrecognized field(s): {', '.join(unknown)}", param=unknown[0])
    limit = body.get("max_completion_tokens")  # guidellm sends it with max_tokens, equal, on both routes
    if limit is not None:
        if body.get("max_tokens") not in (None, limit):
            raise InvalidRequest("'max_tokens' and 'max_completion_tokens' disagree; send one",
                                 param="max_completion_tokens")
        body = {**body, "max_tokens": limit}
    model = str_field(body, "model", MAX_NAME_CHARS)
    str_field(body, "user", MAX_NAME_CHARS)
    prompt, ids = prompt_field(body)
    n = body.get("n")
    if n is not None and isinstance(n, int) and not isinstance(n, bool) and n > max_n:
        raise InvalidRequest(f"'n' = {n} is too large: this server allows at most {max_n}", param="n")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict) or set(opts) - set(_STREAM_OPTIONS):
        raise InvalidRequest(f"'stream_options' may only hold {' and '.join(_STREAM_OPTIONS)}",
                             param="stream_options")
    creq = CompletionRequest(
        request_id=request_id or f"cmpl-{uuid.uuid4().hex}",
        model=model, prompt=prompt, prompt_ids=ids,
        max_tokens=int_field(body, "max_tokens", DEFAULT_MAX_TOKENS, 1, MAX_TOKENS),
        temperature=num_field(body, "temperature", 1.0, 0.0, MAX_TEMPERATURE),
        top_p=num_field(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        top_k=int_field(body, "top_k", 0, -1, MAX_TOP_K),
        n=int_field(body, "n", 1, 1, max_n),
        seed=int_field(body, "seed", None, 0, MAX_SEED - 1),
        stop=stop_field(body), stop_token_ids=token_ids_field(body, "stop_token_ids"),
        ignore_eos=bool_field(body, "ignore_eos"), stream=bool_field(body, "stream"),
        include_usage=bool_field(opts, "include_usage"),
        continuous_usage=bool_field(opts, "continuous_usage_stats"),
        min_tokens=int_field(body, "min_tokens", 0, 0, MAX_TOKENS),
        cache_salt=str_field(body, "cache_salt", MAX_NAME_CHARS),
        logprobs=int_field(body, "logprobs", None, 0, MAX_LOGPROBS))
    creq.sampling_params()  # every bound of the params checked now, not at dispatch
    return creq


# A text prompt longer than PIECE_CHARS_PER_TOKEN characters per token of room is counted piece
# by piece first (pieces of that many characters), and refused as soon as the pieces counted
# hold more tokens than the room plus PIECE_SLACK per cut: so a megabyte of text costs the
# tokenizer its first pieces (milliseconds) rather than all of it (seconds), and the exact check
# never runs on it. The slack covers the tokens a cut can add at its edge (a token that would
# have spanned it); a prompt that stays under after all its pieces is encoded whole and judged
# exactly, as before.
PIECE_CHARS_PER_TOKEN = 8
PIECE_SLACK = 64


def _cannot_fit(creq: CompletionRequest, tokenizer, max_context: int) -> None:
    """InvalidRequest (the context error) once the pieces of the prompt text counted so far hold
    more tokens than the room left for the prompt (see PIECE_CHARS_PER_TOKEN)."""
    text, room = creq.prompt, max(0, max_context - creq.max_tokens)
    piece = PIECE_CHARS_PER_TOKEN * (room + PIECE_SLACK)
    if len(text) <= piece:  # the common case: encoded whole, once
        return
    counted = 0
    for cuts, start in enumerate(range(0, len(text), piece)):
        counted += len(tokenizer.encode(text[start:start + piece], add_special_tokens=False))
        if counted > room + PIECE_SLACK * (cuts + 1):
            raise InvalidRequest(f"prompt ({len(text)} characters; its first {start + piece} alone are "
                                 f"about {counted} tokens) + max_tokens ({creq.max_tokens}) exceeds the "
                                 f"model's context of {max_context} tokens", param="prompt",
                                 code="context_length_exceeded")


def resolve_prompt(creq: CompletionRequest, tokenizer, max_context: int,
                   vocab_size: int) -> CompletionRequest:
    """A copy with prompt_ids filled (text encoded as `pdserve generate --local` does) and checked:
    ids inside the vocabulary, prompt + max_tokens within the model's context (a text prompt
    too long for any tokenization is refused before it is encoded)."""
    ids = creq.prompt_ids
    if creq.prompt is not None:
        _cannot_fit(creq, tokenizer, max_context)
        ids = tuple(tokenizer.encode(creq.prompt, add_special_tokens=creq.add_special_tokens))
        if not ids:
            raise InvalidRequest("'prompt' encodes to no tokens", param="prompt")
    bad = [t for t in ids if t >= vocab_size]
    if bad:
        raise InvalidRequest(f"prompt token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}",
                             param="prompt")
    if creq.top_k > vocab_size:
        raise InvalidRequest(f"'top_k' ({creq.top_k}) exceeds the vocabulary size {vocab_size}",
                             param="top_k")
    bad_stop = [t for t in creq.stop_token_ids if t >= vocab_size]
    if bad_stop:
        raise InvalidRequest(f"stop_token_ids outside the vocabulary [0, {vocab_size}): {bad_stop[:5]}",
                             param="stop_token_ids")
    if len(ids) + creq.max_tokens > max_context:
        raise InvalidRequest(f"prompt ({len(ids)} tokens) + max_tokens ({creq.max_tokens}) exceeds the "
                             f"model's context of {max_context} tokens", param="prompt",
                             code="context_length_exceeded")
    return replace(creq, prompt_ids=ids)
