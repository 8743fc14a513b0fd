"""The frozen config every KV endpoint reads its addresses, sizes and timeouts from
(`TransportConfig`), and the handshake's signing and checking shared by every channel
(`make_hello`, `authenticate_hello`, `sign_reply`, `check_reply`). The protocol itself is
`transfer.session` (sending) and each receiver; the contracts are in `transfer.channel`.
Every wait is bounded by a timeout from `TransportConfig`.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
import uuid
from dataclasses import dataclass, field

from protocol.curve import hmac_sign, hmac_verify, new_nonce, tag_matches
from transfer.errors import Unauthenticated
from transfer.schema import Limits


@dataclass(frozen=True)
class TransportConfig:
    """Addresses, sizes and timeouts of one migration endpoint.

    address: where the receiver binds and senders connect: "tcp://HOST:PORT" (port 0 picks a
      free port; the receiver reports the bound address) or "ipc:///path/to/socket".
    chunk_bytes: payload chunk size on the wire (the unit of zero-copy sends and checksums).
    checksum_mode: "inline" (hash each chunk while streaming) or "manifest" (hash before sending).
    io_threads: ZeroMQ I/O threads per endpoint.
    rcvhwm: chunks the receiver's socket queues before TCP backpressure applies.
    socket_buffer_bytes: kernel send/receive buffer of each socket (0: the OS default, autotuned;
      the kernel caps it at net.core.wmem_max / rmem_max).
    connect_timeout_s: handshake and dedupe query wait.
    transfer_timeout_s: the sender's wait from the first byte to the ack.
    idle_timeout_s: the receiver's longest silence inside one transfer before abandoning it.
    max_transfer_s: the receiver's longest whole transfer (a sender trickling one chunk just
      inside the idle timeout cannot hold a reservation forever).
    lease_s: how long a sender keeps exported blocks referenced without an ack.
    peer_name: this endpoint's name in handshakes. A receiver with a secret refuses a hello
      addressed (`Hello.to`, inside the MAC) to any other name.
    receiver: a sender's: the peer_name of the receiver it means to reach; signed into its hello
      and checked against the (signed) reply, so a hello captured on the way to one receiver is
      refused by every other one.
    preauth_s: how long a ZeroMQ connection may go without completing its handshake before the
      receiver closes it, and forgets what it knew of it.
    stream_open_s: the total deadline for a bulk link's opening message (bulk_receiver).
    limits: bounds on what a peer may claim.
    secret: the cluster secret (protocol.curve): senders sign their handshake with it and
      receivers refuse an unsigned, stale, replayed or wrongly signed one ('': no keyed handshake).
    data_plane: how ZeroMQ transfers carry payload bytes: "stream" (a raw TCP or Unix socket
      beside the ZeroMQ control channel, landed with recv_into on a reader thread: bulk_wire)
      or "zmq" (payload chunks as ZeroMQ messages on the control socket).
    inline_bytes: payloads up to this size make one round trip: `migrate` skips the dedupe
      query (the receiver's cache keeps its first copy of a prefix canonical, so a duplicate
      only costs its bytes), and a ZeroMQ sender puts the chunks on the control socket right
      behind the manifest instead of on the bulk link, saving the reader thread's hand-off
      (0: every payload queries and streams; the default is measured with `pdserve bench migrate
      --inline-kib`, see the README).
    copy_threads: threads that hash a payload's chunks at export ("manifest" mode) and that copy
      and hash a payload read from a same-node sender's pool (`transfer.pull`); 1 keeps both on
      the calling thread (2 measured faster on a 2-core machine: `python -m bench.shm_copy`).
    """

    address: str = "tcp://127.0.0.1:0"
    chunk_bytes: int = 2 << 20
    checksum_mode: str = "inline"
    io_threads: int = 1
    rcvhwm: int = 8
    socket_buffer_bytes: int = 4 << 20
    connect_timeout_s: float = 10.0
    transfer_timeout_s: float = 60.0
    idle_timeout_s: float = 10.0
    max_transfer_s: float = 300.0
    lease_s: float = 60.0
    peer_name: str = ""
    receiver: str = ""
    preauth_s: float = 10.0
    stream_open_s: float = 1.0
    limits: Limits = field(default_factory=Limits)
    secret: str = ""
    data_plane: str = "stream"
    inline_bytes: int = 256 << 10
    copy_threads: int = 2

    def __post_init__(self) -> None:
        if self.data_plane not in ("stream", "zmq"):
            raise ValueError(f"data_plane must be 'stream' or 'zmq', got {self.data_plane!r}")
        if self.inline_bytes < 0:
            raise ValueError(f"inline_bytes must be >= 0, got {self.inline_bytes}")
        if self.copy_threads < 1:
            raise ValueError(f"copy_threads must be >= 1, got {self.copy_threads}")


def make_hello(fingerprint: dict, config: TransportConfig, stream: str = "", pool_path: str = ""):
    """This sender's handshake, signed when the config carries the cluster secret."""
    from transfer.wire_messages import Hello

    hello = Hello(dict(fingerprint), config.peer_name, stream=stream, pool_path=pool_path, to=config.receiver)
    if not config.secret:
        return hello
    issued_at, nonce = time.time(), new_nonce()
    return dataclasses.replace(hello, issued_at=issued_at, nonce=nonce,
                               tag=hmac_sign(config.secret, hello.signed_fields(), issued_at, nonce))


