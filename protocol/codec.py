"""The worker protocol's one codec: typed messages <-> msgpack bytes, no pickle.

A message is a frozen dataclass registered with `@message`. It travels as a msgpack extension
(code 1) holding `[class name, {field: value}]`, so messages nest (a `WorkerReport` carries a
list of events, a `Submit` carries `SamplingParams`). Decoding rebuilds the class by name from
the registry only, checks every field against its annotation (`str`, `int`, `float`, `bool`,
`list[...]`, `dict`, `X | None`, or another registered message), and lets the class's own
`__post_init__` validate its values. Anything else is a `ProtocolError`.
"""

from __future__ import annotations

import dataclasses

import msgpack

from protocol.sampling import SamplingParams

MESSAGE_EXT = 1
MAX_MESSAGE_BYTES = 64 << 20
_REGISTRY: dict[str, type] = {"SamplingParams": SamplingParams}


class ProtocolError(ValueError):
    """A worker-protocol message that does not decode or validate."""


def message(cls):
    """Class decorator: register a frozen dataclass as a protocol message."""
    if not (dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen):
        raise TypeError(f"{cls.__name__} must be a frozen dataclass")
    if cls.__name__ in _REGISTRY:
        raise TypeError(f"message name {cls.__name__} registered twice")
    _REGISTRY[cls.__name__] = cls
    return cls


def _default(obj):
    name = type(obj).__name__
    if _REGISTRY.get(name) is type(obj):
        fields = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
        packed = msgpack.packb([name, fields], default=_default, use_bin_type=True)
        return msgpack.ExtType(MESSAGE_EXT, packed)
    if isinstance(obj, (set, frozenset)):
        return sorted(obj)
    raise TypeError(f"cannot encode {name} in the worker protocol")


def encode(msg) -> bytes:
    """A registered message (or plain msgpack data) -> bytes."""
    return msgpack.packb(msg, default=_default, use_bin_type=True)


_SIMPLE = {"str": str, "int": int, "float": (int, float), "bool": bool, "bytes": bytes, "dict": dict,
           "list": list}


def _split_top(text: str, sep: str) -> list[str]:
    """Split on `sep` outside brackets ("dict[str, int | None] | None" -> two parts on '|')."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += (ch == "[") - (ch == "]")
        if ch == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return [p.strip() for p in parts + [text[start:]]]


def _type_ok(value, annotation: str) -> bool:
    annotation = annotation.strip()
    union = _split_top(annotation, "|")
    if len(union) > 1:
        return any(_type_ok(value, part) for part in union)
    if annotation == "None":
        return value is None
    if annotation.startswith(("list[", "tuple[")):
        inner = _split_top(annotation[annotation.index("[") + 1:-1], ",")[0]
        return isinstance(value, (list, tuple)) and all(_type_ok(v, inner) for v in value)
    if annotation.startswith("dict["):
        key, val = _split_top(annotation[5:-1], ",")
        return isinstance(value, dict) and all(_type_ok(k, key) and _type_ok(v, val)
                                               for k, v in value.items())
    if annotation in ("int", "float") and isinstance(value, bool):
        return False
    simple = _SIMPLE.get(annotation) or _REGISTRY.get(annotation)
    if simple is None:
        raise TypeError(f"the codec cannot check annotation {annotation!r}")
    return isinstance(value, simple)


def _ext_hook(code: int, data: bytes):
    if code != MESSAGE_EXT:
        raise ProtocolError(f"unknown msgpack extension {code}")
    parts = msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=True)
    if not (isinstance(parts, list) and len(parts) == 2 and isinstance(parts[0], str)
            and isinstance(parts[1], dict)):
        raise ProtocolError("a message must be [name, fields]")
    name, values = parts
    cls = _REGISTRY.get(name)
    if cls is None:
        raise ProtocolError(f"unknown message {name[:64]!r}")
    if cls is SamplingParams:
        try:
            return SamplingParams.from_dict(values)
        except ValueError as e:
            raise ProtocolError(f"SamplingParams: {e}") from None
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(values) - set(known)
    if unknown:
        raise ProtocolError(f"{name}: unknown field(s) {sorted(map(str, unknown))[:5]}")
    for key, value in values.items():
        if not _type_ok(value, known[key].type):
            raise ProtocolError(f"{name}.{key}: expected {known[key].type}, got {type(value).__name__}")
    try:
        return cls(**values)
    except (TypeError, ValueError) as e:  # a missing field, or the class's own validation
        raise ProtocolError(f"{name}: {e}") from None


def decode(data: bytes, expect: type | tuple[type, ...] | None = None):
    """Bytes -> message; `expect` restricts the acceptable classes."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        msg = msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=True)
    except ProtocolError:
        raise
    except Exception as e:  # msgpack raises many kinds
        raise ProtocolError(f"not a protocol message: {type(e).__name__}: {e}"[:300]) from None
    if expect is not None and not isinstance(msg, expect):
        raise ProtocolError(f"expected {expect}, got {type(msg).__name__}")
    return msg
