"""Typed wire messages of KV migration and their schema validation.

Every message is a frozen dataclass with `to_wire()` (a plain msgpack-able dict carrying the
protocol version `v` and a `kind`) and `from_wire(d, limits)` (strict schema: known fields only,
exact types, explicit bounds, internal consistency). `transfer.codec` turns them into bytes.

Connection: `Hello` -> `HelloReply` (layout fingerprints compared once per connection).
Per transfer: optional `Query` -> `Held` (dedupe: which prefix blocks the receiver holds), then a
`Manifest` followed by raw payload chunks, answered by `Ack` or `Nack`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol.sampling import SamplingParams
from transfer.checksum import ALGORITHM
from transfer.errors import LimitExceeded, MalformedMessage
from transfer.schema import (
    U32,
    U64,
    Limits,
    get,
    get_float,
    get_int,
    get_packed,
    get_str,
    pack,
    require_keys,
)

PROTOCOL_VERSION = 2  # 2: the fingerprint names the model
MAX_U64 = (1 << 64) - 1
MAX_EPOCH = (1 << 63) - 1
FINGERPRINT_KEYS = ("num_layers", "num_kv_heads", "head_dim", "dtype", "block_size", "layout", "model")
CHECKSUM_MODES = ("manifest", "inline")  # checksums in the frame descriptors, or in each chunk's header

def validate_fingerprint(d, limits: Limits, what: str = "fingerprint") -> dict:
    require_keys(d, set(FINGERPRINT_KEYS), what)
    return {
        "num_layers": get_int(d, "num_layers", 1, 1 << 12, what),
        "num_kv_heads": get_int(d, "num_kv_heads", 1, 1 << 12, what),
        "head_dim": get_int(d, "head_dim", 1, 1 << 16, what),
        "dtype": get_str(d, "dtype", 32, what),
        "block_size": get_int(d, "block_size", 1, limits.max_block_size, what),
        "layout": get_str(d, "layout", 64, what),
        "model": get_str(d, "model", 64, what),
    }


def validate_sampling(d, limits: Limits | None = None) -> dict:
    """Sampling parameters with every field present (defaults filled in), checked by the one
    `SamplingParams` (protocol.sampling): its bounds are the wire's bounds."""
    try:
        return SamplingParams.from_dict(d).to_dict()
    except ValueError as e:
        raise MalformedMessage(f"sampling: {e}"[:300]) from None


@dataclass(frozen=True)
class DecodeState:
    """What the decode side needs to continue: every token so far (prompt and generated, the
    last one possibly without KV yet), the sampling parameters and how many were generated."""

    token_ids: list[int]
    sampling: dict = field(default_factory=dict)
    num_generated: int = 0

    def to_wire(self) -> dict:
        return {"token_ids": pack(self.token_ids, U32), "sampling": dict(self.sampling),
                "num_generated": self.num_generated}

    @classmethod
    def from_wire(cls, d, limits: Limits) -> DecodeState:
        require_keys(d, {"token_ids", "sampling", "num_generated"}, "state")
        tokens = get_packed(d, "token_ids", U32, limits.max_tokens, "state").tolist()
        gen = get_int(d, "num_generated", 0, len(tokens), "state")
        return cls(token_ids=tokens, sampling=validate_sampling(get(d, "sampling", "state"), limits),
                   num_generated=gen)


