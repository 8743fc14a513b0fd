"""Field readers of the OpenAI request bodies, shared by /v1/completions (coordinator.completion_request)
and /v1/chat/completions (coordinator.chat): each reads one field of the decoded JSON object,
checks its type and range, and raises `InvalidRequest` (400) naming it. `json_object` turns the
raw body into that object only after coordinator.edge bounded its nesting (before parsing) and
its strings (UTF-8 encodable, after), so no body reaches a 500 through `json.loads` or a wire
encoder. Every integer has an upper bound: nothing past msgpack's int64 leaves the edge.
"""

from __future__ import annotations

import json

from coordinator.edge import check_depth, check_utf8
from coordinator.errors import InvalidRequest
from protocol.sampling import MAX_STOP_STRINGS, MAX_TOKEN_ID, is_int


def show(v) -> str:
    """A value for an error message, cut short (a client may send megabytes)."""
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."


def is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def int_field(body: dict, name: str, default, lo: int, hi: int):
    v = body.get(name)
    if v is None:
        return default
    if not is_int(v) or not lo <= v <= hi:
        raise InvalidRequest(f"'{name}' must be an integer in {lo}..{hi}, got {show(v)}", param=name)
    return v


def num_field(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if not is_num(v) or v != v or v > hi or v < lo or (lo_open and v == lo):
        rng = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
        raise InvalidRequest(f"'{name}' must be a number in {rng}, got {show(v)}", param=name)
    return float(v)


def bool_field(body: dict, name: str) -> bool:
    v = body.get(name)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise InvalidRequest(f"'{name}' must be a boolean, got {show(v)}", param=name)
    return v


def str_field(body: dict, name: str, max_chars: int) -> str:
    v = body.get(name)
    if v is None:
        return ""
    if not isinstance(v, str) or len(v) > max_chars:
        raise InvalidRequest(f"'{name}' must be a string of at most {max_chars} characters", param=name)
    return v


def prompt_field(body: dict) -> tuple[str | None, tuple[int, ...]]:
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
        if not all(is_int(t) and 0 <= t <= MAX_TOKEN_ID for t in p):
            raise InvalidRequest("'prompt' must be a string or a list of integer token ids in "
                                 f"0..{MAX_TOKEN_ID}", param="prompt")
        return None, tuple(p)
    raise InvalidRequest("'prompt' must be a string or a list of integer token ids", param="prompt")


def stop_field(body: dict) -> tuple[str, ...]:
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


def token_ids_field(body: dict, name: str) -> tuple[int, ...]:
    v = body.get(name) or []
    if not isinstance(v, list) or not all(is_int(t) and 0 <= t <= MAX_TOKEN_ID for t in v):
        raise InvalidRequest(f"'{name}' must be a list of integer token ids in 0..{MAX_TOKEN_ID}", param=name)
    return tuple(v)


def json_object(raw: bytes | str | dict) -> dict:
    """The request body as a dict; InvalidRequest when it is not a JSON object, nests too deep,
    or holds a string UTF-8 cannot encode."""
    if isinstance(raw, (bytes, bytearray, str)):
        check_depth(raw)
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise InvalidRequest(f"request body is not valid JSON: {str(e)[:200]}") from None
    else:
        body = raw
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    check_utf8(body)
    return body
