"""The KV transports by name: one entry per transport, all the rest of the code needs from it.

Workers, coordinator, CLI and bench look a transport up here (`get(name)`) instead of branching
on its name: its sender and receiver factories (endpoints meeting `transfer.channel`), the
engine pool options its sending side needs, what it can do (`Capabilities`), and its variants in
`pdserve bench migrate`. A new transport is its files plus one `register(...)` line below.

Torch-free at import (the coordinator validates names with it): the factories import their
transport when called.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Capabilities:
    """What a transport can do, read by the workers in place of its name."""

    # a same-node receiver copies the frames straight from the sender's pool (a /dev/shm file it maps)
    same_node_pool: bool = False
    # `SenderSession.migrate_streamed`: blocks leave while the prompt is still being computed
    streamed: bool = True


@dataclass(frozen=True)
class Transport:
    """One registered transport."""

    name: str
    # (fingerprint, TransportConfig, *, receiver, namespace, faults, pool) -> a transfer.session.SenderSession
    # for the decode worker named `receiver`
    make_sender: Callable
    # (manager, TransportConfig, *, admission, port_min, port_max) -> a transfer.channel.ReceiverEndpoint
    make_receiver: Callable
    # how its senders checksum payloads: "inline" (per chunk while streaming) or "manifest" (before sending)
    checksum_mode: str = "inline"
    # EngineConfig fields a sending worker's pool needs (Ray: a /dev/shm pool that same-node peers map)
    engine_options: dict = field(default_factory=dict)
    capabilities: Capabilities = Capabilities()
    bench_names: tuple[str, ...] = ()  # its variants in `pdserve bench migrate`


_TRANSPORTS: dict[str, Transport] = {}


def register(transport: Transport) -> Transport:
    if transport.name in _TRANSPORTS:
        raise ValueError(f"transport {transport.name!r} is registered already")
    _TRANSPORTS[transport.name] = transport
    return transport


def names() -> tuple[str, ...]:
    """Registered transport names, in registration order (the CLI's choices)."""
    return tuple(_TRANSPORTS)


def get(name: str) -> Transport:
    """The transport called `name`; ValueError naming the registered ones otherwise."""
    try:
        return _TRANSPORTS[name]
    except (KeyError, TypeError):
        raise ValueError(f"transport must be one of {', '.join(map(repr, names()))}, got {name!r}") from None


def validate(name: str) -> str:
    """`name` when it is registered (for config `__post_init__`s); ValueError otherwise."""
    get(name)
    return name


# ---- factories: each imports its transport when called -------------------------------------------------
def _zmq_sender(fingerprint, config, *, receiver: str = "", namespace: str = "", faults=None, pool=None):
    from transfer.zmq_channel import ZmqSender

    return ZmqSender(fingerprint, config, faults=faults)


def _zmq_receiver(manager, config, *, admission, port_min: int = 0, port_max: int = 0):
    """A ZeroMQ receiver on the first free port of [port_min, port_max] (any port when 0)."""
    import dataclasses

    import zmq

    from transfer.zmq_receiver import ZmqReceiver

    if not port_min:
        return ZmqReceiver(manager, config, admission=admission)
    host = config.address.rsplit(":", 1)[0]
    for port in range(port_min, max(port_min, port_max) + 1):
        try:
            return ZmqReceiver(manager, dataclasses.replace(config, address=f"{host}:{port}"),
                               admission=admission)
        except zmq.ZMQError:  # taken: the next one
            continue
    raise RuntimeError(f"no free KV receiver port in {port_min}..{port_max}")


def _ray_sender(fingerprint, config, *, receiver: str = "", namespace: str = "", faults=None, pool=None):
    import ray

    from transfer.ray_channel import RaySender

    actor = ray.get_actor(receiver, namespace=namespace)
    return RaySender(fingerprint, actor, config, faults=faults, pool=pool)


def _ray_receiver(manager, config, *, admission, port_min: int = 0, port_max: int = 0):
    from transfer.ray_transport import RayReceiverEndpoint

    return RayReceiverEndpoint(manager, config, admission=admission)


register(Transport("zmq", _zmq_sender, _zmq_receiver, bench_names=("zmq-tcp", "zmq-ipc", "zmq-frames")))
register(Transport("ray", _ray_sender, _ray_receiver, checksum_mode="manifest",
                   engine_options={"kv_shm": True},
                   capabilities=Capabilities(same_node_pool=True),
                   bench_names=("ray", "ray-store")))
