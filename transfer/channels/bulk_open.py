"""The bulk link's opening, before its token is checked (`bulk_receiver`): unauthenticated
connections wait in the accept thread's selector, never on a thread of their own, at most
`MAX_OPENING` at once (apart from the `MAX_LINKS` slots of opened links), and each has one
total deadline (`TransportConfig.stream_open_s`, about a second) for its whole opening message,
however slowly its bytes trickle in. A connection is read as soon as it is accepted: a sender
holding a token writes its whole 24-byte opening right after connecting, so it is usually
served without waiting at all. When every opening slot is taken, the oldest opening is cut to
make room for the new connection (issue 49: turning the new one away let a flood of half-finished
connections, re-opened as fast as they were cut, keep every genuine sender out; the one waiting
longest is the least likely to be a sender with its token). A connection cut for capacity is
told so with one byte (`BUSY`) before it is closed, so its sender does not blame its token.
"""

from __future__ import annotations

import contextlib
import socket
import time

from transfer.channels.bulk_wire import OPEN

MAX_OPENING = 64  # connections still sending their opening message
BUSY, OPENED = b"B", b"K"  # the receiver's one-byte answers to an opening


class Opening:
    """One accepted connection still reading its opening message (non-blocking)."""

    def __init__(self, conn: socket.socket, deadline: float):
        self.conn, self.deadline, self.buf = conn, deadline, bytearray()

    def read(self) -> bool | None:
        """Read what arrived: True once the whole message is in, None when the peer closed."""
        try:
            got = self.conn.recv(OPEN.size - len(self.buf))
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            return None
        if not got:
            return None
        self.buf += got
        return len(self.buf) == OPEN.size


def accept(listener: socket.socket, sel, openings: dict, open_s: float, refusals) -> Opening | None:
    """A new connection waits for its opening message in the selector (`openings`, oldest first),
    the oldest opening cut when all MAX_OPENING slots are taken. Returns it (None: accept failed)."""
    import selectors

    try:
        conn, _ = listener.accept()
    except OSError:
        return None
    if len(openings) >= MAX_OPENING:
        oldest = next(iter(openings.values()))
        forget(sel, openings, oldest)
        refusals.refuse("stream_busy", f"{len(openings) + 1} connections opening: the oldest was cut")
        turn_away(oldest.conn, BUSY)
    conn.setblocking(False)
    op = openings[conn] = Opening(conn, time.monotonic() + open_s)
    sel.register(conn, selectors.EVENT_READ)
    return op


def forget(sel, openings: dict, op: Opening) -> None:
    """`op` leaves the selector and the openings (its connection is the caller's to close or keep)."""
    sel.unregister(op.conn)
    del openings[op.conn]


def turn_away(conn: socket.socket, answer: bytes = b"") -> None:
    """Close a connection without blocking, after one byte of answer if given."""
    with contextlib.suppress(OSError):
        conn.setblocking(False)
        if answer:
            conn.send(answer)
    with contextlib.suppress(OSError):
        conn.close()


def expired(openings: dict) -> list[Opening]:
    now = time.monotonic()
    return [op for op in openings.values() if op.deadline <= now]
