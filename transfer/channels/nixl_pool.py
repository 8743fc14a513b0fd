"""The data-plane primitive of the `--transport nixl` KV channel (`transfer.channels.nixl` says how
the channel uses it): a NIXL agent (NVIDIA's transfer library, UCX backend) with a KV pool
registered as one region (`nixl_segments.Region`), a peer agent loaded from its metadata, and
bounded one-sided READs of (remote offset -> local offset, nbytes) segments, checked against both
regions before anything is issued. The decode side pulls: it knows where the blocks go only once
it has reserved them, while the manifest already carries the sender's block offsets and the
sender's blocks stay leased until the ack anyway (vLLM's NixlConnector also has decode read from
prefill). Nothing here changes between CPU and CUDA: a region's memory type ("DRAM" or "VRAM")
and device come from the registered tensor, and UCX picks the path (shared memory or CMA between
local processes, cuda_ipc, RDMA, TCP).

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

from transfer.channels.nixl_api import INSTALL_HINT, NixlUnavailable, _new_agent, _nixl_api, available  # noqa: F401
from transfer.channels.nixl_segments import MAX_SEGMENTS, Region, _descs, plan_segments  # noqa: F401 (re-exported)
from transfer.errors import LimitExceeded, MalformedMessage, TransferTimeout, TransportClosed

MAX_METADATA_BYTES = 64 << 10

# The wait loop: poll flat out for this long, then sleep from _SLEEP_FIRST_S, doubling up to _SLEEP_MAX_S
# (time.sleep rounds up by the kernel's timer slack, about 50 us).
_SPIN_S = 100e-6
_SLEEP_FIRST_S = 10e-6
_SLEEP_MAX_S = 500e-6


class NixlAgent:
    """One NIXL agent with the UCX backend: registers pools, connects peers, READs from them.
    Use from one thread. `close()` (idempotent) releases every handle, deregisters, forgets every peer
    and destroys the agent; every other method raises TransportClosed afterwards."""

    def __init__(self, name: str, host: str = ""):
        """host: this side's peer's (or its own) address in the cluster: UCX listens only on the
        interface that reaches it (`nixl_api.ucx_net_devices`); "": on every interface."""
        if not isinstance(name, str) or not name:
            raise ValueError("agent name must be a non-empty str")
        api = _nixl_api()
        self.name = name
        self._agent = _new_agent(api, name, host)
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
