"""Wire format of the bulk link that carries KV payload bytes beside the ZeroMQ control
channel (`zmq_channel`, `zmq_receiver`, `bulk_receiver`).

A sender that asked for a bulk link in its (signed) `Hello` gets a data port or Unix socket path and
a 16-byte token in the `HelloReply`. It opens one link socket and sends OPEN (magic + token);
the receiver maps the token back to that control connection or closes the socket. Then, per
transfer, after the manifest went over ZeroMQ: XFER (magic, the transfer's token from the
manifest header, payload byte count), then each of the manifest's chunks in wire order as CHUNK
(frame, chunk index, xxh3 of the chunk when the manifest's checksum mode is "inline", else 0)
followed by its bytes, and a last CHUNK (END, 0, 0), so a lost, repeated or reordered chunk is
told apart from a corrupted one. The sender hashes each chunk just before sending it (no pass
over the payload before the first byte leaves); the receiver lands each chunk with `recv_into`
straight into its reserved blocks and hashes it while it is still in cache. Anything unexpected
(a wrong token, a count other than the offer's, a transfer nobody expects) closes the link;
the control channel carries the verdict.
"""

from __future__ import annotations

import socket
import struct

OPEN = struct.Struct("<8s16s")    # b"PDKVOPEN", connection token
XFER = struct.Struct("<8sQQ")     # b"PDKVXFER", transfer token, payload bytes
CHUNK = struct.Struct("<IIQ")     # frame, chunk, checksum (then the chunk's bytes)
END = 0xFFFFFFFF                  # CHUNK frame of the end-of-transfer marker
OPEN_MAGIC, XFER_MAGIC = b"PDKVOPEN", b"PDKVXFER"
IOV_MAX = 512                     # buffers per sendmsg call


def recv_exact(sock: socket.socket, n: int) -> bytes | None:
    """Exactly n bytes, or None if the peer closed first."""
    buf = bytearray(n)
    return bytes(buf) if recv_into_all(sock, memoryview(buf)) else None


def recv_into_all(sock: socket.socket, view: memoryview) -> bool:
    """Fill `view` from the socket (the GIL is released while the kernel copies); False on EOF."""
    got, n = 0, view.nbytes
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            return False
        got += k
    return True


def recv_into_hashed(sock: socket.socket, bufs, h, window: int) -> bool:
    """Fill each of `bufs` in turn, `window` bytes at a time (0: each buffer at once), feeding
    each window to the hasher `h` right after it lands, while it is still in cache; False on EOF."""
    for b in bufs:
        view = memoryview(b).cast("B")
        step = window or view.nbytes
        for at in range(0, view.nbytes, step):
            win = view[at:at + step]
            if not recv_into_all(sock, win):
                return False
            h.update(win)
    return True


def send_views(sock: socket.socket, views) -> None:
    """Send buffers in order, coalescing small ones into one `sendmsg` call."""
    batch: list[memoryview] = []
    for v in views:
        batch.append(memoryview(v).cast("B"))
        if len(batch) >= IOV_MAX:
            _sendmsg_all(sock, batch)
            batch = []
    if batch:
        _sendmsg_all(sock, batch)


def _sendmsg_all(sock: socket.socket, views: list[memoryview]) -> None:
    while views:
        sent = sock.sendmsg(views)
        while views and sent >= views[0].nbytes:
            sent -= views[0].nbytes
            views = views[1:]
        if views and sent:
            views = [views[0][sent:]] + views[1:]
