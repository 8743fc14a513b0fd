"""The data-plane primitive of the `--transport nixl` KV channel: one NIXL agent (NVIDIA's transfer
library, UCX backend) per worker, its whole KV pool registered as one region, and one bounded
one-sided READ per migration. The decode side pulls: the prefill worker sends its agent metadata and
pool `Region` in its signed handshake; for each migration the decode worker reserves blocks in its own
registered pool and READs (remote offset -> local offset, nbytes) segments straight from the prefill
pool, then verifies checksums and acks over the ZeroMQ control channel. Pulling needs no extra round
trip, because the receiver knows where the blocks go only once it has reserved them, while the
manifest already carries the sender's block offsets and the sender's blocks stay leased until the ack
anyway (vLLM's NixlConnector also has decode read from prefill). Nothing here changes between CPU and
CUDA: a region's memory type ("DRAM" or "VRAM") and device come from the registered tensor, and UCX
picks the path (shared memory or CMA between local processes, cuda_ipc, RDMA, TCP).

NIXL behaviours this code relies on or guards against (measured with nixl 1.5 on CPU):
- Releasing an in-flight READ handle (`release_xfer_handle`) succeeds but does NOT stop the READ:
  UCX's `ucp_request_cancel` does not abort an RMA GET, and the bytes still land in the local
  segments once the peer or network makes progress. So a READ that times out or fails leaves its
  local ranges *tainted* (`TransferTimeout.tainted`, `NixlAgent.tainted`): the caller must not hand
  those blocks to another sequence until `close()` has returned. `close()` destroys the agent's UCX
  worker, which purges its outstanding requests: no late byte lands afterwards (measured with a
  stopped peer over TCP; not measured here: a CUDA IPC copy already queued on a copy engine still
  completes, an RDMA QP goes with the worker). Closing with a READ outstanding can make the *peer's*
  UCX abort when it resumes ("Fatal: unexpected error: Endpoint timeout", seen with the TCP-emulated
  GET), so a stalled peer should be presumed lost.
- `transfer()` may copy synchronously (CMA between processes on one host): the bound applies from
  the post, and a READ that completed inside the post is not failed for having taken long.
- NIXL itself refuses descriptors outside the registrations it knows (`NIXL_ERR_NOT_FOUND`), but a
  peer may have registered more than its handshake `Region`, so every segment is also checked here.
- Loading metadata under a name already connected with other metadata is refused
  (`NIXL_ERR_NOT_ALLOWED`): `forget()` the old incarnation first. Removing a peer invalidates handles
  created for it. Metadata is about 0.3 KiB plus about 0.1 KiB per registration over TCP/shm.
- Building a transfer from descriptor lists costs about 0.1 ms per 1,000 segments (0.2 us each) next to
  a few us per posted segment, so prepared lists (`prep_xfer_dlist`/`make_prepped_xfer`) are not used;
  coalescing adjacent segments is what pays.

One thread per agent: NIXL's agent is created without locking (NIXL_THREAD_SYNC_NONE).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from transfer.errors import LimitExceeded, MalformedMessage, TransferTimeout, TransportClosed

INSTALL_HINT = "pip install 'pdserve[nixl]'  (on CPU: pip install --no-deps nixl nixl-cu12)"
MEM_TYPES = ("DRAM", "VRAM")
MAX_METADATA_BYTES = 64 << 10
MAX_REGION_BYTES = 1 << 48  # Region.from_wire's default bound (256 TiB)
MAX_DEVICE = 1 << 10
MAX_SEGMENTS = 1 << 20
_ADDR_END = 1 << 64

# The wait loop: poll flat out for this long, then sleep from _SLEEP_FIRST_S, doubling up to _SLEEP_MAX_S
# (time.sleep rounds up by the kernel's timer slack, about 50 us).
_SPIN_S = 100e-6
_SLEEP_FIRST_S = 10e-6
_SLEEP_MAX_S = 500e-6


class NixlUnavailable(RuntimeError):
    """The optional `nixl` package cannot be imported."""


def _nixl_api():
    """nixl's Python API module, or NixlUnavailable with the install hint."""
    try:
        from nixl import _api
    except ImportError as e:  # not installed, or no backend wheel (nixl-cu12, ...) for it
        raise NixlUnavailable(f"nixl is not importable ({e}); {INSTALL_HINT}") from e
    return _api


def available() -> bool:
    """Whether nixl can be imported here."""
    try:
        _nixl_api()
    except NixlUnavailable:
        return False
    return True


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


