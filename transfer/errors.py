"""Typed errors of KV migration: one class per failure kind, each with a short stable `code`.

The code names the failure on the wire (a receiver's nack carries it back to the sender, which
raises the same class again with `remote=True`) and in the metrics counters. Every error a
transfer can end in is a `TransferError`; anything else escaping the transfer code is a bug.
"""

from __future__ import annotations


class TransferError(Exception):
    """Base class. `code` is stable and short; `remote` is True when a peer reported it."""

    code = "transfer"

    def __init__(self, message: str = "", *, remote: bool = False):
        super().__init__(message)
        self.remote = remote


class MalformedMessage(TransferError):
    """Bytes that are not a valid message: garbage, wrong types, missing or unknown fields."""

    code = "malformed"


class LimitExceeded(MalformedMessage):
    """A count or length outside the configured bounds (checked before any allocation)."""

    code = "limits"


class ProtocolVersionError(TransferError):
    """The peer speaks a protocol version this side does not."""

    code = "version"


class FingerprintMismatch(TransferError):
    """The two pools' layouts (layers, heads, head dim, dtype, layout) cannot exchange KV."""

    code = "fingerprint"


class HandshakeRequired(TransferError):
    """A transfer arrived on a connection that has not completed the handshake."""

    code = "handshake"


class ChecksumError(TransferError):
    """A payload chunk's checksum differs from the one the sender computed."""

    code = "checksum"


class FrameSizeError(TransferError):
    """A payload frame or chunk is shorter (truncated) or longer than its descriptor says."""

    code = "frame_size"


class FrameCountError(TransferError):
    """More or fewer payload frames or chunks than the manifest describes, or out of order."""

    code = "frame_count"


class StaleEpoch(TransferError):
    """The transfer's epoch is not newer than one already committed for this request."""

    code = "stale_epoch"


class SequenceExists(TransferError):
    """The receiver already holds a live sequence under this id."""

    code = "sequence_exists"


class PoolFull(TransferError):
    """The receiver has too few free blocks right now; the sender may retry later."""

    code = "pool_full"


class DedupeMiss(TransferError):
    """A block the receiver said it held was evicted before the import; resend without dedupe."""

    code = "dedupe_miss"


class TransferTimeout(TransferError):
    """A bounded wait ran out: the peer vanished or stalled mid-transfer."""

    code = "timeout"


class NotAdmitted(TransferError):
    """The receiver expects no such transfer (no reservation names it, or not for this sender).
    Refused before anything is allocated; the nack says nothing of what the receiver holds."""

    code = "refused"


class Unauthenticated(TransferError):
    """A handshake reply not signed with the cluster secret for this hello, or from a receiver
    other than the one this sender meant to reach (protocol.curve, transfer.transport)."""

    code = "unauthenticated"


class TransportClosed(TransferError):
    """The transport was closed (locally) while an operation was in flight."""

    code = "closed"


ERROR_CLASSES: dict[str, type[TransferError]] = {
    cls.code: cls for cls in (
        TransferError, MalformedMessage, LimitExceeded, ProtocolVersionError, FingerprintMismatch,
        HandshakeRequired, ChecksumError, FrameSizeError, FrameCountError, StaleEpoch,
        SequenceExists, PoolFull, DedupeMiss, TransferTimeout, NotAdmitted, Unauthenticated,
        TransportClosed)
}


def error_from_code(code: str, message: str) -> TransferError:
    """Rebuild a peer-reported error as its class (unknown codes become a plain TransferError)."""
    cls = ERROR_CLASSES.get(code, TransferError)
    return cls(f"peer: {message}", remote=True)
