"""The simulated KV channel: both of its sides, over `dst.net.Network`.

Sending side: `SimChannel` meets `transfer.channel.SenderChannel` with the ZeroMQ channel's wire
(control messages, payload chunks as "D" messages behind the manifest, a same-node pool read by
the receiver: "M", "P", then "K"), but never blocks: an operation that waits for a reply returns a
`Pending`, and `Task` (the simulation's driver of the sender's step generators) parks the steps
until the reply arrives or the virtual deadline passes (then, as ZeroMQ's channel does, the
connection is reset and TransferTimeout thrown in). Replies queue on the connection and a wait
discards the ones it does not want, as a DEALER socket's reader does.

Receiving side: `SimReceiver` is the real `transfer.receiver.MessageReceiver`, its messages carried
by the network, its clock the virtual one. `SimSource` is the pool reader of `transfer.pull` for
the way "sim": it copies from the sending worker's pool in this process (its `SimAdvert`), and it
refuses an offer from an earlier incarnation of that worker (its pool may be gone).

Delivery guarantees modelled: the transport's declared ones (`dst.guarantees`, applied by
`dst.net.Network`); a one-sided pool read is a copy made when its offsets arrive, unless a
`late_read` fault makes it miss its bound (`SimSource`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from transfer.checksum import copy_hashed
from transfer.errors import MalformedMessage, TransferError, TransferTimeout, TransportClosed
from transfer.pull import encode_offsets
from transfer.receiver import ListParts, MessageReceiver
from transfer.session import Call
from transfer.wire import DATA, TOKEN
from transfer.wire_codec import decode, encode
from transfer.wire_messages import Nack, PoolOffer, PoolReply

_REQUESTS = {"hello": (b"H", b"h"), "query": (b"Q", b"q"), "pool": (b"U", b"u")}


@dataclass
class Pending:
    """A wait for a reply under one of `headers` until `deadline`; `then(body)` makes the result."""

    headers: tuple[bytes, ...]
    deadline: float
    then: object = None


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
                call.target.channel_of().park(self, out)
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


class SimChannel:
    """The sending side of one connection from worker `src` to receiver `dst`."""

    def __init__(self, net, src: str, dst: str, limits, inline_bytes: int, advert=None):
        self.net, self.src, self.dst, self.limits = net, src, dst, limits
        self.inline_bytes, self.advert = inline_bytes, advert
        self.conn = self._new_conn()
        self.connected, self.pull, self.offered = False, False, advert is None
        self.inbox: list[list[bytes]] = []
        self.waiting: tuple[Task, Pending] | None = None
        self.stray = 0

    def _new_conn(self) -> bytes:
        return f"{self.src}#{next(self.net.conn_ids)}".encode()

    def channel_of(self) -> SimChannel:
        return self

    def put(self, parts) -> None:
        self.net.send(self.src, self.dst, [bytes(p) for p in parts], self.conn)

    # ---- replies --------------------------------------------------------------------------------
    def arrive(self, parts: list[bytes]) -> None:
        """A reply on this connection: queued, and handed to the parked steps if they wait for it."""
        self.inbox.append(parts)
        if self.waiting is not None:
            task, p = self.waiting
            body = self._take(p.headers)
            if body is not None:
                self.waiting = None
                self._resume(task, p, body)

    def _take(self, headers) -> bytes | None:
        while self.inbox:
            parts = self.inbox.pop(0)
            if len(parts) == 2 and (parts[0] in headers or parts[0] == b"N"):
                return parts[1]
            self.stray += 1
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
        conn = self.conn

        def expired():
            if self.waiting is not None and self.waiting[1] is p and self.conn == conn:
                self.waiting = None
                self.reset()
                task.resume(None, TransferTimeout(f"no reply from {self.dst} within the timeout"))
        self.net.timer(self.src, p.deadline, expired)

    def wait(self, headers, deadline: float, then=None) -> Pending:
        return Pending(tuple(headers), deadline, then)

    def reset(self) -> None:
        """A fresh connection: the receiver forgets this one's handshake; queued replies are lost."""
        self.connected, self.inbox, self.conn = False, [], self._new_conn()

    # ---- transfer.channel.SenderChannel -------------------------------------------------------------
    def hello_fields(self) -> dict:
        return {"stream": ""}

    def request(self, kind: str, body: bytes, deadline: float) -> Pending:
        header, answer = _REQUESTS[kind]
        self.put([header, body])
        return self.wait((answer,), deadline)

    def accepted(self, reply) -> None:
        self.connected, self.pull = True, False
        self.offered = self.advert is None

    def pulls(self):
        if self.offered:
            return self.pull
        self.offered = True
        self.put([b"U", encode(self.advert.offer())])

        def then(body):
            answer = decode(body, self.limits, (PoolReply, Nack))
            self.pull = isinstance(answer, PoolReply) and answer.accepted
            return self.pull
        return self.wait((b"u",), self.net.now + 5.0, then)

    def open(self, token: int, manifest, bodies, frames=None, *, streamed: bool = False,
             deadline: float = float("inf")):
        big = manifest.payload_bytes > self.inline_bytes
        if not streamed and frames is not None and big and self.pull:
            offsets = self.advert.offsets(frames)
            if offsets is not None:
                return SimPulled(self, token, bodies, offsets, manifest.checksum_mode == "inline")
        return SimTransfer(self, token, bodies, streamed, deadline)

    def close(self) -> None:
        self.connected = False


