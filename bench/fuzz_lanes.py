"""The sender side of `pdserve bench fuzz`: a `Lane` is one DEALER connection to the receiver
(with its handshake and, when it asked for one, its TCP bulk links); `reply_code` names a
reply, `Hang` is raised when a reply does not come within `hang_s`, and the helpers find the
transfers a case's messages may open and play a case's stream operations.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time

import msgpack

from transfer.channels.zmq_handshake import client_keys
from transfer.wire import TOKEN


def reply_code(body: bytes) -> str:
    try:
        d = msgpack.unpackb(body, raw=False)
    except Exception:  # noqa: BLE001
        return "unparsable_reply"
    kind = d.get("kind") if isinstance(d, dict) else None
    if kind == "nack":
        return str(d.get("code"))
    return {"ack": "accepted", "held": "held", "hello_ok": "hello_ok"}.get(kind, f"reply:{kind}")


class Hang(Exception):
    pass


class Lane:
    """A DEALER connection to the receiver (and, when it asked for one, its bulk link)."""

    def __init__(self, zctx, address: str, fingerprint: dict, stream: bool = True, hello="ok", hang_s=10.0,
                 secret: str = "", receiver: str = ""):
        import zmq

        self.zmq, self.hang_s, self.fingerprint, self.want_stream = zmq, hang_s, fingerprint, stream
        self.secret, self.receiver, self.last_hello = secret, receiver, b""
        self.sock = zctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        client_keys(self.sock, secret)  # a keyed receiver admits only the cluster's CURVE key
        self.sock.connect(address)
        self.host = "127.0.0.1"
        self.port, self.stream_token, self.streams = 0, b"", []
        self.token, self.owner = 0, {}

    def hello_body(self) -> bytes:
        """A fresh hello, signed for the receiver when the run has a secret (a new nonce each time)."""
        from transfer.transport import TransportConfig, make_hello
        from transfer.wire_codec import encode

        config = TransportConfig(peer_name="fuzz", secret=self.secret, receiver=self.receiver)
        self.last_hello = encode(make_hello(self.fingerprint, config, "tcp" if self.want_stream else ""))
        return self.last_hello

    def hello(self) -> str:
        self.sock.send_multipart([b"H", self.hello_body()])
        header, body = self.recv(lambda h: h == b"h")[-1]
        self.note_hello(body)
        return reply_code(body)

    def note_hello(self, body: bytes) -> None:
        with contextlib.suppress(Exception):
            d = msgpack.unpackb(body, raw=False)
            if d.get("kind") == "hello_ok" and d.get("data_token"):
                self.port, self.stream_token = d["data_port"], bytes.fromhex(d["data_token"])

    def recv(self, until, deadline: float | None = None) -> list:
        """Replies up to and including the first whose header satisfies `until`."""
        deadline = deadline or time.monotonic() + self.hang_s
        out = []
        while True:
            left = deadline - time.monotonic()  # past the deadline: only what already arrived
            if not self.sock.poll(max(0, int(left * 1000))):
                raise Hang(f"no reply within {self.hang_s}s")
            parts = self.sock.recv_multipart()
            header, body = parts[0], parts[-1]
            out.append((header, body))
            if until(header):
                return out

    def open_stream(self, mode: str):
        from transfer.channels.bulk_wire import OPEN, OPEN_MAGIC

        s = socket.create_connection((self.host, self.port), timeout=self.hang_s)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.streams.append(s)
        if mode == "ok":
            s.sendall(OPEN.pack(OPEN_MAGIC, self.stream_token))
            if s.recv(1) != b"K":
                raise Hang("the bulk link did not open")
        elif mode == "token":
            s.sendall(OPEN.pack(OPEN_MAGIC, os.urandom(16)))
        elif mode == "magic":
            s.sendall(OPEN.pack(b"PDKVOPEM", self.stream_token))
        elif mode == "short":
            s.sendall(OPEN.pack(OPEN_MAGIC, self.stream_token)[:11])
        return s

    def close_streams(self):
        for s in self.streams:
            with contextlib.suppress(OSError):
                s.close()
        self.streams = []

    def close(self, linger: int = 0):
        self.close_streams()
        self.sock.close(linger)


def _tokens_opened(msgs) -> list[int]:
    """Tokens of the well-formed manifest headers among `msgs` (transfers the receiver may open)."""
    out = []
    for m in msgs:
        h = m[0]
        if len(m) == 2 and len(h) == TOKEN.size and h[:1] in (b"M", b"S"):
            t = TOKEN.unpack(h)[1]
            if t not in out:
                out.append(t)
    return out


def _run_stream_ops(lane: Lane, ops) -> None:
    s = lane.streams[-1] if lane.streams else None
    for op in ops or ():
        try:
            if op[0] == "open":
                s = lane.open_stream(op[1])
            elif op[0] == "bytes" and s is not None:
                s.sendall(op[1])
            elif op[0] == "zmq":
                lane.sock.send_multipart(op[1])
            elif op[0] == "close" and s is not None:
                s.close()
        except OSError:  # the receiver closed its end first: its verdict comes on the control channel
            pass
