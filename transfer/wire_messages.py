"""Typed wire messages of KV migration's connection, and the registry of every message kind.

Every message is a frozen dataclass with `to_wire()` (a plain msgpack-able dict carrying the
protocol version `v` and a `kind`) and `from_wire(wire, limits)` (strict schema: known fields
only, exact types, explicit bounds, internal consistency); `transfer.wire_codec` turns them into
bytes. Connection: `Hello` -> `HelloReply` (layout fingerprints compared once per connection).
Per transfer: optional `Query` -> `Held` (dedupe: which prefix blocks the receiver holds), then a
`Manifest` (with its `FrameDesc`s and `DecodeState`, defined in `transfer.manifest` and
re-exported here) followed by raw payload chunks, answered by `Ack` or `Nack`; a streamed
migration's manifest goes out before the prompt is fully computed and a `Final` closes it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from transfer.errors import LimitExceeded, MalformedMessage
from transfer.manifest import (
    CHECKSUM_MODES,
    FINGERPRINT_KEYS,
    MAX_EPOCH,
    PROTOCOL_VERSION,
    DecodeState,
    FrameDesc,
    Manifest,
    validate_fingerprint,
    validate_sampling,
)
from transfer.schema import (
    U32,
    U64,
    Limits,
    get,
    get_bool,
    get_float,
    get_int,
    get_packed,
    get_str,
    pack,
    require_keys,
)


@dataclass(frozen=True)
class Hello:
    """Sent once per connection by the sender: its layout and name, signed with the cluster secret
    when the cluster has one (issued_at, nonce and tag: protocol.curve.hmac_sign)."""

    fingerprint: dict
    peer: str = ""
    issued_at: float = 0.0
    nonce: str = ""
    tag: str = ""
    stream: str = ""  # the bulk link this sender wants: "tcp", "ipc", or "" (payload in ZeroMQ frames)
    pool_path: str = ""  # Ray transport: the sender's /dev/shm pool file, for a same-node receiver
    to: str = ""  # the receiver this hello is meant for (its peer_name): signed, so it binds the hello

    def signed_fields(self) -> list[str]:
        return [json.dumps(self.fingerprint, sort_keys=True), self.peer, self.stream, self.pool_path, self.to]

    def to_wire(self) -> dict:
        return {"v": PROTOCOL_VERSION, "kind": "hello", "fingerprint": dict(self.fingerprint),
                "peer": self.peer, "issued_at": self.issued_at, "nonce": self.nonce, "tag": self.tag,
                "stream": self.stream, "pool_path": self.pool_path, "to": self.to}

    @classmethod
    def from_wire(cls, wire, limits: Limits) -> Hello:
        what = "hello"
        require_keys(wire, {"v", "kind", "fingerprint", "peer", "issued_at", "nonce", "tag", "stream",
                            "pool_path", "to"}, what)
        stream = get_str(wire, "stream", 8, what, "")
        if stream not in ("", "tcp", "ipc"):
            raise MalformedMessage(f"hello asks for an unknown bulk link {stream[:8]!r}")
        return cls(validate_fingerprint(get(wire, "fingerprint", what), limits),
                   get_str(wire, "peer", limits.max_id_len, what),
                   get_float(wire, "issued_at", 0.0, 1e12, what, 0.0),
                   get_str(wire, "nonce", 64, what, ""), get_str(wire, "tag", 128, what, ""), stream,
                   get_str(wire, "pool_path", 200, what, ""),
                   get_str(wire, "to", limits.max_id_len, what, ""))


@dataclass(frozen=True)
class HelloReply:
    """The receiver's answer when the layouts are compatible (otherwise a `Nack`); signed with the
    cluster secret, bound to the hello it answers (`transport.sign_reply`), when there is one."""

    fingerprint: dict
    peer: str = ""
    data_port: int = 0    # the receiver's bulk link, when the hello asked for one: a TCP port on the
    data_path: str = ""   # host the sender connected to, or a Unix socket path (Ray: the sender's
                          # pool file, when this receiver mapped it: payloads are read from there);
    data_token: str = ""  # and the token (hex) that opens it, issued to this connection only
    tag: str = ""         # HMAC of the fields below and the hello's nonce (transport.sign_reply)

    def signed_fields(self) -> list[str]:
        return ["hello_ok", json.dumps(self.fingerprint, sort_keys=True), self.peer, str(self.data_port),
                self.data_path, self.data_token]

    def to_wire(self) -> dict:
        return {"v": PROTOCOL_VERSION, "kind": "hello_ok", "fingerprint": dict(self.fingerprint),
                "peer": self.peer, "data_port": self.data_port, "data_path": self.data_path,
                "data_token": self.data_token, "tag": self.tag}

    @classmethod
    def from_wire(cls, wire, limits: Limits) -> HelloReply:
        what = "hello_ok"
        require_keys(wire, {"v", "kind", "fingerprint", "peer", "data_port", "data_path", "data_token",
                            "tag"}, what)
        return cls(validate_fingerprint(get(wire, "fingerprint", what), limits),
                   get_str(wire, "peer", limits.max_id_len, what),
                   get_int(wire, "data_port", 0, 65535, what, 0), get_str(wire, "data_path", 200, what, ""),
                   get_str(wire, "data_token", 64, what, ""), get_str(wire, "tag", 128, what, ""))


@dataclass(frozen=True)
class Query:
    """Dedupe question: prefix hashes of the sequence's full blocks, computed at the receiver's
    block size (known from the handshake)."""

    request_id: str
    block_size: int
    hashes: tuple[int, ...]

    def to_wire(self) -> dict:
        return {"v": PROTOCOL_VERSION, "kind": "query", "request_id": self.request_id,
                "block_size": self.block_size, "hashes": pack(self.hashes, U64)}

    @classmethod
    def from_wire(cls, wire, limits: Limits) -> Query:
        require_keys(wire, {"v", "kind", "request_id", "block_size", "hashes"}, "query")
        return cls(get_str(wire, "request_id", limits.max_id_len, "query"),
                   get_int(wire, "block_size", 1, limits.max_block_size, "query"),
                   tuple(get_packed(wire, "hashes", U64, limits.max_tokens, "query").tolist()))


@dataclass(frozen=True)
class Held:
    """Dedupe answer: indices (into the query's hashes) of the blocks the receiver holds."""

    request_id: str
    held: tuple[int, ...]

    def to_wire(self) -> dict:
        return {"v": PROTOCOL_VERSION, "kind": "held", "request_id": self.request_id,
                "held": pack(self.held, U32)}

    @classmethod
    def from_wire(cls, wire, limits: Limits) -> Held:
        require_keys(wire, {"v", "kind", "request_id", "held"}, "held")
        return cls(get_str(wire, "request_id", limits.max_id_len, "held"),
                   tuple(get_packed(wire, "held", U32, limits.max_tokens, "held").tolist()))


@dataclass(frozen=True)
class Ack:
    """The receiver committed the import: the sender may drop its lease."""

    request_id: str
    epoch: int
    new_blocks: int = 0
    reused_blocks: int = 0
    nbytes: int = 0
    timings: dict = field(default_factory=dict)  # receiver-side phases, milliseconds

    def to_wire(self) -> dict:
        return {"v": PROTOCOL_VERSION, "kind": "ack", "request_id": self.request_id, "epoch": self.epoch,
                "new_blocks": self.new_blocks, "reused_blocks": self.reused_blocks, "nbytes": self.nbytes,
                "timings": dict(self.timings)}

    @classmethod
    def from_wire(cls, wire, limits: Limits) -> Ack:
        what = "ack"
        require_keys(wire, {"v", "kind", "request_id", "epoch", "new_blocks", "reused_blocks", "nbytes",
                            "timings"}, what)
        raw_timings = get(wire, "timings", what)
        if type(raw_timings) is not dict or len(raw_timings) > 16:
            raise MalformedMessage(f"{what}.timings: expected a map of at most 16 entries")
        timings = {get_str({"k": key}, "k", 64, what): get_float(raw_timings, key, 0.0, 1e9, what)
                   for key in raw_timings}
        return cls(get_str(wire, "request_id", limits.max_id_len, what),
                   get_int(wire, "epoch", 0, MAX_EPOCH, what),
                   get_int(wire, "new_blocks", 0, limits.max_tokens, what),
                   get_int(wire, "reused_blocks", 0, limits.max_tokens, what),
                   get_int(wire, "nbytes", 0, limits.max_payload_bytes, what), timings)


@dataclass(frozen=True)
class Nack:
    """The receiver refused (hello or transfer); `code` is a `TransferError.code`."""

    request_id: str
    epoch: int
    code: str
    message: str = ""

    def to_wire(self) -> dict:
        return {"v": PROTOCOL_VERSION, "kind": "nack", "request_id": self.request_id, "epoch": self.epoch,
                "code": self.code, "message": self.message[:1000]}

    @classmethod
    def from_wire(cls, wire, limits: Limits) -> Nack:
        what = "nack"
        require_keys(wire, {"v", "kind", "request_id", "epoch", "code", "message"}, what)
        return cls(get_str(wire, "request_id", limits.max_id_len, what),
                   get_int(wire, "epoch", 0, MAX_EPOCH, what),
                   get_str(wire, "code", 32, what), get_str(wire, "message", 1000, what))


@dataclass(frozen=True)
class Final:
    """The last message of a streamed migration: the decode state known only once the prompt's
    prefill finished (its first generated token included). The offer's manifest carried a
    provisional state; the receiver commits only after this arrived and every chunk landed."""

    request_id: str
    epoch: int
    state: DecodeState

    def to_wire(self) -> dict:
        return {"v": PROTOCOL_VERSION, "kind": "final", "request_id": self.request_id, "epoch": self.epoch,
                "state": self.state.to_wire()}

    @classmethod
    def from_wire(cls, wire, limits: Limits) -> Final:
        what = "final"
        require_keys(wire, {"v", "kind", "request_id", "epoch", "state"}, what)
        state = DecodeState.from_wire(get(wire, "state", what), limits)
        return cls(get_str(wire, "request_id", limits.max_id_len, what),
                   get_int(wire, "epoch", 0, MAX_EPOCH, what), state)


@dataclass(frozen=True)
class PoolOffer:
    """A handshaken sender offers its pool for the receiver to read payloads from (`transfer.pull`):
    `kind` names the way ("shm": a /dev/shm file on this node; "nixl": a NIXL agent's registered
    region), `blob` is that way's description, parsed strictly by its opener."""

    kind: str
    blob: bytes

    def to_wire(self) -> dict:
        return {"v": PROTOCOL_VERSION, "kind": "pool_offer", "way": self.kind, "blob": bytes(self.blob)}

    @classmethod
    def from_wire(cls, wire, limits: Limits) -> PoolOffer:
        what = "pool offer"
        require_keys(wire, {"v", "kind", "way", "blob"}, what)
        blob = get(wire, "blob", what)
        if type(blob) is not bytes or len(blob) > POOL_OFFER_MAX_BYTES:
            raise MalformedMessage(f"{what}: blob must be bytes of at most {POOL_OFFER_MAX_BYTES}")
        return cls(get_str(wire, "way", 16, what), blob)


@dataclass(frozen=True)
class PoolReply:
    """The receiver's answer to a `PoolOffer`: whether payloads may name places in that pool."""

    accepted: bool
    why: str = ""

    def to_wire(self) -> dict:
        return {"v": PROTOCOL_VERSION, "kind": "pool_reply", "accepted": self.accepted, "why": self.why}

    @classmethod
    def from_wire(cls, wire, limits: Limits) -> PoolReply:
        require_keys(wire, {"v", "kind", "accepted", "why"}, "pool reply")
        return cls(get_bool(wire, "accepted", "pool reply"), get_str(wire, "why", 200, "pool reply", ""))


POOL_OFFER_MAX_BYTES = 4096
MESSAGE_KINDS = {"manifest": Manifest, "hello": Hello, "hello_ok": HelloReply, "query": Query, "held": Held,
                 "ack": Ack, "nack": Nack, "final": Final, "pool_offer": PoolOffer, "pool_reply": PoolReply}
__all__ = ["PROTOCOL_VERSION", "MAX_EPOCH", "FINGERPRINT_KEYS", "CHECKSUM_MODES", "Limits", "LimitExceeded",
           "DecodeState", "FrameDesc", "Manifest", "Hello", "HelloReply", "Query", "Held", "Ack", "Nack",
           "Final", "PoolOffer", "PoolReply", "MESSAGE_KINDS", "validate_fingerprint", "validate_sampling"]
