"""The region and segment half of the NIXL data plane (`nixl_pool` is the agent): `Region`, a
registered memory range as a peer describes it (strictly checked: it comes from the other side's
handshake), and `plan_segments`, which checks a READ's (remote offset, local offset, nbytes)
segments against both regions before anything is issued and coalesces neighbours into one
descriptor each. Pure numpy: no nixl needed.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from transfer.errors import LimitExceeded, MalformedMessage

MEM_TYPES = ("DRAM", "VRAM")
MAX_REGION_BYTES = 1 << 48  # Region.from_wire's default bound (256 TiB)
MAX_DEVICE = 1 << 10
MAX_SEGMENTS = 1 << 20
_ADDR_END = 1 << 64


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class Region:
    """A registered memory region: `nbytes` at `addr` on device `dev` ("DRAM": host memory, dev 0;
    "VRAM": the CUDA device `dev`). Segment offsets are relative to `addr`."""

    addr: int
    nbytes: int
    dev: int
    mem: str

    def to_wire(self) -> dict:
        """A msgpack-friendly dict (ints and one str)."""
        return {"addr": self.addr, "nbytes": self.nbytes, "dev": self.dev, "mem": self.mem}

    @classmethod
    def from_wire(cls, wire, max_bytes: int = MAX_REGION_BYTES) -> Region:
        """The Region of a peer's `to_wire()` dict; MalformedMessage on a non-dict, missing or extra
        keys, non-int (or bool) numbers, a null or negative address, a size outside 1..max_bytes, a
        region past the end of the 64-bit address space, a device outside 0..1023, or an unknown
        memory type."""
        if not isinstance(wire, dict):
            raise MalformedMessage(f"region: expected a map, got {type(wire).__name__}")
        if set(wire) != {"addr", "nbytes", "dev", "mem"}:
            raise MalformedMessage(f"region: keys {sorted(map(str, wire))}, expected addr, dev, mem, nbytes")
        addr, nbytes, dev, mem = wire["addr"], wire["nbytes"], wire["dev"], wire["mem"]
        if not (_is_int(addr) and _is_int(nbytes) and _is_int(dev)):
            raise MalformedMessage("region: addr, nbytes and dev must be integers")
        if not _is_int(max_bytes) or max_bytes <= 0:
            raise ValueError(f"max_bytes must be a positive int, got {max_bytes!r}")
        if not 0 < addr < _ADDR_END:
            raise MalformedMessage(f"region: address {addr:#x} out of range")
        if not 0 < nbytes <= max_bytes:
            raise MalformedMessage(f"region: size {nbytes} outside 1..{max_bytes}")
        if addr + nbytes > _ADDR_END:
            raise MalformedMessage("region: ends past the 64-bit address space")
        if not 0 <= dev < MAX_DEVICE:
            raise MalformedMessage(f"region: device {dev} outside 0..{MAX_DEVICE - 1}")
        if not isinstance(mem, str) or mem not in MEM_TYPES:
            raise MalformedMessage(f"region: memory type {mem!r}, expected one of {MEM_TYPES}")
        return cls(addr, nbytes, dev, mem)


def _segment_arrays(segments) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(remote offsets, local offsets, sizes) as int64 arrays from an iterable of 3-int tuples or an
    (N, 3) integer array; MalformedMessage on anything else, LimitExceeded past MAX_SEGMENTS."""
    if isinstance(segments, np.ndarray):
        if segments.ndim != 2 or segments.shape[1] != 3 or segments.dtype.kind not in "iu":
            raise MalformedMessage(f"segments: expected an (N, 3) integer array, got {segments.shape} "
                                   f"{segments.dtype}")
        if len(segments) > MAX_SEGMENTS:
            raise LimitExceeded(f"segments: {len(segments)} > {MAX_SEGMENTS}")
        if segments.dtype.kind == "u" and len(segments) and int(segments.max()) >= 1 << 63:
            raise MalformedMessage("segments: offset or size out of range")
        arr = segments.astype(np.int64, copy=False)
    else:
        if not isinstance(segments, Iterable):
            raise MalformedMessage(f"segments: expected an iterable, got {type(segments).__name__}")
        flat: list[int] = []
        for i, seg in enumerate(segments):
            if i >= MAX_SEGMENTS:
                raise LimitExceeded(f"segments: more than {MAX_SEGMENTS}")
            if not isinstance(seg, (tuple, list)) or len(seg) != 3:
                raise MalformedMessage(f"segments[{i}]: expected (remote_offset, local_offset, nbytes)")
            for v in seg:
                if not _is_int(v) or not 0 <= v < 1 << 63:
                    raise MalformedMessage(f"segments[{i}]: {v!r} is not an integer in 0..2**63-1")
            flat.extend(seg)
        arr = np.array(flat, dtype=np.int64).reshape(-1, 3)
    return arr[:, 0], arr[:, 1], arr[:, 2]


def plan_segments(segments, remote: Region, local: Region) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Validate `segments` against both regions and coalesce neighbours: returns (remote offsets,
    local offsets, sizes) with each run of segments adjacent on both sides (in the given order) merged
    into one. MalformedMessage when a segment has a negative offset, a size < 1, reaches past either
    region, or when two segments overlap in the local region (the result would depend on order)."""
    r, lo, n = _segment_arrays(segments)
    if len(n) == 0:
        return r, lo, n
    if (r < 0).any() or (lo < 0).any() or (n <= 0).any():
        raise MalformedMessage("segments: negative offset or size < 1")
    # n <= nbytes first, so that nbytes - n cannot wrap
    if (n > remote.nbytes).any() or (r > remote.nbytes - n).any():
        bad = int(np.flatnonzero((n > remote.nbytes) | (r > remote.nbytes - n))[0])
        raise MalformedMessage(f"segments[{bad}]: remote ({int(r[bad])}, +{int(n[bad])}) outside the "
                               f"peer's region of {remote.nbytes} bytes")
    if (n > local.nbytes).any() or (lo > local.nbytes - n).any():
        bad = int(np.flatnonzero((n > local.nbytes) | (lo > local.nbytes - n))[0])
        raise MalformedMessage(f"segments[{bad}]: local ({int(lo[bad])}, +{int(n[bad])}) outside the "
                               f"local region of {local.nbytes} bytes")
    if len(n) > 1:
        order = np.argsort(lo, kind="stable")
        ls, ns = lo[order], n[order]
        if (ls[1:] < ls[:-1] + ns[:-1]).any():
            raise MalformedMessage("segments: overlapping local ranges")
        breaks = np.ones(len(n), dtype=bool)
        breaks[1:] = (r[1:] != r[:-1] + n[:-1]) | (lo[1:] != lo[:-1] + n[:-1])
        starts = np.flatnonzero(breaks)
        if len(starts) < len(n):
            r, lo, n = r[starts], lo[starts], np.add.reduceat(n, starts)
    return r, lo, n


def _descs(region: Region, offsets: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """The (N, 3) uint64 (address, length, device) rows NIXL builds a descriptor list from."""
    out = np.empty((len(sizes), 3), dtype=np.uint64)
    out[:, 0] = offsets.astype(np.uint64) + np.uint64(region.addr)
    out[:, 1] = sizes
    out[:, 2] = region.dev
    return out
