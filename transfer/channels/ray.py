"""The Ray transport (`--transport ray`), both sides: the sender's channel (`ray_channel`: the
wire's messages batched into calls to the decode worker's actor) and the receiver endpoint
(`ray_receiver`: those calls served inside the decode loop's `poll`), and the registry's
factories, which take a `transfer.registry.RayOptions`.
"""

from __future__ import annotations

from transfer.channels.ray_channel import RayChannel, RayPipe, RaySender
from transfer.channels.ray_receiver import RayReceiverEndpoint
from transfer.registry import RayOptions
from transfer.session import SenderSession

__all__ = ["RayChannel", "RayPipe", "RayReceiverEndpoint", "RaySender", "make_receiver", "make_sender"]


def make_sender(fingerprint, config, options: RayOptions, *, receiver: str = "", faults=None,
                pool=None) -> SenderSession:
    """The registry's factory: a session to the decode worker actor named `receiver`, found in
    `options.namespace`."""
    import ray

    actor = ray.get_actor(receiver, namespace=options.namespace)
    return RaySender(fingerprint, actor, config, faults=faults, pool=pool)


def make_receiver(manager, config, options: RayOptions, *, admission) -> RayReceiverEndpoint:
    """The registry's factory (Ray needs no port: senders find the worker's actor by name)."""
    return RayReceiverEndpoint(manager, config, admission=admission)
