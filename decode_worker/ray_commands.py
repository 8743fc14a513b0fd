"""The Ray transport's actor calls on a decode worker, as commands for its loop thread: a sender's
handshake, a dedupe query, a whole migration (payload frames or same-node pool offsets) and the
calls of a streamed migration. `DecodeWorker` queues them; `DecodeHandler.handle` runs them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KvHello:
    """Ray transport: a sender's handshake (msgpack bytes from RaySender)."""

    connection: str
    data: bytes


@dataclass(frozen=True)
class KvQuery:
    """Ray transport: a dedupe query."""

    connection: str
    data: bytes


@dataclass(frozen=True)
class KvReceive:
    """Ray transport: a manifest and its payload frames (zero-copy arrays from the object store),
    or, from a same-node sender, the frames' offsets in its pool file (`transfer.ray_shm`)."""

    connection: str
    manifest: bytes
    frames: tuple
    offsets: bytes | None = None


@dataclass(frozen=True)
class KvStream:
    """Ray transport, streamed migration: one `transfer.ray_stream` call (offer, blocks, final or
    cancel), its msgpack header, its sealed body and its payload arrays."""

    call: str
    connection: str
    header: bytes
    body: bytes = b""
    frames: tuple = ()
