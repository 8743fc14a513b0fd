"""The ZeroMQ transport (`--transport zmq`), both sides: the sender's channel (`zmq_channel`: a
DEALER socket for the control messages, the bulk link of `bulk_sender` for payloads) and the
receiver endpoint (`zmq_receiver`: a ROUTER socket, the bulk link's `bulk_receiver` listener,
`zmq_peers` closing connections that never complete a handshake, `zmq_handshake` the CURVE keys),
and the registry's factories, which take a `transfer.registry.ZmqOptions`.
"""

from __future__ import annotations

import dataclasses

import zmq

from transfer.channels.zmq_channel import ZmqChannel, ZmqSender
from transfer.channels.zmq_receiver import ZmqReceiver
from transfer.pull import shm_advert
from transfer.registry import ZmqOptions
from transfer.session import SenderSession

__all__ = ["ZmqChannel", "ZmqReceiver", "ZmqSender", "make_receiver", "make_sender"]


def make_sender(fingerprint, config, options: ZmqOptions, *, receiver: str = "", faults=None,
                pool=None) -> SenderSession:
    """The registry's factory; a sending worker whose pool lives in /dev/shm offers it to a
    same-node receiver (`transfer.pull`), which then reads payloads from it instead of the socket."""
    return ZmqSender(fingerprint, config, faults=faults, advert=shm_advert(pool))


def make_receiver(manager, config, options: ZmqOptions, *, admission) -> ZmqReceiver:
    """The registry's factory: a receiver on the first free port of [kv_port_min, kv_port_max]
    (any port when 0)."""
    if not options.kv_port_min:
        return ZmqReceiver(manager, config, admission=admission)
    host = config.address.rsplit(":", 1)[0]
    for port in range(options.kv_port_min, max(options.kv_port_min, options.kv_port_max) + 1):
        try:
            where = dataclasses.replace(config, address=f"{host}:{port}")
            return ZmqReceiver(manager, where, admission=admission)
        except zmq.ZMQError:  # taken: the next one
            continue
    raise RuntimeError(f"no free KV receiver port in {options.kv_port_min}..{options.kv_port_max}")