class NixlAgent:
    """One NIXL agent with the UCX backend: registers pools, connects peers, READs from them.
    Use from one thread. `close()` (idempotent) releases every handle, deregisters, forgets every peer
    and destroys the agent; every other method raises TransportClosed afterwards."""

    def __init__(self, name: str):
        if not isinstance(name, str) or not name:
            raise ValueError("agent name must be a non-empty str")
        api = _nixl_api()
        self.name = name
        self._agent = api.nixl_agent(name, api.nixl_agent_config(backends=["UCX"]))
        if "UCX" not in self._agent.backends:
            raise NixlUnavailable(f"nixl has no UCX backend plugin here; {INSTALL_HINT}")
        self._regions: dict[Region, tuple[object, object]] = {}  # region -> (tensor kept alive, reg dlist)
        self._peers: dict[str, bytes] = {}  # name -> its metadata
        self._stuck: list[object] = []  # handles NIXL refused to release; retried at close()
        self._tainted: list[tuple[Region, int, int]] = []

    # -- state ---------------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._agent is None

    @property
    def peers(self) -> tuple[str, ...]:
        return tuple(self._peers)

    @property
    def tainted(self) -> tuple[tuple[Region, int, int], ...]:
        """(local region, offset, nbytes) ranges a timed-out or failed READ may still write into:
        do not reuse them before close() has returned."""
        return tuple(self._tainted)

    def _live(self):
        if self._agent is None:
            raise TransportClosed(f"nixl agent {self.name!r} is closed")
        return self._agent

    # -- memory and peers -----------------------------------------------------------------------------

    def register(self, tensor) -> Region:
        """Register a contiguous tensor (CPU or CUDA, any dtype) until close(); returns its Region."""
        agent = self._live()
        import torch

        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
        if not tensor.is_contiguous():
            raise ValueError("only a contiguous tensor can be registered")
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes == 0:
            raise ValueError("cannot register an empty tensor")
        if tensor.device.type == "cpu":
            mem, dev = "DRAM", 0
        elif tensor.device.type == "cuda":
            mem, dev = "VRAM", tensor.device.index if tensor.device.index is not None else 0
        else:
            raise ValueError(f"cannot register memory on device {tensor.device}")
        region = Region(tensor.data_ptr(), nbytes, dev, mem)
        if region in self._regions:
            return region
        reg = agent.register_memory([(region.addr, nbytes, dev, "")], mem)
        self._regions[region] = (tensor, reg)
        return region

    def metadata(self) -> bytes:
        """This agent's metadata (connection info and registrations) for a peer's connect()."""
        return bytes(self._live().get_agent_metadata())

    def connect(self, peer_metadata: bytes) -> str:
        """Load a peer's metadata; returns its agent name. Idempotent for the same metadata.
        MalformedMessage on metadata NIXL cannot load, this agent's own, or a name already connected
        with other metadata (forget() it first); LimitExceeded past 64 KiB."""
        agent = self._live()
        if not isinstance(peer_metadata, (bytes, bytearray, memoryview)):
            raise MalformedMessage(f"peer metadata: expected bytes, got {type(peer_metadata).__name__}")
        md = bytes(peer_metadata)
        if not md:
            raise MalformedMessage("peer metadata: empty")
        if len(md) > MAX_METADATA_BYTES:
            raise LimitExceeded(f"peer metadata: {len(md)} bytes > {MAX_METADATA_BYTES}")
        for name, known in self._peers.items():
            if known == md:
                return name
        try:
            raw = agent.add_remote_agent(md)
        except Exception as e:  # nixl's binding errors (NIXL_ERR_MISMATCH, _NOT_ALLOWED, _INVALID_PARAM)
            raise MalformedMessage(f"peer metadata refused by nixl: {type(e).__name__}: {e} (a garbled "
                                   "blob, this agent's own, or a name already connected with other "
                                   "metadata)") from None
        name = raw.decode("utf-8", "replace") if isinstance(raw, (bytes, bytearray)) else str(raw)
        self._peers[name] = md
        return name

    def forget(self, peer: str) -> None:
        """Remove a peer (no-op when unknown or after close()): its connection is dropped and handles
        made for it die."""
        agent = self._agent
        if agent is not None and self._peers.pop(peer, None) is not None:
            try:
                agent.remove_remote_agent(peer)
            except Exception:  # already gone on nixl's side: nothing left to remove
                pass

    # -- the transfer ----------------------------------------------------------------------------------

    def read(self, peer: str, remote: Region, local: Region, segments, timeout_s: float) -> int:
        """One NIXL READ of `segments` ((remote_offset, local_offset, nbytes) each) from `peer`'s
        `remote` region into this agent's registered `local` region; returns the bytes read.
        Every segment is checked against both regions before anything is issued (MalformedMessage,
        nothing written); adjacent segments are coalesced. The wait is bounded by `timeout_s` from the
        post: TransferTimeout after it, TransportClosed when NIXL reports an error or the peer is not
        connected. On either failure the handle is released, the peer forgotten (connect() it again
        from a fresh handshake) and the local ranges recorded as tainted (see the module docstring):
        the exception's `tainted` lists them as (offset, nbytes) in `local`."""
        agent = self._live()
        if not isinstance(remote, Region) or not isinstance(local, Region):
            raise TypeError("remote and local must be Regions")
        if local not in self._regions:
            raise ValueError("local region is not registered with this agent")
        if not isinstance(timeout_s, (int, float)) or not math.isfinite(timeout_s) or timeout_s <= 0:
            raise ValueError(f"timeout_s must be a positive finite number, got {timeout_s!r}")
        r_off, l_off, sizes = plan_segments(segments, remote, local)
        if len(sizes) == 0:
            return 0
        if peer not in self._peers:
            raise TransportClosed(f"nixl peer {peer!r} is not connected")
        total = int(sizes.sum())
        try:
            local_descs = agent.get_xfer_descs(_descs(local, l_off, sizes), local.mem)
            remote_descs = agent.get_xfer_descs(_descs(remote, r_off, sizes), remote.mem)
            handle = agent.initialize_xfer("READ", local_descs, remote_descs, peer)
        except Exception as e:  # NIXL_ERR_NOT_FOUND: descriptors outside what the peer registered
            raise MalformedMessage(f"nixl refused the READ from {peer!r}: {type(e).__name__}: {e}") from None
        try:
            deadline = time.monotonic() + timeout_s
            state = agent.transfer(handle)
            if state == "PROC":
                state = self._wait(agent, handle, deadline)
        except Exception as e:  # the binding raises on some error statuses (NIXL_ERR_REMOTE_DISCONNECT)
            state = f"ERR ({type(e).__name__}: {e})"
        self._release(agent, handle)
        if state == "DONE":
            return total
        ranges = tuple(zip(l_off.tolist(), sizes.tolist()))
        self._tainted.extend((local, o, n) for o, n in ranges)
        self.forget(peer)
        if state == "PROC":
            exc: Exception = TransferTimeout(f"nixl READ of {total} bytes from {peer!r} not done after "
                                             f"{timeout_s:g} s")
        else:
            exc = TransportClosed(f"nixl READ of {total} bytes from {peer!r} failed: {state}")
        exc.tainted = ranges
        # the raised error's traceback holds this frame: it must not keep nixl's agent alive past close()
        agent = handle = None  # noqa: F841
        raise exc

    @staticmethod
    def _wait(agent, handle, deadline: float) -> str:
        """Poll until the state is not "PROC" or the deadline passes: flat out for _SPIN_S, then with
        doubling sleeps (never past the deadline)."""
        spin_until = time.monotonic() + _SPIN_S
        delay = _SLEEP_FIRST_S
        while True:
            state = agent.check_xfer_state(handle)
            if state != "PROC":
                return state
            now = time.monotonic()
            if now >= deadline:
                return state
            if now >= spin_until:
                time.sleep(min(delay, deadline - now))
                delay = min(delay * 2, _SLEEP_MAX_S)

    def _release(self, agent, handle) -> None:
        try:
            agent.release_xfer_handle(handle)
        except Exception:  # NIXL_ERR_REPOST_ACTIVE: the backend kept it; retried at close()
            self._stuck.append(handle)

    # -- teardown --------------------------------------------------------------------------------------

    def close(self) -> None:
        """Release every handle, deregister every region, forget every peer and destroy the agent (its
        UCX worker, which purges outstanding requests). Idempotent."""
        agent, self._agent = self._agent, None
        if agent is None:
            return
        stuck, self._stuck = self._stuck, []
        while stuck:
            try:
                agent.release_xfer_handle(stuck.pop())
            except Exception:
                pass
        for peer in list(self._peers):
            try:
                agent.remove_remote_agent(peer)
            except Exception:
                pass
        self._peers.clear()
        regions, self._regions = self._regions, {}
        for _tensor, reg in regions.values():
            try:
                agent.deregister_memory(reg)
            except Exception:
                pass
        self._tainted.clear()
        del agent  # the last reference: nixl's agent and its UCX worker are destroyed here,
        regions.clear()  # and only then are the registered tensors let go

    def __enter__(self) -> NixlAgent:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
