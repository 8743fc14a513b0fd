"""ZeroMQ transport (tcp:// and ipc://): the registry's factories (`transfer.registry`) for a
sender session over `zmq_channel` and a `zmq_receiver.ZmqReceiver`; wire format in
`transfer.wire`. A sending worker whose pool lives in /dev/shm offers it to a same-node
receiver (`transfer.pull`), which then reads payloads from it instead of the socket.
"""

from __future__ import annotations

import dataclasses

from transfer.pull import shm_advert
from transfer.zmq_channel import ZmqSender
from transfer.zmq_receiver import ZmqReceiver

__all__ = ["ZmqReceiver", "ZmqSender", "make_receiver", "make_sender"]


def make_sender(fingerprint, config, *, receiver: str = "", namespace: str = "", faults=None, pool=None):
    return ZmqSender(fingerprint, config, faults=faults, advert=shm_advert(pool))


def make_receiver(manager, config, *, admission, port_min: int = 0, port_max: int = 0) -> ZmqReceiver:
    """A ZeroMQ receiver on the first free port of [port_min, port_max] (any port when 0)."""
    import zmq

    if not port_min:
        return ZmqReceiver(manager, config, admission=admission)
    host = config.address.rsplit(":", 1)[0]
    for port in range(port_min, max(port_min, port_max) + 1):
        try:
            where = dataclasses.replace(config, address=f"{host}:{port}")
            return ZmqReceiver(manager, where, admission=admission)
        except zmq.ZMQError:  # taken: the next one
            continue
    raise RuntimeError(f"no free KV receiver port in {port_min}..{port_max}")
