"""The NIXL channel (`--transport nixl`): ZeroMQ control, payload read one-sided with NIXL (UCX).

Everything in the control plane is the ZeroMQ transport's (`channels.zmq`): signed
hello, reservation, manifest, verify after landing, ack. What this file adds is a pool way for
`transfer.pull`: at its first transfer after the hello the sender offers its whole KV pool,
registered with a NIXL agent of its own (`NixlAdvert`: agent metadata plus the region); the
receiver loads that agent into one of its own, which has registered the receiver's pool
(`NixlSource`), and reads the
payload straight into the blocks it reserved, with one NIXL READ for all of it (buffers outside
its registered pool, e.g. a device pool's host staging slots, are read chunk by chunk through a
registered scratch buffer). Every chunk is verified on landing against the sender's checksums
(sent after the offsets, hashed while this side reads); the ack on the control channel is the
completion notice the sender waits for.

Decode pulls, prefill does not push: the receiver knows where the blocks go only once it has
reserved them, so a push would need one more round trip (the block addresses back to the
sender) before any byte moves; a pull needs none (the manifest's frames give the source
offsets), and the sender's blocks stay leased until the ack anyway. vLLM's NixlConnector has
decode read from prefill for the same reason.

Pools are registered as they are: host memory ("DRAM") or a CUDA pool ("VRAM"), so the same code
serves both. A READ that times out may still land bytes later (UCX cannot cancel it), so the
source closes its agent before the failed transfer's blocks are returned. A streamed migration
(offered while the prompt is computed) pushes its blocks over the ZeroMQ bulk link, as the zmq
transport does: a pull would need a notice per batch. `nixl` is optional: `pip install
'pdserve[nixl]'`; without it this transport's factories raise `NixlUnavailable` with that hint.
"""

from __future__ import annotations

import uuid

import msgpack
import numpy as np
import torch

from transfer.channel import ReceiverEndpoint
from transfer.channels.nixl_api import NixlUnavailable
from transfer.channels.nixl_pool import NixlAgent, Region
from transfer.errors import MalformedMessage, TransferError
from transfer.registry import NixlOptions
from transfer.session import SenderSession
from transfer.wire import cluster_host
from transfer.wire_messages import PoolOffer

READ_TIMEOUT_S = 30.0  # the longest one READ (a whole payload, at most) may take before the transfer fails


def _name(role: str) -> str:
    return f"pdserve-{role}-{uuid.uuid4().hex[:12]}"


def _pool_tensor(storage) -> torch.Tensor:
    """The whole pool as one contiguous tensor (block b at byte b * block_bytes)."""
    data = storage.data
    if not data.is_contiguous():
        raise ValueError("a NIXL pool must be one contiguous tensor")
    return data


class NixlAdvert:
    """Sender side: this worker's pool registered with its own agent (made at the first offer)."""

    way = "nixl"

    def __init__(self, storage, host: str = ""):
        """host: the receiver's, in the cluster: the agent listens only on the interface reaching it."""
        self.storage, self.host = storage, host
        self.agent, self.region = None, None  # made at the first offer

    def offer(self) -> PoolOffer:
        if self.agent is None:
            self.agent = NixlAgent(_name("sender"), self.host)
            self.region = self.agent.register(_pool_tensor(storage=self.storage))
        wire = {"meta": self.agent.metadata(), "region": self.region.to_wire()}
        blob = msgpack.packb(wire, use_bin_type=True)
        return PoolOffer(self.way, blob)

    def offsets(self, frames) -> list[int] | None:
        """Each frame's byte offset in the registered pool (host frames of a CPU pool), else None."""
        if self.region is None:
            return None
        out = []
        for f in frames:
            arr = np.frombuffer(f, dtype=np.uint8)
            start = arr.ctypes.data - self.region.addr
            if not arr.nbytes or start < 0 or start + arr.nbytes > self.region.nbytes:
                return None
            out.append(start)
        return out

    def close(self) -> None:
        if self.agent is not None:
            self.agent.close()


