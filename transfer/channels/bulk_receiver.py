"""The receiving end of the bulk link (`bulk_wire`): a listening TCP socket (and a Unix
socket when the receiver also serves ipc://), one accept thread, and one reader thread per open
link. The owner's control thread (`ZmqReceiver`) keeps every reservation, commit and abort: on
a signed hello it `issue`s a token for that connection, on an admitted manifest it `expect`s the
transfer with its `ImportSession`, and it collects finished landings from `finished` (woken
through `wake_fd`). A reader thread only lands bytes into the session's reserved blocks with
`recv_into` and verifies each chunk's checksum right after it lands, so payload arrives while
the decode loop keeps stepping. `cancel` stops a landing's reader (its socket is shut down) and
waits for it before the owner frees the blocks. Every wait is bounded by the transport config.
A connection gets its reader thread only once its opening message carried a live token: until
then it waits in the accept thread's selector under its own cap and total deadline (`bulk_open`).
"""

from __future__ import annotations

import contextlib
import os
import queue
import secrets
import socket
import threading
import time

from transfer.channels.bulk_open import BUSY, OPENED, Opening, accept, expired, forget, turn_away
from transfer.channels.bulk_wire import (
    CHUNK,
    END,
    OPEN,
    OPEN_MAGIC,
    XFER,
    XFER_MAGIC,
    recv_exact,
    recv_into_hashed,
)
from transfer.checksum import hasher
from transfer.errors import FrameCountError, FrameSizeError, TransferError, TransferTimeout, TransportClosed
from transfer.metrics import TransferMetrics
from transfer.wakeup import Wakeup

# TCP payload is received (and hashed) this many bytes at a time: smaller reads stay in cache for
# the hash, and ran faster than whole 2 MiB chunks here; a Unix socket reads whole buffers, since
# partial reads of its large messages were several times slower
TCP_WINDOW = 256 << 10
MAX_LINKS = 256  # opened links (token checked) at once; more are refused
LISTEN_BACKLOG = 1024  # connections the kernel queues for accept (capped by net.core.somaxconn): a
# connection flood that fills a short queue makes a sender's connect wait for a SYN retransmit


class Landing:
    """One transfer's payload landing on a reader thread; `error` is None when it verified."""

    def __init__(self, key: bytes, token: int, session):
        self.key, self.token, self.session = key, token, session
        self.error: TransferError | None = None
        self.cancelled = False
        self.done = threading.Event()
        self.sock: socket.socket | None = None


