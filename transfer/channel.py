"""What every KV transport's endpoints implement, as `typing.Protocol`s (checked structurally; the
transports do not inherit from them). `transfer.registry` names the factories that build them.

A sender lives on the prefill side, one per connection to a decode worker; a receiver endpoint
lives inside the decode worker and is driven from its loop thread only. Both transports' receivers
(`zmq_receiver.ZmqReceiver`, `ray_transport.RayReceiverEndpoint`) meet `ReceiverEndpoint`; how
their imports reach the loop differs, and the registry says which (`Capabilities.polled`).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class ReceiverEndpoint(Protocol):
    """Decode side of one transport."""

    address: str  # where senders reach it (what the coordinator hands the prefill worker)

    def poll(self, timeout: float):
        """The next committed import (an ImportResult), or None when `timeout` passes without one;
        raises the typed TransferError of a failed import (already nacked, counted, released).
        A receiver whose imports arrive as its worker's commands only does its housekeeping
        (expiring idle transfers) and returns None at once."""

    def in_flight(self) -> dict[str, list[int]]:
        """Transfer id -> blocks reserved for an import not committed yet."""

    def abort_request(self, request_id: str) -> int:
        """End the transfers of `request_id` still landing (ids 'request_id/i'); how many."""

    def close(self) -> None:
        """Stop serving: transfers still landing are ended and their blocks returned."""


@runtime_checkable
class Sender(Protocol):
    """Prefill side of one transport, one per connection (see `transfer.transport`)."""

    def connect(self, timeout: float | None = None): ...

    def query(self, request_id: str, token_ids, extra_key: str | None = None,
              timeout: float | None = None) -> list[int]: ...

    def migrate(self, manager, seq_id, request_id: str, epoch: int, state=None, **options): ...

    def migrate_streamed(self, manager, request_id: str, epoch: int, token_ids: list[int], sampling: dict,
                         **options): ...

    def close(self) -> None: ...