@dataclass(frozen=True)
class FrameDesc:
    """One payload frame: `num_blocks` physically adjacent sender blocks starting at logical
    block `first_block`, `nbytes` long, cut into chunks of the manifest's `chunk_bytes`;
    `checksums` holds one xxh3-64 per chunk ("manifest" mode) or is None ("inline" mode)."""

    first_block: int
    num_blocks: int
    nbytes: int
    checksums: tuple[int, ...] | None = None

    def num_chunks(self, chunk_bytes: int) -> int:
        return -(-self.nbytes // chunk_bytes)


@dataclass(frozen=True)
class Manifest:
    """Everything a receiver needs to validate, place and continue one migrated sequence.

    fingerprint: the sender's layout (its block size included). num_tokens: tokens with KV.
    block_tokens / block_hashes: valid tokens of each sender block, prefix hash of each full one.
    reuse: receiver logical blocks (in units of `reuse_block_size`, the receiver's block size)
    that the receiver said it holds; the sender blocks they cover are not sent.
    frames: payload frames in logical order; blocks not covered by a frame are reused ones.
    """

    request_id: str
    epoch: int
    fingerprint: dict
    num_tokens: int
    block_tokens: tuple[int, ...]
    block_hashes: tuple[int, ...]
    frames: tuple[FrameDesc, ...]
    chunk_bytes: int
    state: DecodeState
    checksum_mode: str = "manifest"
    extra_key: str | None = None
    reuse: tuple[int, ...] = ()
    reuse_block_size: int = 0
    version: int = PROTOCOL_VERSION

    @property
    def block_size(self) -> int:
        return self.fingerprint["block_size"]

    @property
    def payload_bytes(self) -> int:
        return sum(f.nbytes for f in self.frames)

    @property
    def num_chunks(self) -> int:
        return sum(f.num_chunks(self.chunk_bytes) for f in self.frames)

    def to_wire(self) -> dict:
        frames = [[f.first_block, f.num_blocks, f.nbytes,
                   None if f.checksums is None else pack(f.checksums, U64)] for f in self.frames]
        return {"v": self.version, "kind": "manifest", "request_id": self.request_id, "epoch": self.epoch,
                "fingerprint": dict(self.fingerprint), "num_tokens": self.num_tokens,
                "block_tokens": pack(self.block_tokens, U32), "block_hashes": pack(self.block_hashes, U64),
                "frames": frames, "chunk_bytes": self.chunk_bytes, "checksum": ALGORITHM,
                "checksum_mode": self.checksum_mode, "extra_key": self.extra_key,
                "reuse": pack(self.reuse, U32), "reuse_block_size": self.reuse_block_size,
                "state": self.state.to_wire()}

    @classmethod
    def from_wire(cls, d, limits: Limits) -> Manifest:
        w = "manifest"
        require_keys(d, {"v", "kind", "request_id", "epoch", "fingerprint", "num_tokens", "block_tokens",
                         "block_hashes", "frames", "chunk_bytes", "checksum", "checksum_mode", "extra_key",
                         "reuse", "reuse_block_size", "state"}, w)
        fp = validate_fingerprint(get(d, "fingerprint", w), limits)
        B = fp["block_size"]
        n = get_int(d, "num_tokens", 1, limits.max_tokens, w)
        nb = -(-n // B)
        block_tokens = get_packed(d, "block_tokens", U32, nb, w)
        last = n - (nb - 1) * B
        if block_tokens.size != nb or (block_tokens[:-1] != B).any() or block_tokens[-1] != last:
            raise MalformedMessage(f"{w}: block_tokens disagree with {n} tokens in blocks of {B}")
        hashes = get_packed(d, "block_hashes", U64, n // B, w)
        if hashes.size != n // B:
            raise MalformedMessage(f"{w}: {hashes.size} block hashes for {n // B} full blocks")
        if get_str(d, "checksum", 32, w) != ALGORITHM:
            raise MalformedMessage(f"{w}: unsupported checksum {d['checksum']!r} (expected {ALGORITHM})")
        mode = get_str(d, "checksum_mode", 16, w)
        if mode not in CHECKSUM_MODES:
            raise MalformedMessage(f"{w}: checksum_mode {mode!r} not in {CHECKSUM_MODES}")
        chunk = get_int(d, "chunk_bytes", limits.min_chunk_bytes, limits.max_chunk_bytes, w)
        reuse_bs = get_int(d, "reuse_block_size", 0, limits.max_block_size, w)
        reuse = get_packed(d, "reuse", U32, (n // reuse_bs) if reuse_bs else 0, w)
        if reuse.size and ((reuse[1:] <= reuse[:-1]).any() or (int(reuse[-1]) + 1) * reuse_bs > n):
            raise MalformedMessage(f"{w}: reuse must list distinct full receiver blocks in increasing order")
        frames = _frames_from_wire(get(d, "frames", w), nb, chunk, mode, limits)
        state = DecodeState.from_wire(get(d, "state", w), limits)
        if len(state.token_ids) < n:
            raise MalformedMessage(f"{w}: {len(state.token_ids)} token ids for {n} tokens with KV")
        return cls(request_id=get_str(d, "request_id", limits.max_id_len, w),
                   epoch=get_int(d, "epoch", 0, MAX_EPOCH, w), fingerprint=fp, num_tokens=n,
                   block_tokens=tuple(block_tokens.tolist()), block_hashes=tuple(hashes.tolist()),
                   frames=frames, chunk_bytes=chunk, state=state, checksum_mode=mode,
                   extra_key=get_str(d, "extra_key", limits.max_id_len, w, optional=True),
                   reuse=tuple(reuse.tolist()), reuse_block_size=reuse_bs, version=d["v"])


def _frames_from_wire(raw, nb: int, chunk: int, mode: str, limits: Limits) -> tuple[FrameDesc, ...]:
    w = "manifest.frames"
    if type(raw) is not list:
        raise MalformedMessage(f"{w}: expected a list, got {type(raw).__name__}")
    if len(raw) > min(limits.max_frames, nb):
        raise LimitExceeded(f"{w}: {len(raw)} frames, at most {min(limits.max_frames, nb)}")
    frames, next_block, total, chunks = [], 0, 0, 0
    for i, f in enumerate(raw):
        if type(f) is not list or len(f) != 4:
            raise MalformedMessage(f"{w}[{i}]: expected [first_block, num_blocks, nbytes, checksums]")
        d = {"first_block": f[0], "num_blocks": f[1], "nbytes": f[2]}
        first = get_int(d, "first_block", next_block, nb - 1, w)
        count = get_int(d, "num_blocks", 1, nb - first, w)
        nbytes = get_int(d, "nbytes", count, limits.max_payload_bytes - total, w)
        if nbytes % count:
            raise MalformedMessage(f"{w}[{i}]: {nbytes} bytes is not a whole number of {count} blocks")
        k = -(-nbytes // chunk)
        chunks += k
        if chunks > limits.max_chunks:
            raise LimitExceeded(f"{w}: more than {limits.max_chunks} chunks")
        sums = None
        if mode == "manifest":
            arr = get_packed({"checksums": f[3]}, "checksums", U64, k, w)
            if arr.size != k:
                raise MalformedMessage(f"{w}[{i}]: {arr.size} checksums for {k} chunks")
            sums = tuple(arr.tolist())
        elif f[3] is not None:
            raise MalformedMessage(f"{w}[{i}]: inline mode carries no checksums in the manifest")
        frames.append(FrameDesc(first, count, nbytes, sums))
        next_block, total = first + count, total + nbytes
    return tuple(frames)


@dataclass(frozen=True)
class Hello:
    """Sent once per connection by the sender: its layout and name."""

    fingerprint: dict
    peer: str = ""

    def to_wire(self) -> dict:
        return {"v": PROTOCOL_VERSION, "kind": "hello", "fingerprint": dict(self.fingerprint),
                "peer": self.peer}

    @classmethod
    def from_wire(cls, d, limits: Limits) -> Hello:
        require_keys(d, {"v", "kind", "fingerprint", "peer"}, "hello")
        return cls(validate_fingerprint(get(d, "fingerprint", "hello"), limits),
                   get_str(d, "peer", limits.max_id_len, "hello"))


@dataclass(frozen=True)
class HelloReply:
    """The receiver's answer when the layouts are compatible (otherwise a `Nack`)."""

    fingerprint: dict
    peer: str = ""

    def to_wire(self) -> dict:
        return {"v": PROTOCOL_VERSION, "kind": "hello_ok", "fingerprint": dict(self.fingerprint),
                "peer": self.peer}

    @classmethod
    def from_wire(cls, d, limits: Limits) -> HelloReply:
        require_keys(d, {"v", "kind", "fingerprint", "peer"}, "hello_ok")
        return cls(validate_fingerprint(get(d, "fingerprint", "hello_ok"), limits),
                   get_str(d, "peer", limits.max_id_len, "hello_ok"))


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
    def from_wire(cls, d, limits: Limits) -> Query:
        require_keys(d, {"v", "kind", "request_id", "block_size", "hashes"}, "query")
        return cls(get_str(d, "request_id", limits.max_id_len, "query"),
                   get_int(d, "block_size", 1, limits.max_block_size, "query"),
                   tuple(get_packed(d, "hashes", U64, limits.max_tokens, "query").tolist()))


@dataclass(frozen=True)
class Held:
    """Dedupe answer: indices (into the query's hashes) of the blocks the receiver holds."""

    request_id: str
    held: tuple[int, ...]

    def to_wire(self) -> dict:
        return {"v": PROTOCOL_VERSION, "kind": "held", "request_id": self.request_id,
                "held": pack(self.held, U32)}

    @classmethod
    def from_wire(cls, d, limits: Limits) -> Held:
        require_keys(d, {"v", "kind", "request_id", "held"}, "held")
        return cls(get_str(d, "request_id", limits.max_id_len, "held"),
                   tuple(get_packed(d, "held", U32, limits.max_tokens, "held").tolist()))


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
    def from_wire(cls, d, limits: Limits) -> Ack:
        w = "ack"
        require_keys(d, {"v", "kind", "request_id", "epoch", "new_blocks", "reused_blocks", "nbytes",
                         "timings"}, w)
        t = get(d, "timings", w)
        if type(t) is not dict or len(t) > 16:
            raise MalformedMessage(f"{w}.timings: expected a map of at most 16 entries")
        timings = {get_str({"k": k}, "k", 64, w): get_float(t, k, 0.0, 1e9, w) for k in t}
        return cls(get_str(d, "request_id", limits.max_id_len, w), get_int(d, "epoch", 0, MAX_EPOCH, w),
                   get_int(d, "new_blocks", 0, limits.max_tokens, w),
                   get_int(d, "reused_blocks", 0, limits.max_tokens, w),
                   get_int(d, "nbytes", 0, limits.max_payload_bytes, w), timings)


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
    def from_wire(cls, d, limits: Limits) -> Nack:
        w = "nack"
        require_keys(d, {"v", "kind", "request_id", "epoch", "code", "message"}, w)
        return cls(get_str(d, "request_id", limits.max_id_len, w), get_int(d, "epoch", 0, MAX_EPOCH, w),
                   get_str(d, "code", 32, w), get_str(d, "message", 1000, w))


MESSAGE_KINDS = {"manifest": Manifest, "hello": Hello, "hello_ok": HelloReply, "query": Query, "held": Held,
                 "ack": Ack, "nack": Nack}
__all__ = ["PROTOCOL_VERSION", "Limits", "LimitExceeded", "DecodeState", "FrameDesc", "Manifest", "Hello",
           "HelloReply", "Query", "Held", "Ack", "Nack", "MESSAGE_KINDS", "validate_fingerprint"]
