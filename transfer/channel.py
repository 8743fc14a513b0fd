"""What a KV transport implements, as `typing.Protocol`s (checked structurally; the transports do not
inherit from them). `transfer.registry` names each transport's factories.

The sending side of the protocol is written once (`transfer.session.SenderSession`), as sans-IO
steps that yield each channel operation (`transfer.session.Call`) for a driver to make: production's
`drive` makes it on a `SenderChannel` and blocks; the simulation (`dst.channel`) parks the steps
instead. A transport gives the session a `SenderChannel`, which only moves bytes: one control
request and its reply (the hello, the dedupe query), and transfers (`ChannelTransfer`: the manifest
bodies, then payload pieces, then the end, then the receiver's verdict). A receiver endpoint lives
inside the decode worker and is driven from its loop thread only: every channel's messages, socket
or Ray call, are served inside its `poll`, which returns each committed import
(`channels.zmq_receiver.ZmqReceiver`, `channels.ray_receiver.RayReceiverEndpoint`).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class ChannelTransfer(Protocol):
    """One transfer on a channel, opened by `SenderChannel.open` with its manifest bodies sent."""

    def send(self, items) -> bool:
        """Payload pieces ((frame, chunk, slot or None, xxh3), view); False once the transfer stopped
        (the receiver answered early, or the link broke): the session then asks for the verdict."""

    def end(self, final_body: bytes | None) -> None:
        """No more payload; a streamed transfer's closing message (the sealed `Final`) goes too."""

    def verdict(self, deadline: float) -> bytes:
        """The receiver's answer (Ack or Nack bytes); TransferTimeout at `deadline`."""

    def cancel(self) -> None:
        """The transfer failed on this side: make the receiver abort it (never raises)."""


@runtime_checkable
class SenderChannel(Protocol):
    """Prefill side of one connection; raises TransferError (TransferTimeout, TransportClosed)."""

    connected: bool  # a handshake went through on this connection (False again after a reset)

    def hello_fields(self) -> dict:
        """`Hello` fields this channel asks for (a bulk link, a same-node pool)."""

    def request(self, kind: str, body: bytes, deadline: float) -> bytes:
        """A control request ("hello" or "query") and its reply body."""

    def accepted(self, reply) -> None:
        """The receiver's (verified) `HelloReply`: take what it offers (a bulk link, a mapped pool)."""

    def pulls(self) -> bool:
        """Whether the receiver reads whole payloads from this side's pool (`transfer.pull`): the
        session then exports them with "inline" checksums, sent after the pool offsets."""

    def open(self, token: int, manifest, bodies: list[bytes], frames=None, *, streamed: bool = False,
             deadline: float = float("inf")) -> ChannelTransfer:
        """Start transfer `token`: `bodies` are its manifest messages (none, one or two: the chaos
        benchmark drops or duplicates them); `frames`, the export's host frames when the channel
        may send them whole; `streamed`: a final state follows (`ChannelTransfer.end`)."""

    def close(self) -> None: ...


@runtime_checkable
class ReceiverEndpoint(Protocol):
    """Decode side of one transport."""

    address: str  # where senders reach it (what the coordinator hands the prefill worker)

    def poll(self, timeout: float):
        """Serve the channel until an import commits (the ImportResult is returned), `timeout`
        passes or `wake()` is called (None); raises the typed TransferError of a failed import
        (already nacked, counted, released)."""

    def wake(self) -> None:
        """Any thread: end the owner's `poll` now (the decode loop has a command queued)."""

    def in_flight(self) -> dict[str, list[int]]:
        """Transfer id -> blocks reserved for an import not committed yet."""

    def abort_request(self, request_id: str) -> int:
        """End the transfers of `request_id` still landing (ids 'request_id/i'); how many."""

    def close(self) -> None:
        """Stop serving: transfers still landing are ended and their blocks returned."""
