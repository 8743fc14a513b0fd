"""A sender's view of the ZeroMQ handshake on its control socket: the CURVE client keys it
presents (`client_keys`, derived from the cluster secret: `protocol.curve.kv_keys`) and a socket
monitor that names a failed handshake (`HandshakeWatch`). A receiver that refuses this side's key,
or wants a key this side lacks, closes the connection inside libzmq's handshake; the DEALER would
then reconnect and retry silently until the caller's deadline, and the error would say only
"no reply". With the watch the wait ends at the first failed handshake, with its cause.
"""

from __future__ import annotations

import contextlib
import errno

import zmq
from zmq.utils.monitor import parse_monitor_message

from protocol.curve import connect_curve, kv_keys

FAILED = {
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "the receiver closed the connection during the ZeroMQ handshake",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "the ZeroMQ handshake failed",
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "the receiver refused this side's CURVE key",
}
HINT = "(are both ends keyed with the same cluster secret?)"


def client_keys(sock, secret: str) -> None:
    """Make `sock` a CURVE client of receivers keyed with `secret` (none: plain ZeroMQ); before connect."""
    if secret:
        connect_curve(sock, kv_keys(secret))


def describe(event: dict) -> str:
    """A handshake-failed monitor event's value in words (an errno, or libzmq's protocol code)."""
    value = event["value"]
    if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
        return errno.errorcode.get(value, f"errno {value}")
    if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
        return "mechanism mismatch: one end uses CURVE, the other does not"
    return f"code {value:#x}"


class HandshakeWatch:
    """The handshake failures of one socket, read without blocking."""

    def __init__(self, sock):
        self.sock = sock
        mask = 0
        for event in FAILED:
            mask |= event
        self.monitor = sock.get_monitor_socket(mask)

    def failure(self) -> str | None:
        """What the first failed handshake since the last call said, or None."""
        found = None
        while self.monitor.poll(0):
            try:
                event = parse_monitor_message(self.monitor.recv_multipart())
            except (zmq.ZMQError, ValueError):
                continue
            if found is None and event["event"] in FAILED:
                found = f"{FAILED[event['event']]} ({describe(event)}) {HINT}"
        return found

    def close(self) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self.sock.disable_monitor()
        self.monitor.close(0)
