"""The per-transfer manifest of KV migration and the checks shared by every wire message.

A `Manifest` describes one migrated sequence: the sender's layout fingerprint, its blocks and
their prefix hashes, the payload `FrameDesc`s with their checksums, the prefix blocks the
receiver reuses, and the `DecodeState` decode needs to continue. Like the connection messages in
`transfer.wire_messages` it has `to_wire()` (a msgpack-able dict with the protocol version `v` and a
`kind`) and `from_wire(wire, limits)` (strict schema: known fields only, exact types, explicit
bounds, internal consistency). `validate_fingerprint` and `PROTOCOL_VERSION` serve both modules.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol.sampling import SamplingParams
from transfer.checksum import ALGORITHM
from transfer.errors import LimitExceeded, MalformedMessage
from transfer.schema import U32, U64, Limits, get, get_int, get_packed, get_str, pack, require_keys

PROTOCOL_VERSION = 5  # 2: the fingerprint names the model; 3: the handshake is signed;
# 4: manifests are sealed with their checksum, and the handshake opens a bulk link;
# 5: frames may carry blocks re-blocked by the sender (frame_block_size)
MAX_EPOCH = (1 << 63) - 1
FINGERPRINT_KEYS = ("num_layers", "num_kv_heads", "head_dim", "dtype", "block_size", "layout", "model")
CHECKSUM_MODES = ("manifest", "inline")  # checksums in the frame descriptors, or in each chunk's header


def validate_fingerprint(wire, limits: Limits, what: str = "fingerprint") -> dict:
    require_keys(wire, set(FINGERPRINT_KEYS), what)
    return {
        "num_layers": get_int(wire, "num_layers", 1, 1 << 12, what),
        "num_kv_heads": get_int(wire, "num_kv_heads", 1, 1 << 12, what),
        "head_dim": get_int(wire, "head_dim", 1, 1 << 16, what),
        "dtype": get_str(wire, "dtype", 32, what),
        "block_size": get_int(wire, "block_size", 1, limits.max_block_size, what),
        "layout": get_str(wire, "layout", 64, what),
        "model": get_str(wire, "model", 64, what),
    }


def validate_sampling(wire, limits: Limits | None = None) -> dict:
    """Sampling parameters with every field present (defaults filled in), checked by the one
    `SamplingParams` (protocol.sampling): its bounds are the wire's bounds."""
    try:
        return SamplingParams.from_dict(wire).to_dict()
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
    def from_wire(cls, wire, limits: Limits) -> DecodeState:
        require_keys(wire, {"token_ids", "sampling", "num_generated"}, "state")
        tokens = get_packed(wire, "token_ids", U32, limits.max_tokens, "state").tolist()
        generated = get_int(wire, "num_generated", 0, len(tokens), "state")
        return cls(token_ids=tokens, sampling=validate_sampling(get(wire, "sampling", "state"), limits),
                   num_generated=generated)


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
    frame_block_size: 0 when frames carry sender blocks; the receiver's block size when the
    sender re-blocked the payload into receiver blocks (frames then count receiver blocks, and
    the receiver lands them straight in its own blocks).
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
    frame_block_size: int = 0
    version: int = PROTOCOL_VERSION

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
                "frame_block_size": self.frame_block_size, "state": self.state.to_wire()}

    @classmethod
    def from_wire(cls, wire, limits: Limits) -> Manifest:
        what = "manifest"
        require_keys(wire, {"v", "kind", "request_id", "epoch", "fingerprint", "num_tokens", "block_tokens",
                            "block_hashes", "frames", "chunk_bytes", "checksum", "checksum_mode", "extra_key",
                            "reuse", "reuse_block_size", "frame_block_size", "state"}, what)
        fingerprint = validate_fingerprint(get(wire, "fingerprint", what), limits)
        block_size = fingerprint["block_size"]
        num_tokens = get_int(wire, "num_tokens", 1, limits.max_tokens, what)
        num_blocks, num_full = -(-num_tokens // block_size), num_tokens // block_size
        block_tokens = get_packed(wire, "block_tokens", U32, num_blocks, what)
        last = num_tokens - (num_blocks - 1) * block_size
        if (block_tokens.size != num_blocks or (block_tokens[:-1] != block_size).any()
                or block_tokens[-1] != last):
            raise MalformedMessage(f"{what}: block_tokens disagree with {num_tokens} tokens "
                                   f"in blocks of {block_size}")
        hashes = get_packed(wire, "block_hashes", U64, num_full, what)
        if hashes.size != num_full:
            raise MalformedMessage(f"{what}: {hashes.size} block hashes for {num_full} full blocks")
        if get_str(wire, "checksum", 32, what) != ALGORITHM:
            raise MalformedMessage(f"{what}: unsupported checksum {wire['checksum']!r} "
                                   f"(expected {ALGORITHM})")
        mode = get_str(wire, "checksum_mode", 16, what)
        if mode not in CHECKSUM_MODES:
            raise MalformedMessage(f"{what}: checksum_mode {mode!r} not in {CHECKSUM_MODES}")
        chunk = get_int(wire, "chunk_bytes", limits.min_chunk_bytes, limits.max_chunk_bytes, what)
        reuse_size = get_int(wire, "reuse_block_size", 0, limits.max_block_size, what)
        reuse = get_packed(wire, "reuse", U32, (num_tokens // reuse_size) if reuse_size else 0, what)
        if reuse.size and ((reuse[1:] <= reuse[:-1]).any() or (int(reuse[-1]) + 1) * reuse_size > num_tokens):
            raise MalformedMessage(f"{what}: reuse must list distinct full receiver blocks "
                                   "in increasing order")
        frame_size = get_int(wire, "frame_block_size", 0, limits.max_block_size, what)
        frame_blocks = -(-num_tokens // frame_size) if frame_size else num_blocks
        frames = _frames_from_wire(get(wire, "frames", what), frame_blocks, chunk, mode, limits)
        state = DecodeState.from_wire(get(wire, "state", what), limits)
        if len(state.token_ids) < num_tokens:
            raise MalformedMessage(f"{what}: {len(state.token_ids)} token ids for {num_tokens} "
                                   "tokens with KV")
        return cls(request_id=get_str(wire, "request_id", limits.max_id_len, what),
                   epoch=get_int(wire, "epoch", 0, MAX_EPOCH, what), fingerprint=fingerprint,
                   num_tokens=num_tokens, block_tokens=tuple(block_tokens.tolist()),
                   block_hashes=tuple(hashes.tolist()), frames=frames, chunk_bytes=chunk, state=state,
                   checksum_mode=mode,
                   extra_key=get_str(wire, "extra_key", limits.max_id_len, what, optional=True),
                   reuse=tuple(reuse.tolist()), reuse_block_size=reuse_size, frame_block_size=frame_size,
                   version=wire["v"])


def _frames_from_wire(raw, num_blocks: int, chunk: int, mode: str, limits: Limits) -> tuple[FrameDesc, ...]:
    what = "manifest.frames"
    if type(raw) is not list:
        raise MalformedMessage(f"{what}: expected a list, got {type(raw).__name__}")
    if len(raw) > min(limits.max_frames, num_blocks):
        raise LimitExceeded(f"{what}: {len(raw)} frames, at most {min(limits.max_frames, num_blocks)}")
    frames, next_block, total, chunks = [], 0, 0, 0
    for i, entry in enumerate(raw):
        if type(entry) is not list or len(entry) != 4:
            raise MalformedMessage(f"{what}[{i}]: expected [first_block, num_blocks, nbytes, checksums]")
        fields = {"first_block": entry[0], "num_blocks": entry[1], "nbytes": entry[2]}
        first = get_int(fields, "first_block", next_block, num_blocks - 1, what)
        count = get_int(fields, "num_blocks", 1, num_blocks - first, what)
        nbytes = get_int(fields, "nbytes", count, limits.max_payload_bytes - total, what)
        if nbytes % count:
            raise MalformedMessage(f"{what}[{i}]: {nbytes} bytes is not a whole number of {count} blocks")
        frame_chunks = -(-nbytes // chunk)
        chunks += frame_chunks
        if chunks > limits.max_chunks:
            raise LimitExceeded(f"{what}: more than {limits.max_chunks} chunks")
        sums = None
        if mode == "manifest":
            packed = get_packed({"checksums": entry[3]}, "checksums", U64, frame_chunks, what)
            if packed.size != frame_chunks:
                raise MalformedMessage(f"{what}[{i}]: {packed.size} checksums for {frame_chunks} chunks")
            sums = tuple(packed.tolist())
        elif entry[3] is not None:
            raise MalformedMessage(f"{what}[{i}]: inline mode carries no checksums in the manifest")
        frames.append(FrameDesc(first, count, nbytes, sums))
        next_block, total = first + count, total + nbytes
    return tuple(frames)