class SimPulled:
    """A whole transfer the receiver reads from the sender's pool: "M", "P" offsets, then "K" sums."""

    def __init__(self, ch: SimChannel, token: int, bodies, offsets, sums: bool):
        self.ch, self.token, self.sums = ch, token, sums
        for body in bodies:
            ch.put([TOKEN.pack(b"M", token), body])
        ch.put([TOKEN.pack(b"P", token), encode_offsets(offsets)])

    def channel_of(self) -> SimChannel:
        return self.ch

    def send(self, items) -> bool:
        """The checksums leave once hashed, while the receiver reads (a virtual 0.5-5 ms later)."""
        if self.sums:
            body = encode_offsets([cs for (_, _, _, cs), _ in items])
            net, conn = self.ch.net, self.ch.conn

            def hashed():
                if self.ch.conn == conn:  # the connection was not reset meanwhile
                    self.ch.put([TOKEN.pack(b"K", self.token), body])
            net.timer(self.ch.src, net.now + net.rng.uniform(0.0005, 0.005), hashed)
        return True

    def end(self, final_body) -> None:
        pass

    def verdict(self, deadline: float) -> Pending:
        return self.ch.wait((TOKEN.pack(b"A", self.token),), deadline)

    def cancel(self) -> None:
        pass


class SimTransfer:
    """A pushed transfer: "M" (whole) or "W" (streamed), "D" chunks, then "E" or "F"."""

    def __init__(self, ch: SimChannel, token: int, bodies, streamed: bool, deadline: float):
        self.ch, self.token, self.streamed, self.deadline = ch, token, streamed, deadline
        self.ack = TOKEN.pack(b"A", token)
        self.early: bytes | None = None
        for body in bodies:
            ch.put([TOKEN.pack(b"W" if streamed else b"M", token), body])

    def channel_of(self) -> SimChannel:
        return self.ch

    def _answered(self) -> bool:
        if self.early is None and self.ch.inbox:
            parts = self.ch.inbox.pop(0)
            if len(parts) == 2 and parts[0] in (self.ack, b"N"):
                self.early = parts[1]
            else:
                self.ch.stray += 1
        return self.early is not None or self.ch.net.now > self.deadline

    def send(self, items) -> bool:
        for (f, c, _slot, cs), view in items:
            self.ch.put([DATA.pack(b"D", self.token, f, c, cs), bytes(view)])
            if self._answered():
                return False
        return True

    def end(self, final_body) -> None:
        self.ch.put([TOKEN.pack(b"F" if self.streamed else b"E", self.token), final_body or b""])

    def verdict(self, deadline: float):
        if self.early is not None:
            return self.early
        return self.ch.wait((self.ack,), deadline)

    def cancel(self) -> None:
        if self.streamed:
            self.ch.put([TOKEN.pack(b"C", self.token), b""])


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
