"""The endpoints of `pdserve bench migrate` (measure.migrate): its rows (`VARIANTS`: a registered
transport configured one way) and `Receivers`, the receiving side of one (layout, pool size): a
ZeroMQ receiver in the spawned peer process (`measure.migrate_peer`) for every row whose receiver is
not a Ray actor, one `measure.ray_receiver.PoolReceiver` actor for the others, and per point a sender
made through the registry (`Receivers.use`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from transfer.transport import TransportConfig, ipc_address


# zmq-tcp / zmq-ipc: ZeroMQ control + the bulk link (the default data plane);
# zmq-frames: the same tcp endpoint with payload chunks as ZeroMQ messages (data_plane="zmq");
# zmq-shm: ZeroMQ control, the payload read by the receiver from the sender's /dev/shm pool
#   (same node, transfer.pull); nixl: ZeroMQ control, the payload read by the receiver's NIXL agent
#   from the sender's registered pool (transfer.channels.nixl; skipped without nixl);
# ray: actor calls, the payload read from the sender's /dev/shm pool (same node, transfer.pull);
# ray-store: the same actor, the payload through the object store (what another node gets).
@dataclass(frozen=True)
class Variant:
    """One row of the benchmark: a registered transport, configured one way."""

    transport: str              # its name in transfer.registry
    actor: bool = False         # its receiver runs in a Ray actor (else in the peer process, ZeroMQ)
    data_plane: str = "stream"  # TransportConfig.data_plane of a peer-process receiver's sender
    address: int = 0            # which of the peer's addresses: 0 tcp, 1 ipc
    pulled: bool = False        # its sender offers the point's pool, which the receiver reads (transfer.pull)


VARIANTS = {"zmq-tcp": Variant("zmq"), "zmq-ipc": Variant("zmq", address=1),
            "zmq-frames": Variant("zmq", data_plane="zmq"), "zmq-shm": Variant("zmq", pulled=True),
            "nixl": Variant("nixl", pulled=True), "ray": Variant("ray", actor=True, pulled=True),
            "ray-store": Variant("ray", actor=True)}
TRANSPORTS = tuple(VARIANTS)


def _actors(transports) -> list[str]:
    return [t for t in transports if VARIANTS[t].actor]


class Receivers:
    """Receiver endpoints for one (layout, pool size): the peer process and/or a Ray actor."""

    def __init__(self, peer, layout_args: tuple, num_blocks: int, transports, chunk_bytes: int,
                 ray_store_bytes: int = 0, inline_bytes: int | None = None, device: str = "cpu",
                 secret: str = ""):
        self.peer, self.senders, self.actor, self.addrs = peer, {}, None, []
        self.chunk_bytes, self.inline_bytes, self.secret = chunk_bytes, inline_bytes, secret
        if peer is not None and len(_actors(transports)) < len(transports):
            self.addrs = peer.call(cmd="setup", layout=list(layout_args), num_blocks=num_blocks,
                                   device=device, address="tcp://127.0.0.1:0", secret=secret,
                                   more_addresses=[ipc_address()])["addresses"]
        if _actors(transports):
            import ray

            from measure.ray_receiver import PoolReceiver

            self.actor = ray.remote(num_cpus=0.5)(PoolReceiver).remote(layout_args, num_blocks, prefault=True)
            _warm_object_store(self.actor, ray_store_bytes)

    def use(self, transport: str, src) -> None:
        """This point's sender for `transport`, through the registry: a pulled one offers this
        point's pool (its receiver reads the payload there), the others push."""
        from transfer.registry import get as get_transport

        v, kind = VARIANTS[transport], get_transport(VARIANTS[transport].transport)
        if transport in self.senders:
            self.senders.pop(transport).close()
        more = {} if self.inline_bytes is None else {"inline_bytes": self.inline_bytes}
        if v.pulled:
            more["inline_bytes"] = 0  # every payload a transfer of its own, read from the pool
        address = "" if v.actor else self.addrs[v.address]
        mode = "manifest" if v.pulled else kind.checksum_mode  # a pulled payload is checked against it
        cfg = TransportConfig(address=address or TransportConfig.address, chunk_bytes=self.chunk_bytes,
                              data_plane=v.data_plane, checksum_mode=mode,
                              secret="" if v.actor else self.secret, **more)  # the actor is unkeyed
        pool = src.storage if v.pulled else None
        fp = src.storage.layout.fingerprint()
        s = self.senders[transport] = (_actor_sender(fp, self.actor, cfg, pool) if v.actor
                                       else kind.make_sender(fp, cfg, pool=pool))
        s.connect(timeout=120)
        if v.pulled:
            s.channel.offer_pool()
        assert s.channel.pull == v.pulled, "the receiver declined the pool"

    def finish(self, transport: str, request_id: str) -> tuple[int | None, dict]:
        """Digest of the imported sequence on the receiver (then freed there)."""
        if VARIANTS[transport].actor:
            import ray

            digest = ray.get(self.actor.digest.remote(request_id), timeout=120)
            ray.get(self.actor.free.remote(request_id), timeout=120)
            return digest, {}
        r = self.peer.call(cmd="result", request_id=request_id)
        return (r["digest"] if r.get("ok") else None), r.get("timings", {})

    def close(self) -> None:
        for s in self.senders.values():
            s.close()
        if self.actor is not None:
            import ray

            ray.kill(self.actor)


def _actor_sender(fingerprint, actor, config, pool):
    """A sender to the benchmark's own receiving actor (the registry's factory finds a decode
    worker's actor by name; this one has a handle)."""
    from transfer.channels.ray_channel import RaySender

    return RaySender(fingerprint, actor, config, pool=pool)


def _warm_object_store(actor, store_bytes: int, piece: int = 64 << 20) -> None:
    """Pass most of the object store through the receiving actor so both processes have mapped
    every page of it, as they have in a long-running deployment (first-touch page faults
    otherwise dominate the first transfers, at a fraction of the steady-state speed)."""
    import ray

    arr = np.ones(piece, dtype=np.uint8)
    for _ in range(2):  # hold pieces covering most of the store at once, so all of it is touched
        refs = [ray.put(arr) for _ in range(max(1, int(0.9 * store_bytes) // piece))]
        ray.get(actor.touch.remote(*refs), timeout=300)
        del refs
