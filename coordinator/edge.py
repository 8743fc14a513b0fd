"""Cheap checks on a request body before and right after JSON parsing, so no body can turn into
a 500 or cost more than one linear pass: `check_depth` refuses nesting deeper than
`MAX_JSON_DEPTH` by scanning the raw bytes (string literals, escapes included, are skipped by one
regular expression; only the bracket bytes left are counted), before `json.loads` could recurse;
`check_utf8` refuses any string, key or value, that cannot be encoded as UTF-8 (a lone surrogate
such as JSON "\\ud800" decodes to a Python str that no wire, tokenizer or msgpack can carry).
Both raise `InvalidRequest` (400) naming the field where they can.
"""

from __future__ import annotations

import json
import re

from coordinator.errors import InvalidRequest

MAX_JSON_DEPTH = 64  # nesting levels of arrays and objects in a request body

# one JSON string literal, escapes included; an unterminated one runs to the end of the body, so
# the match never fails after scanning (a failing match retried at every quote is quadratic)
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z)', re.DOTALL)
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")
_OPEN = frozenset(b"[{")


def json_depth_exceeds(raw: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether the JSON text `raw` nests arrays/objects deeper than `limit` (stops at the first
    level past it; brackets inside strings do not count)."""
    brackets = _STRING.sub(b"", raw).translate(None, _NOT_BRACKET)
    if brackets.count(b"[") + brackets.count(b"{") <= limit:  # the common case: no loop at all
        return False
    depth = 0
    for b in brackets:
        depth += 1 if b in _OPEN else -1
        if depth > limit:
            return True
    return False


def check_depth(raw: bytes | str, limit: int = MAX_JSON_DEPTH) -> None:
    """InvalidRequest when the body nests deeper than `limit`."""
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else bytes(raw)
    if json_depth_exceeds(data, limit):
        raise InvalidRequest(f"request body nests arrays/objects deeper than {limit} levels")


def check_utf8(body: dict) -> None:
    """InvalidRequest naming the top-level field that holds a string UTF-8 cannot encode."""
    for key, value in body.items():
        try:
            json.dumps([key, value], ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            name = key.encode("utf-8", "backslashreplace").decode("ascii", "backslashreplace")
            raise InvalidRequest(f"'{name[:64]}' holds a string that is not valid Unicode (a lone "
                                 "surrogate such as \\ud800); send UTF-8 text", param=name[:64]) from None
        except (TypeError, ValueError, RecursionError):  # not JSON data (a dict built in process)
            raise InvalidRequest(f"'{str(key)[:64]}' is not JSON data") from None
