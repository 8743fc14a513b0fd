"""The one codec of KV migration: typed messages <-> msgpack bytes. No pickle anywhere.

`encode(msg)` packs a message's wire dict. `decode(data, limits, expect)` refuses oversized input
before parsing, turns any parse failure into `MalformedMessage`, checks the protocol version
(`ProtocolVersionError`) and the kind, then hands the dict to the message's strict schema.
Payload frames never pass through here: they travel as raw bytes beside the manifest. Between
processes a manifest is `seal`ed with its own checksum and `unseal`ed before decoding.
"""

from __future__ import annotations

import msgpack

from transfer.checksum import checksum
from transfer.errors import (
    ChecksumError,
    LimitExceeded,
    MalformedMessage,
    ProtocolVersionError,
    TransferError,
    error_from_code,
)
from transfer.schema import Limits
from transfer.wire_messages import MESSAGE_KINDS, PROTOCOL_VERSION, Nack

DEFAULT_LIMITS = Limits()


def encode(msg) -> bytes:
    """msgpack bytes of a message (`Manifest`, `Hello`, `Ack`, ...)."""
    return msgpack.packb(msg.to_wire(), use_bin_type=True)


def unpack(data, limits: Limits = DEFAULT_LIMITS) -> dict:
    """Parse bounded msgpack into a map carrying the supported protocol version."""
    try:
        size = memoryview(data).nbytes
    except TypeError:
        raise MalformedMessage(f"expected bytes, got {type(data).__name__}") from None
    if size > limits.max_message_bytes:
        raise LimitExceeded(f"message of {size} bytes exceeds {limits.max_message_bytes}")
    try:
        # unpackb bounds every string/bin/array/map by the input size, itself bounded above.
        d = msgpack.unpackb(data, raw=False, strict_map_key=True, max_ext_len=0, use_list=True)
    except Exception as e:  # msgpack raises many kinds (ExtraData, FormatError, StackError, ...)
        raise MalformedMessage(f"not a msgpack message: {type(e).__name__}: {e}"[:300]) from None
    if type(d) is not dict:
        raise MalformedMessage(f"expected a msgpack map, got {type(d).__name__}")
    v = d.get("v")
    if type(v) is not int:
        raise MalformedMessage("message has no integer protocol version 'v'")
    if v != PROTOCOL_VERSION:
        raise ProtocolVersionError(f"protocol version {v} is not supported (this side: {PROTOCOL_VERSION})")
    return d


def decode(data, limits: Limits = DEFAULT_LIMITS, expect=None):
    """Bytes -> typed message. `expect`: a message class or tuple of classes that are acceptable."""
    d = unpack(data, limits)
    kind = d.get("kind")
    cls = MESSAGE_KINDS.get(kind) if type(kind) is str else None
    if cls is None:
        raise MalformedMessage(f"unknown message kind {kind!r}"[:200])
    if expect is not None and not (cls in expect if isinstance(expect, tuple) else cls is expect):
        raise MalformedMessage(f"unexpected message kind {kind!r}")
    return cls.from_wire(d, limits)


def seal(body: bytes) -> bytes:
    """A manifest as it crosses a process boundary: its msgpack bytes and their xxh3-64 (8 bytes,
    little endian), so a flipped bit anywhere in it (a token id, a sampling seed) is refused."""
    return body + checksum(body).to_bytes(8, "little")


def unseal(data) -> memoryview:
    """The body of a sealed manifest; ChecksumError when it does not match its digest."""
    view = memoryview(data).cast("B")
    if view.nbytes < 8:
        raise MalformedMessage(f"sealed manifest of {view.nbytes} bytes")
    body = view[:-8]
    if checksum(body) != int.from_bytes(view[-8:], "little"):
        raise ChecksumError("manifest failed its checksum")
    return body


def decode_manifest(data, limits: Limits = DEFAULT_LIMITS):
    return decode(data, limits, MESSAGE_KINDS["manifest"])


def decode_reply(data, cls, limits: Limits, metrics):
    """A receiver's answer of type `cls`; a Nack becomes its typed error. Every error is counted."""
    try:
        msg = decode(data, limits, (cls, Nack))
    except TransferError as e:
        metrics.record_error(e)
        raise
    if isinstance(msg, Nack):
        err = error_from_code(msg.code, msg.message)
        metrics.record_error(err)
        raise err
    return msg