def authenticate_hello(body, nbytes: int, config: TransportConfig, seen: dict):
    """The Hello in `body` once it is small enough, decodes and is genuine: when a secret is
    configured, addressed to this receiver (`config.peer_name`), fresh, never seen, and signed with
    the secret; otherwise a TransferError refusal is raised. Convention 15: before authentication
    every exception is a refusal, and a body over the hello limit is refused unread."""
    from transfer.admission import refused
    from transfer.refusals import as_refusal, too_big
    from transfer.wire_codec import decode
    from transfer.wire_messages import Hello

    try:
        err = too_big(nbytes, "hello")
        if err is not None:
            raise err  # NOTE: refused unread
        hello = decode(body, config.limits, Hello)
        # NOTE: the address is checked before the nonce is remembered; refused before anything about
        # this receiver is revealed
        if config.secret and (hello.to != config.peer_name or not hmac_verify(
                config.secret, hello.signed_fields(), hello.issued_at, hello.nonce, hello.tag, seen)):
            raise refused()
        return hello
    except Exception as e:  # noqa: BLE001 - convention 15: before authentication, a refusal
        raise as_refusal(e) from None


def sign_reply(reply, hello, config: TransportConfig):
    """The receiver's reply, signed and bound to the hello it answers (its nonce and timestamp)."""
    if not config.secret:
        return reply
    return dataclasses.replace(reply, tag=hmac_sign(config.secret, reply.signed_fields(), hello.issued_at,
                                                    hello.nonce))


def check_reply(reply, hello, config: TransportConfig) -> None:
    """A sender's check of the receiver's reply to `hello` (its own): signed with the secret for
    this very hello, and from the receiver it meant to reach. Unauthenticated otherwise."""
    if config.receiver and reply.peer != config.receiver:
        raise Unauthenticated(f"handshake answered by {reply.peer[:64]!r}, not {config.receiver!r}")
    if config.secret and not tag_matches(config.secret, reply.signed_fields(), hello.issued_at, hello.nonce,
                                         reply.tag):
        raise Unauthenticated("handshake reply is not signed with the cluster secret for this hello")


def ipc_address(name: str | None = None, directory: str | None = None) -> str:
    """A fresh ipc:// endpoint path (socket paths must stay short: under ~100 characters)."""
    directory = directory or tempfile.gettempdir()
    return "ipc://" + os.path.join(directory, f"pdserve-kv-{name or uuid.uuid4().hex[:12]}.sock")


# the receiver's phases of one import, from its ack (milliseconds): validate + reserve, bytes landing
# in the blocks (bulk link), checksums of landed chunks, adopting the blocks
RECEIVER_PHASES = ("prepare_ms", "land_ms", "verify_ms", "commit_ms")
