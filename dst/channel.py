"""The simulated KV channel: both of its sides, over `dst.net.Network`.

Sending side: `SimChannel` is production's message channel (`transfer.channels.message_channel`:
the control requests, the pool offer, pushed transfers as "M"/"W", "D" chunks and "E"/"F", pulled
ones as "M", "P" offsets and "K" checksums, the cancel) on a `SimPipe` instead of a socket, so the
wire the simulation sends is the one production sends. Its one blocking wait returns a `Pending`
instead, and `Task` (the simulation's driver of the sender's step generators) parks the steps
until the reply arrives or the virtual deadline passes (then, as production's wait does, the
connection is reset and TransferTimeout thrown in). A streamed migration's next blocks are a
`Later`: the steps wait for the simulated prefill to compute them.

Receiving side: `SimReceiver` is the real `transfer.receiver.MessageReceiver`, its messages carried
by the network, its clock the virtual one. `SimSource` is the pool reader of `transfer.pull` for
the way "sim": it copies from the sending worker's pool in this process (its `SimAdvert`), and it
refuses an offer from an earlier incarnation of that worker (its pool may be gone).

Delivery guarantees modelled: the transport's declared ones (`dst.guarantees`, applied by
`dst.net.Network`); a one-sided pool read is a copy made when its offsets arrive, unless a
`late_read` fault makes it miss its bound (`SimSource`). What is not production's here: the
socket (`SimPipe`) and the wait; the ZeroMQ bulk link and Ray's call batching are not simulated.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from transfer.channels.message_channel import MessageChannel
from transfer.checksum import copy_hashed
from transfer.errors import MalformedMessage, TransferError, TransferTimeout, TransportClosed
from transfer.receiver import ListParts, MessageReceiver
from transfer.session import Call
from transfer.wire_messages import PoolOffer


@dataclass
class Pending:
    """A wait for a reply under one of `headers` until `deadline`, on `channel`; `then(body)` makes
    the result."""

    headers: tuple[bytes, ...]
    deadline: float
    then: object = None
    channel: SimChannel | None = None


@dataclass
class Later:
    """A result not there yet and not a reply (a streamed migration's next blocks, still being
    computed): `park(task)` arranges for `task` to be resumed with it."""

    park: object


class Task:
    """Drives one step generator (`transfer.session`'s) on the simulated network: each `Call` is made
    on the sim channel; a `Pending` parks the steps until the channel resumes them. done(value,
    error) is called once with what the steps returned or raised."""

    def __init__(self, steps, done):
        self.steps, self.done, self.finished = steps, done, False

    def start(self) -> None:
        self.resume(None, None)

    def resume(self, result, error) -> None:
        while not self.finished:
            try:
                call = self.steps.send(result) if error is None else self.steps.throw(error)
            except StopIteration as stop:
                self._finish(stop.value, None)
                return
            except Exception as e:  # noqa: BLE001 - the steps' own error ends the task
                self._finish(None, e)
                return
            assert isinstance(call, Call)
            try:
                out = getattr(call.target, call.name)(*call.args, **call.kwargs)
            except Exception as e:  # noqa: BLE001 - thrown into the steps, as `drive` does
                result, error = None, e
                continue
            if isinstance(out, Pending):
                out.channel.park(self, out)
                return
            if isinstance(out, Later):
                out.park(self)
                return
            result, error = out, None

    def abandon(self) -> None:
        """The worker running it is gone or gave it up: the steps are closed where they wait."""
        if not self.finished:
            self.finished = True
            self.steps.close()

    def _finish(self, value, error) -> None:
        self.finished = True
        self.done(value, error)


class SimAdvert:
    """This worker's pool, offered for the receiver to read (`transfer.pull`'s way "sim")."""

    def __init__(self, worker):
        self.worker = worker

    def offer(self) -> PoolOffer:
        return PoolOffer("sim", f"{self.worker.name}:{self.worker.incarnation}".encode())

    def offsets(self, frames) -> list[int] | None:
        """Each frame's byte offset in this worker's pool, or None when one is not pool memory."""
        base = self.worker.manager.storage._bytes
        origin = np.frombuffer(base, dtype=np.uint8).ctypes.data
        out = []
        for f in frames:
            mv = memoryview(f).cast("B")
            start = np.frombuffer(mv, dtype=np.uint8).ctypes.data - origin
            if not (mv.nbytes and 0 <= start and start + mv.nbytes <= base.nbytes):
                return None
            out.append(int(start))
        return out

    def close(self) -> None:
        pass


class SimSource:
    """Receiver side of the way "sim": reads from the offering worker's pool, in this process.

    A message carrying a `late_read` fault (`dst.guarantees`) makes the read it starts miss its
    bound: TransferTimeout, so the receiver fails the transfer and frees its blocks. Under a
    transport whose issued reads cannot be cancelled, the bytes still land later (a timer on the
    reading worker) unless the source is closed first: `transfer.pull.PoolReader` closes a source
    whose read failed before the receiver frees the blocks (this source does not close itself, so
    the reader's close is what is tested). A closed source reads nothing more: TransportClosed, as a
    closed NIXL agent's reads; the reader opens a new one for the connection's next transfer."""

    hashes = True
    workers: dict = {}  # name -> the live prefill worker (set by the world)

    def __init__(self, blob: bytes, storage=None, host: str = ""):
        name, _, inc = bytes(blob).decode("utf-8", "replace").rpartition(":")
        worker = self.workers.get(name)
        if worker is None or str(worker.incarnation) != inc:
            raise MalformedMessage("the offered pool is not there (another incarnation)")
        self.worker, self.incarnation = worker, worker.incarnation
        self.net, self.closed = worker.net, False
        self.reader = next((n for n, w in self.net.nodes.items()  # the worker whose pool it reads into
                            if getattr(getattr(w, "manager", None), "storage", None) is storage), None)

    def read_many(self, items, threads: int = 1) -> list[int]:
        if self.closed:
            raise TransportClosed("the pool reader was closed")
        base = self.worker.manager.storage._bytes
        for offset, bufs in items:
            if offset + sum(b.nbytes for b in bufs) > base.nbytes:
                raise MalformedMessage("a chunk lies outside the sender's pool")
        env = self.net.reading
        if env is not None and env.late_read is not None:
            arg, env.late_read = env.late_read, None
            self._issue_late(base, items, arg)
            raise TransferTimeout("a pool read did not finish within its bound")
        out = []
        for offset, bufs in items:
            n = sum(b.nbytes for b in bufs)
            out.append(copy_hashed(bufs, base[offset:offset + n]))
        return out

    def _issue_late(self, base, items, arg: int) -> None:
        """The read was issued and missed its bound: cancelled with its transfer, or - when the
        transport's issued reads cannot be cancelled - landing 1-500 virtual ms later unless the
        source is closed by then."""
        if not self.net.model.late_reads_land or self.reader is None:
            return

        def land():
            if not self.closed:
                for offset, bufs in items:
                    copy_hashed(bufs, base[offset:offset + sum(b.nbytes for b in bufs)])
        self.net.timer(self.reader, self.net.now + 0.001 + arg % 500 / 1000, land)

    def close(self) -> None:
        self.closed = True


class _Tracker:
    """What a zero-copy send returns for a staging slot: here the bytes were copied at once."""

    done = True

    def wait(self, timeout=None) -> None:
        pass


class SimPipe:
    """The DEALER-like pipe of one connection (`message_channel`'s `sock`) on the simulated network:
    each message is copied when sent (as a socket takes it) and delivered as the network decides;
    replies queue in `inbox`."""

    def __init__(self, channel: SimChannel, conn: bytes):
        self.channel, self.conn = channel, conn
        self.inbox: list[list[bytes]] = []

    def send_multipart(self, parts, copy: bool = True, track: bool = False, flags: int = 0):
        ch = self.channel
        ch.net.send(ch.src, ch.dst, [bytes(p) for p in parts], self.conn)
        return _Tracker() if track else None

    def poll(self, timeout_ms: int = 0) -> bool:
        return bool(self.inbox)

    def recv_multipart(self) -> list[bytes]:
        return self.inbox.pop(0)

    def close(self, linger: int = 0) -> None:
        self.inbox = []


class SimChannel(MessageChannel):
    """The sending side of one connection from worker `src` to receiver `dst`: production's message
    channel (`transfer.channels.message_channel`: which messages a request, a pushed or a pulled
    transfer sends, and when) on a `SimPipe`, with its one blocking wait (`wait`) turned into a
    `Pending` the steps park on. The session asks `pulls` (a call, parked like a reply) before
    every whole transfer, so `open` never waits."""

    def __init__(self, net, src: str, dst: str, config, advert=None, metrics=None):
        self.net, self.src, self.dst = net, src, dst
        self.waiting: tuple[Task, Pending] | None = None
        super().__init__(config, metrics, advert, clock=net.clock)
        self._open()

    def _open(self) -> None:
        self.sock = SimPipe(self, f"{self.src}#{next(self.net.conn_ids)}".encode())

    @property
    def conn(self) -> bytes:
        return self.sock.conn

    @property
    def inbox(self) -> list[list[bytes]]:
        return self.sock.inbox

    # ---- replies --------------------------------------------------------------------------------
    def arrive(self, parts: list[bytes]) -> None:
        """A reply on this connection: queued, and handed to the parked steps if they wait for it."""
        self.sock.inbox.append(parts)
        if self.waiting is not None:
            task, p = self.waiting
            got = self._take(p.headers)
            if got is not None:
                self.waiting = None
                self._resume(task, p, got)

    def _take(self, headers) -> bytes | None:
        while self.sock.poll(0):
            got = self.reply(headers)
            if got is not None:
                return got[1]
        return None

    def _resume(self, task: Task, p: Pending, body: bytes) -> None:
        try:
            result, error = (p.then(body) if p.then else body), None
        except TransferError as e:
            result, error = None, e
        task.resume(result, error)

    def park(self, task: Task, p: Pending) -> None:
        body = self._take(p.headers)
        if body is not None:
            self._resume(task, p, body)
            return
        self.waiting = (task, p)
        sock = self.sock

        def expired():
            if self.waiting is not None and self.waiting[1] is p and self.sock is sock:
                self.waiting = None
                self.reset()
                task.resume(None, TransferTimeout(f"no reply from {self.dst} within the timeout"))
        self.net.timer(self.src, p.deadline, expired)

    def wait(self, headers, deadline: float, what: str = "", then=None) -> Pending:
        return Pending(tuple(headers), deadline, then, self)


class SimReceiver(MessageReceiver):
    """The real receiver, its answers put on the simulated network and its clock the virtual one."""

    def __init__(self, net, name: str, manager, config, **kwargs):
        super().__init__(manager, config, clock=net.clock, **kwargs)
        self.net, self.name = net, name
        self.address = f"sim://{name}"

    def _deliver(self, ident: bytes, header: bytes, body: bytes) -> None:
        sender = ident.decode().partition("#")[0]
        self.net.send(self.name, sender, [bytes(header), bytes(body)], ident)

    def receive(self, ident: bytes, parts: list[bytes]):
        """One message of connection `ident`: the committed ImportResult, None, or the typed
        TransferError of a transfer it failed (nacked, counted, released)."""
        return self._dispatch(ident, self.peers.get(ident), ListParts(parts))

    def expire(self) -> None:
        """Transfers silent or running past their bounds are failed (each raises once)."""
        while True:
            try:
                self._expire()
                return
            except TransferError:
                continue