class NixlSource:
    """Receiver side: the sender's region, read by an agent of this connection's own that has
    registered this receiver's pool."""

    def __init__(self, blob: bytes, storage, host: str = ""):
        try:
            wire = msgpack.unpackb(blob, raw=False, strict_map_key=True, max_ext_len=0)
            if type(wire) is not dict or set(wire) != {"meta", "region"} or type(wire["meta"]) is not bytes:
                raise MalformedMessage("a NIXL pool offer is {meta: bytes, region: map}")
            self.remote = Region.from_wire(wire["region"])
        except (ValueError, TypeError) as e:  # msgpack's own errors
            raise MalformedMessage(f"a garbled NIXL pool offer: {type(e).__name__}") from None
        try:
            self.agent = NixlAgent(_name("receiver"), host)  # listening only where the cluster reaches it
        except NixlUnavailable as e:  # a receiver without nixl declines the offer: bytes are pushed
            raise MalformedMessage(str(e)) from None
        try:
            self.local = self.agent.register(_pool_tensor(storage))
            self.base = self.local.addr
            self.peer = self.agent.connect(wire["meta"])
        except BaseException:
            self.agent.close()
            raise
        self.scratch: torch.Tensor | None = None
        self.scratch_region: Region | None = None

    def _scratch(self, nbytes: int) -> tuple[torch.Tensor, Region]:
        if self.scratch is None or self.scratch.numel() < nbytes:
            self.scratch = torch.empty(nbytes, dtype=torch.uint8)
            self.scratch_region = self.agent.register(self.scratch)
        return self.scratch, self.scratch_region

    hashes = False  # the agent moves bytes only: transfer.pull hashes what landed

    def read_many(self, items, threads: int = 1) -> list[None]:
        """Read the sender's bytes at each (offset, buffers) pair into those buffers: the ones in
        this receiver's registered pool in one READ, the others through the scratch buffer in a
        second (bounds checked by the agent). The agent does not hash: None per item, so the
        caller hashes what landed (`transfer.pull`)."""
        direct, staged = [], []
        for offset, bufs in items:
            pos = offset
            for b in bufs:
                start = np.frombuffer(b, dtype=np.uint8).ctypes.data - self.base
                if 0 <= start and start + b.nbytes <= self.local.nbytes:
                    direct.append((pos, start, b.nbytes))
                else:
                    staged.append((pos, b))
                pos += b.nbytes
        try:
            if direct:
                self.agent.read(self.peer, self.remote, self.local, direct, READ_TIMEOUT_S)
            if staged:
                scratch, region = self._scratch(sum(b.nbytes for _, b in staged))
                segments, at = [], 0
                for src, b in staged:
                    segments.append((src, at, b.nbytes))
                    at += b.nbytes
                self.agent.read(self.peer, self.remote, region, segments, READ_TIMEOUT_S)
                view, at = memoryview(scratch.numpy()), 0
                for _, b in staged:
                    b[:] = view[at:at + b.nbytes]
                    at += b.nbytes
        except TransferError:
            self.close()  # NOTE: before the caller frees the blocks: a late byte must not land in them
            raise
        return [None] * len(items)

    def close(self) -> None:
        self.agent.close()


# ---- the registry's factories (transfer.registry) -------------------------------------------------------
def make_sender(fingerprint, config, options: NixlOptions, *, receiver: str = "", faults=None,
                pool=None) -> SenderSession:
    """A ZeroMQ sender session whose pool (`pool`, the worker's KVStorage) is offered over NIXL."""
    from transfer.channels.zmq import ZmqSender

    if pool is None:
        raise ValueError("the nixl transport needs the sending worker's pool")
    advert = NixlAdvert(pool, cluster_host(config.address))
    return ZmqSender(fingerprint, config, faults=faults, advert=advert)


def make_receiver(manager, config, options: NixlOptions, *, admission) -> ReceiverEndpoint:
    """A ZeroMQ receiver on ZeroMQ's ports (`options` are theirs); NIXL pool offers are read
    through `NixlSource` (the registry's "nixl" way)."""
    from transfer.channels.zmq import make_receiver as zmq_receiver

    # NixlUnavailable here, at start, rather than at the first offer
    NixlAgent(_name("probe"), cluster_host(config.address)).close()
    return zmq_receiver(manager, config, options, admission=admission)
