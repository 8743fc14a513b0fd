"""A test-only KV transport, loaded by module path (`--transport memory_channel:MemoryChannel`,
`transfer.registry.get`): sender and receiver in one process, the protocol's messages handed
over in memory. It proves that a channel living outside `transfer/` plugs in through the
registry alone, by passing the channel conformance suite (test_channel_conformance.py).

It carries the Ray channel's call shape without Ray: a flush of the sender's queued messages is
one call, `deliver(conn, headers, bodies)` on the receiver endpoint (a
`transfer.channels.ray_receiver.RayReceiverEndpoint`, which serves it inside its owner's `poll`), and the
call's future returns the receiver's answers. Receivers are found by name in this process
(`_ENDPOINTS`); payload pieces are views of the sender's pool, leased until the ack.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time

from transfer.channels.ray_channel import RayChannel, RayPipe
from transfer.channels.ray_receiver import RayReceiverEndpoint
from transfer.errors import TransportClosed
from transfer.registry import Guarantees, Transport
from transfer.session import SenderSession

_ENDPOINTS: dict[str, MemoryReceiver] = {}  # receiver name -> its endpoint, in this process


class MemoryReceiver(RayReceiverEndpoint):
    """The receiving endpoint, reachable by name from senders in this process until closed."""

    @property
    def address(self) -> str:
        return f"memory://{self.config.peer_name}"

    def close(self) -> None:
        _ENDPOINTS.pop(self.config.peer_name, None)
        super().close()


class MemoryPipe(RayPipe):
    """RayPipe's message batching, each batch one `deliver` call whose future holds the answers
    (the ray_channel.RayPipe's call and wait, made in memory)."""

    def __init__(self, endpoint: MemoryReceiver, call_timeout_s: float):
        super().__init__(None, call_timeout_s)
        self.endpoint = endpoint

    def _call(self, headers: bytes, bodies: list) -> concurrent.futures.Future:
        return self.endpoint.deliver(self.conn, headers, tuple(bodies))

    def _answer(self, pending: concurrent.futures.Future, deadline: float) -> bytes | None:
        try:
            return pending.result(max(0.0, deadline - time.monotonic()))
        except concurrent.futures.TimeoutError:
            return None


class MemoryChannel(RayChannel):
    """The sending side: the Ray channel's message batches over a `MemoryPipe` to `endpoint`."""

    # one in-process call at a time: in order; a sender that timed out never reads the answer
    TRANSPORT = Transport("memory", "memory_channel:make_sender", "memory_channel:make_receiver",
                          checksum_mode="manifest",
                          guarantees=Guarantees(ordered_per_caller=True, reply_may_be_lost_after_running=True,
                                                restarts=False, one_sided_reads_are_events=False,
                                                issued_read_cancellable=True))

    def _open(self) -> None:
        self.sock = MemoryPipe(self.actor, self.config.transfer_timeout_s)


def make_sender(fingerprint, config, options, *, receiver: str = "", faults=None, pool=None):
    """A session to the receiver named `receiver` in this process (checksums in the manifest)."""
    endpoint = _ENDPOINTS.get(receiver)
    if endpoint is None:
        raise TransportClosed(f"no memory receiver {receiver!r} in this process")
    config = dataclasses.replace(config, checksum_mode="manifest", data_plane="zmq")
    return SenderSession(fingerprint, config, MemoryChannel(endpoint, config), faults=faults)


def make_receiver(manager, config, options, *, admission) -> MemoryReceiver:
    """A receiver endpoint senders in this process reach by its name (`config.peer_name`)."""
    if config.peer_name in _ENDPOINTS:
        raise ValueError(f"a memory receiver {config.peer_name!r} exists already")
    endpoint = _ENDPOINTS[config.peer_name] = MemoryReceiver(manager, config, admission=admission)
    return endpoint
