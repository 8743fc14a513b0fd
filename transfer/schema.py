"""Schema checks for wire dicts: typed field getters with explicit bounds, and the `Limits` that
bound every count and length a peer can claim. Each getter raises `MalformedMessage` for a
missing or mistyped field and `LimitExceeded` for a value outside its bounds, so nothing is ever
allocated from an unchecked number. Packed integer arrays travel as little-endian `bin` fields.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from transfer.errors import LimitExceeded, MalformedMessage

U32 = np.dtype("<u4")
U64 = np.dtype("<u8")
_MISSING = object()


@dataclass(frozen=True)
class Limits:
    """Bounds on what a peer may claim; checked before anything is sized by it.

    max_message_bytes: largest msgpack control message (manifest included) accepted.
    max_tokens: most tokens in one sequence (KV tokens and token ids so far).
    max_block_size: largest block size (tokens per block) either side may use.
    max_frames: most payload frames in one transfer.
    max_chunks: most wire chunks in one transfer (all frames together).
    min_chunk_bytes / max_chunk_bytes: allowed chunk size (the unit of wire messages and checksums).
    max_payload_bytes: most payload bytes in one transfer.
    max_id_len: longest request id, peer name or extra key.
    """

    max_message_bytes: int = 32 << 20
    max_tokens: int = 1 << 21
    max_block_size: int = 1 << 12
    max_frames: int = 1 << 16
    max_chunks: int = 1 << 20
    min_chunk_bytes: int = 1 << 12
    max_chunk_bytes: int = 1 << 24
    max_payload_bytes: int = 1 << 40
    max_id_len: int = 1024


def require_keys(d: dict, allowed: set[str], what: str) -> None:
    """The dict's keys must all be known (a strict schema; versions handle evolution)."""
    if not isinstance(d, dict):
        raise MalformedMessage(f"{what}: expected a map, got {type(d).__name__}")
    extra = set(d) - allowed
    if extra:
        raise MalformedMessage(f"{what}: unknown field(s) {sorted(map(str, extra))[:4]}")


def get(d: dict, key: str, what: str, default=_MISSING):
    v = d.get(key, default)
    if v is _MISSING:
        raise MalformedMessage(f"{what}: missing field {key!r}")
    return v


def get_int(d: dict, key: str, lo: int, hi: int, what: str, default=_MISSING, optional=False) -> int | None:
    v = get(d, key, what, default)
    if v is None and optional:
        return None
    if type(v) is not int:
        raise MalformedMessage(f"{what}.{key}: expected an integer, got {type(v).__name__}")
    if not lo <= v <= hi:
        raise LimitExceeded(f"{what}.{key}={v} outside [{lo}, {hi}]")
    return v


def get_float(d: dict, key: str, lo: float, hi: float, what: str, default=_MISSING) -> float:
    v = get(d, key, what, default)
    if type(v) not in (int, float):
        raise MalformedMessage(f"{what}.{key}: expected a number, got {type(v).__name__}")
    if not math.isfinite(v) or not lo <= v <= hi:
        raise LimitExceeded(f"{what}.{key}={v} outside [{lo}, {hi}]")
    return float(v)


def get_bool(d: dict, key: str, what: str, default=_MISSING) -> bool:
    v = get(d, key, what, default)
    if type(v) is not bool:
        raise MalformedMessage(f"{what}.{key}: expected a boolean, got {type(v).__name__}")
    return v


def get_str(d: dict, key: str, max_len: int, what: str, default=_MISSING, optional=False) -> str | None:
    v = get(d, key, what, default)
    if v is None and optional:
        return None
    if type(v) is not str:
        raise MalformedMessage(f"{what}.{key}: expected a string, got {type(v).__name__}")
    if len(v) > max_len:
        raise LimitExceeded(f"{what}.{key}: {len(v)} characters, at most {max_len}")
    return v


def get_packed(d: dict, key: str, dtype: np.dtype, max_items: int, what: str) -> np.ndarray:
    """A packed little-endian integer array (`bin`), length checked before it is viewed."""
    v = get(d, key, what)
    if type(v) is not bytes:
        raise MalformedMessage(f"{what}.{key}: expected packed bytes, got {type(v).__name__}")
    if len(v) % dtype.itemsize:
        raise MalformedMessage(f"{what}.{key}: {len(v)} bytes is not whole {dtype.itemsize}-byte items")
    if len(v) // dtype.itemsize > max_items:
        raise LimitExceeded(f"{what}.{key}: {len(v) // dtype.itemsize} items, at most {max_items}")
    return np.frombuffer(v, dtype=dtype)


def pack(values, dtype: np.dtype) -> bytes:
    """Pack integers as a little-endian array (ValueError if any does not fit)."""
    if not len(values):
        return b""
    arr = np.asarray(values, dtype=np.int64 if dtype == U32 else np.uint64)
    if dtype == U32 and arr.size and (arr.min() < 0 or arr.max() > 0xFFFFFFFF):
        raise ValueError("value does not fit in uint32")
    return arr.astype(dtype, copy=False).tobytes()