class BulkListener:
    def __init__(self, host: str, config, metrics: TransferMetrics, refusals):
        self.config, self.metrics, self.refusals = config, metrics, refusals
        self.finished: queue.Queue[Landing] = queue.Queue()
        self.wake = Wakeup()  # set when a landing finished
        self._lock = threading.Condition()
        self._tokens: dict[bytes, bytes] = {}               # link token -> control connection
        self._expected: dict[tuple[bytes, int], Landing] = {}
        self._refused: dict[tuple[bytes, int], None] = {}    # transfers refused at their manifest
        self._open: set[socket.socket] = set()
        self._stop = False
        self.listeners: list[socket.socket] = []
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.port = self._listen(socket.socket(family, socket.SOCK_STREAM), (host, 0)).getsockname()[1]
        self.path = ""
        self._thread = threading.Thread(target=self._accept_loop, name="kv-bulk-accept", daemon=True)
        self._thread.start()

    def _listen(self, s: socket.socket, where) -> socket.socket:
        if s.family != socket.AF_UNIX:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(where)
        s.listen(LISTEN_BACKLOG)
        s.settimeout(0.2)  # the accept loop checks for close this often
        self.listeners.append(s)
        return s

    def listen_unix(self, path: str) -> None:
        """Also accept links on a Unix socket (for senders that reach us over ipc://)."""
        with contextlib.suppress(OSError):
            os.unlink(path)
        self._listen(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM), path)
        self.path = path

    # ---- the control thread -------------------------------------------------------------------
    def issue(self, key: bytes) -> str:
        """A fresh link token for control connection `key` (its previous one stops working)."""
        token = secrets.token_bytes(16)
        with self._lock:
            for t in [t for t, k in self._tokens.items() if k == key]:
                del self._tokens[t]
            if len(self._tokens) >= 4096:
                self._tokens.pop(next(iter(self._tokens)))
            self._tokens[token] = key
        return token.hex()

    def expect(self, key: bytes, token: int, session) -> Landing:
        landing = Landing(key, token, session)
        with self._lock:
            self._expected[(key, token)] = landing
            self._lock.notify_all()
        return landing

    def refuse(self, key: bytes, token: int) -> None:
        """The manifest of this transfer was refused: its link closes without waiting."""
        with self._lock:
            self._refused[(key, token)] = None
            if len(self._refused) > 1024:
                self._refused.pop(next(iter(self._refused)))
            self._lock.notify_all()

    def cancel(self, landing: Landing) -> None:
        """Stop the landing's reader (if it started) and wait for it; then its blocks may be freed."""
        with self._lock:
            landing.cancelled = True
            if self._expected.get((landing.key, landing.token)) is landing:
                del self._expected[(landing.key, landing.token)]
                landing.done.set()  # no reader took it
            sock = landing.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        if not landing.done.wait(self.config.idle_timeout_s + 5):
            raise RuntimeError("a link reader did not stop; its blocks cannot be freed safely")

    def close(self) -> None:
        with self._lock:
            self._stop = True
            self._lock.notify_all()
            socks = list(self._open)
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
        self._thread.join(5)
        for s in self.listeners:
            s.close()
        if self.path:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
        self.wake.close()

    # ---- accept and read threads -----------------------------------------------------------------
    def _accept_loop(self) -> None:
        import selectors

        sel = selectors.DefaultSelector()
        known: set[socket.socket] = set()
        openings: dict[socket.socket, Opening] = {}
        try:
            while not self._stop:
                for s in self.listeners:
                    if s not in known:
                        sel.register(s, selectors.EVENT_READ)
                        known.add(s)
                wait = min([0.2] + [op.deadline - time.monotonic() for op in openings.values()])
                for key, _ in sel.select(max(0.0, wait)):
                    if key.fileobj in known:  # read at once: a sender's opening is usually there already
                        op = accept(key.fileobj, sel, openings, self.config.stream_open_s, self.refusals)
                    else:
                        op = openings.get(key.fileobj)  # None: cut for room earlier in this round
                    if op is not None:
                        self._read_opening(sel, openings, op)
                for op in expired(openings):
                    forget(sel, openings, op)
                    self._drop(op.conn, f"no opening in {self.config.stream_open_s}s")
        finally:
            for conn in openings:
                turn_away(conn)
            sel.close()

    def _read_opening(self, sel, openings: dict, op: Opening) -> None:
        """Read what arrived of `op`'s opening; once it is whole (or the peer left), it is served."""
        done = op.read()
        if done is False:
            return
        forget(sel, openings, op)
        if done:
            self._opened(op.conn, bytes(op.buf))
        else:
            self._drop(op.conn, "closed before its opening message")

    def _drop(self, conn: socket.socket, why: str) -> None:
        self.refusals.refuse("stream_open", why)  # the refusal reason (a metric label) keeps its name
        turn_away(conn)

    def _opened(self, conn: socket.socket, hello: bytes) -> None:
        """The opening message is in: a live token gets the link a reader thread and a slot."""
        magic, token = OPEN.unpack(hello)
        with self._lock:
            key = self._tokens.get(token) if magic == OPEN_MAGIC else None
            full = key is not None and (len(self._open) >= MAX_LINKS or self._stop)
            if key is not None and not full:
                self._open.add(conn)
        if key is None:
            self.metrics.add("stream_token_refused")
            self.refusals.refuse("stream_token", "a bulk link opened with an unknown token")
            return turn_away(conn)
        if full:
            self.metrics.add("streams_refused")
            return turn_away(conn, BUSY)
        try:
            conn.setblocking(True)
            if conn.family != socket.AF_UNIX:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.sendall(OPENED)  # one byte into an empty send buffer: never blocks
        except OSError:
            with self._lock:
                self._open.discard(conn)
            return turn_away(conn)
        threading.Thread(target=self._serve, args=(conn, key), name="kv-bulk-read", daemon=True).start()

    def _serve(self, conn: socket.socket, key: bytes) -> None:
        try:
            conn.settimeout(None)  # idle between transfers; close() shuts the socket down
            while self._read_transfer(conn, key):
                pass
        except OSError:
            pass
        finally:
            with self._lock:
                self._open.discard(conn)
            conn.close()

    def _read_transfer(self, conn: socket.socket, key: bytes) -> bool:
        """Land one transfer; False when the link must close."""
        header = recv_exact(conn, XFER.size)
        if header is None:
            return False
        magic, token, nbytes = XFER.unpack(header)
        if magic != XFER_MAGIC:
            self.metrics.add("stream_garbled")
            return False
        landing = self._claim(key, token, conn)
        if landing is None:  # refused, aborted, or never offered: the bytes have nowhere to go
            self.metrics.add("stray_streams")
            return False
        ok = False
        try:
            if nbytes != landing.session.manifest.payload_bytes:
                raise FrameSizeError(f"link of {nbytes} bytes for an offer of "
                                     f"{landing.session.manifest.payload_bytes}")
            conn.settimeout(self.config.idle_timeout_s)
            self._land(conn, landing)
            ok = True
        except TransferError as e:
            landing.error = e
        except TimeoutError:
            landing.error = TransferTimeout(f"link silent for {self.config.idle_timeout_s}s mid-transfer")
        except OSError as e:
            landing.error = TransportClosed(f"link broke mid-transfer: {type(e).__name__}")
        finally:
            with self._lock:
                landing.sock = None
                cancelled = landing.cancelled
            landing.done.set()
        if not cancelled:
            self.finished.put(landing)
            self.wake.set()
        conn.settimeout(None)
        return ok and not cancelled

    def _claim(self, key: bytes, token: int, conn: socket.socket) -> Landing | None:
        """The landing the control thread expects for this transfer (it may still be on its way)."""
        deadline = time.monotonic() + self.config.idle_timeout_s
        with self._lock:
            while (key, token) not in self._expected and not self._stop:
                left = deadline - time.monotonic()
                if left <= 0 or self._refused.pop((key, token), 0) is None:
                    return None
                self._lock.wait(left)
            landing = self._expected.pop((key, token), None)
            if landing is not None:
                landing.sock = conn
            return landing

    def _land(self, conn: socket.socket, landing: Landing) -> None:
        s, land, verify = landing.session, 0.0, 0.0
        window = TCP_WINDOW if conn.family != socket.AF_UNIX else 0
        while not landing.cancelled:
            t0 = time.perf_counter()
            head = recv_exact(conn, CHUNK.size)
            if head is None:
                raise TransportClosed("link ended mid-transfer")
            f, c, cs = CHUNK.unpack(head)
            nxt = s.next_chunk()
            if f == END or nxt is None:
                if f != END or nxt is not None:
                    want = nxt[:2] if nxt else "the end"
                    raise FrameCountError(f"chunk ({f}, {c}) arrived, expected {want}")
                break
            bufs = s.chunk_buffers(f, c)  # FrameCountError unless (f, c) comes next
            h = hasher()
            if not recv_into_hashed(conn, bufs, h, window):  # hashed as it lands
                raise TransportClosed("link ended mid-transfer")
            t1 = time.perf_counter()
            s.chunk_done(f, c, nxt[2], bufs, cs, landed_checksum=h.intdigest())
            land, verify = land + t1 - t0, verify + time.perf_counter() - t1
        s.timings["land_ms"], s.timings["verify_ms"] = land * 1e3, verify * 1e3
