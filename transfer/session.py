"""The sending half of the KV migration protocol, written once for every channel.

A `SenderSession` is one prefill worker's connection to one decode worker. It does the protocol:
the signed hello and the compatibility plan (`connect`), the dedupe question (`query`), and the
transfer itself, where a whole migration (`send`, `migrate`: the payload of a finished prefill)
and a streamed one (`migrate_streamed`: blocks leave while the prompt is still being computed)
are the same loop over a feed of payload pieces: a whole migration is a feed of one item. The
chaos benchmark's faults (`transfer.faults`) are applied here, to the manifest bodies and the
payload pieces, so every channel suffers them alike. What differs between transports is only
how bytes move, and that is the channel's (`transfer.channel.SenderChannel`: ZeroMQ in
`zmq_channel`, Ray in `ray_channel`). Every error the channel raises is counted here once; a
receiver's nack comes back as its typed error (`wire_codec.decode_reply`).

Sans-IO: the protocol is written as step generators (`*_steps`) that never touch a channel or a
clock themselves. Each channel operation is yielded as a `Call` (the channel, or an open transfer,
and its method) and its result (or its error) is sent back in; the time comes in through `clock`.
Production runs them with `drive` (each call made on the channel, blocking); the deterministic
simulation (`dst`) runs the very same generators on a simulated network and a virtual clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field

from transfer.blocks import prefix_hashes_at
from transfer.channel import SenderChannel
from transfer.checksum import checksum
from transfer.errors import DedupeMiss, HandshakeRequired, MalformedMessage, TransferError, TransportClosed
from transfer.metrics import DEFAULT_METRICS, TransferMetrics
from transfer.reblock import CompatPlan, check_compatible
from transfer.stream_export import StreamedExport
from transfer.transport import RECEIVER_PHASES, TransportConfig, check_reply, make_hello
from transfer.wire_codec import decode_reply, encode, seal
from transfer.wire_messages import Ack, Final, Held, HelloReply, Query


@dataclass(frozen=True)
class Call:
    """One channel operation a step generator asks for: `target.name(*args, **kwargs)`, where
    target is the session's channel (`transfer.channel.SenderChannel`), a transfer it opened, or
    the session itself for `next_units` (a feed's next item, which a streamed migration waits for)."""

    target: object
    name: str
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)


Steps = Generator[Call, object, object]


def drive(steps: Steps):
    """Production's driver: make each call on its channel (blocking) and send back its result, or
    throw its error in; returns what the steps return."""
    result, error = None, None
    while True:
        try:
            call = steps.send(result) if error is None else steps.throw(error)
        except StopIteration as stop:
            return stop.value
        try:
            result, error = getattr(call.target, call.name)(*call.args, **call.kwargs), None
        except BaseException as e:  # noqa: BLE001 - thrown into the steps, which decide
            result, error = None, e


class SenderSession:
    """One connection from a prefill worker (layout `fingerprint`) through `channel`. clock: the
    time its deadlines are taken from (seconds; a virtual one in the simulation)."""

    def __init__(self, fingerprint: dict, config: TransportConfig, channel: SenderChannel, *,
                 metrics: TransferMetrics | None = None, faults=None,
                 clock: Callable[[], float] = time.monotonic):
        self.fingerprint, self.config, self.channel = dict(fingerprint), config, channel
        self.metrics = metrics or DEFAULT_METRICS
        self.faults = faults  # transfer.faults.Faults (chaos benchmark), or None
        self.clock = clock
        self.plan: CompatPlan | None = None
        self.last_phases: dict[str, float] = {}  # of the last migration
        self.token = 0  # transfers on this connection so far

    def _call(self, target, name: str, *args, **kwargs):
        """Steps: a channel operation; its TransferError (a timeout, a broken link) counted once."""
        try:
            return (yield Call(target, name, args, kwargs))
        except TransferError as e:
            if not self.channel.connected:  # the channel reset its connection: handshake again
                self.plan = None
            self.metrics.record_error(e)
            raise

    def _reply(self, data, cls):
        return decode_reply(data, cls, self.config.limits, self.metrics)

    # ---- before any transfer ----------------------------------------------------------------------
    def connect(self, timeout: float | None = None) -> CompatPlan:
        """Handshake: layouts compared once per connection; FingerprintMismatch if incompatible."""
        return drive(self.connect_steps(timeout))

    def connect_steps(self, timeout: float | None = None) -> Steps:
        deadline = self.clock() + (timeout or self.config.connect_timeout_s)
        self.plan = None
        hello = make_hello(self.fingerprint, self.config, **self.channel.hello_fields())
        data = yield from self._call(self.channel, "request", "hello", encode(hello), deadline)
        reply = self._reply(data, HelloReply)
        try:
            check_reply(reply, hello, self.config)  # signed for this hello, by the receiver we meant
            plan = check_compatible(self.fingerprint, reply.fingerprint)
        except TransferError as e:
            self.metrics.record_error(e)
            raise
        yield from self._call(self.channel, "accepted", reply)
        self.plan = plan
        return plan

    def _plan_steps(self, timeout: float | None = None) -> Steps:
        """The connection's plan, handshaking first when there is none."""
        if self.plan is not None:
            return self.plan
        return (yield from self.connect_steps(timeout))

    def query(self, request_id: str, token_ids, extra_key: str | None = None,
              timeout: float | None = None) -> list[int]:
        """Receiver logical blocks (its block size) of this prefix that it already holds."""
        return drive(self.query_steps(request_id, token_ids, extra_key, timeout))

    def query_steps(self, request_id: str, token_ids, extra_key: str | None = None,
                    timeout: float | None = None) -> Steps:
        plan = yield from self._plan_steps(timeout)
        hashes = prefix_hashes_at(token_ids, plan.dst_block_size, extra_key)
        if not hashes:
            return []
        deadline = self.clock() + (timeout or self.config.connect_timeout_s)
        body = encode(Query(str(request_id), plan.dst_block_size, tuple(hashes)))
        data = yield from self._call(self.channel, "request", "query", body, deadline)
        held = self._reply(data, Held).held
        if any(not 0 <= i < len(hashes) for i in held):
            err = MalformedMessage("dedupe reply names blocks outside the query")
            self.metrics.record_error(err)
            raise err
        return sorted(set(held))

    # ---- transfers --------------------------------------------------------------------------------
    def _transfer(self, manifest, feed, pieces, limit: float, *, final_of=None, frames=None,
                  on_verdict=None) -> Steps:
        """Steps: the one transfer loop. feed: lists of payload units, the last given as (units,
        DecodeState); a whole migration is one such item. pieces(units) -> ((frame, chunk, slot,
        xxh3), view) payload pieces. final_of(state): the body of the message that closes a
        streamed transfer (None: whole; the manifest carries the state). frames: the export's
        host frames, for a channel that sends them whole. on_verdict: called once the receiver
        answered (before its answer is decoded). Returns the ack and when the feed ended."""
        self.token += 1
        fault = self.faults.take() if self.faults is not None else None
        bodies = [seal(encode(manifest))]
        if fault is not None:
            bodies, frames = self.faults.manifest(fault, bodies[0]), None
        streamed = final_of is not None
        deadline = self.clock() + limit
        xfer = yield from self._call(self.channel, "open", self.token, manifest, bodies, frames,
                                     streamed=streamed, deadline=float("inf") if streamed else deadline)
        ok, final, feed = True, None, iter(feed)
        try:
            while True:
                # the next payload units: a call, because in a streamed migration it waits for the
                # prefill to compute them (production blocks on the engine; the simulation parks)
                item = yield from self._call(self, "next_units", feed)
                if item is None:
                    break
                last = isinstance(item, tuple)  # (the last units, the final state): the prefill is done
                units = item[0] if last else item
                batch = pieces(units)
                if fault is not None and units:  # a data fault hits the first batch
                    batch, fault = self.faults.chunks(fault, batch), None
                if not (yield from self._call(xfer, "send", batch)):
                    ok = False  # refused early, or the link broke: the verdict follows
                    break
                if last:
                    final = (item[1],)
                    break
            t1 = time.perf_counter()
            if ok and final is None:
                raise TransportClosed("streamed migration cancelled before its final state")
            if ok:
                yield from self._call(xfer, "end", final_of(final[0]) if streamed else None)
            data = yield from self._call(xfer, "verdict", self.clock() + limit if streamed else deadline)
            if on_verdict is not None:
                on_verdict()
            ack = self._reply(data, Ack)
        except GeneratorExit:  # the steps were abandoned (their driver stopped): nothing more is sent
            raise
        except BaseException:  # a nack, a timeout, the feed's own error: the receiver aborts
            yield Call(xfer, "cancel")
            raise
        self.metrics.add("transfers")
        self.metrics.add("bytes_sent", ack.nbytes)
        return ack, t1

    @staticmethod
    def next_units(feed):
        """The feed's next item, or None once it ended (a Call target: see `_transfer`)."""
        return next(feed, None)

    def export_config(self, storage, *, lease: bool = True):
        """How a whole payload of `storage` (the sending pool) is exported on this connection. One
        the receiver reads from our pool (a CPU pool, not re-blocked) gets "inline" checksums:
        they follow its pool offsets, hashed here while the receiver reads (`transfer.pull`),
        instead of delaying the manifest. Others get the config's `checksum_mode`."""
        return drive(self.export_config_steps(storage, lease=lease))

    def export_config_steps(self, storage, *, lease: bool = True) -> Steps:
        from transfer.export import ExportConfig

        c, plan = self.config, (yield from self._plan_steps())
        pulled = storage.device.type == "cpu" and not plan.reblock and (yield from self._call(self.channel,
                                                                                             "pulls"))
        return ExportConfig(chunk_bytes=c.chunk_bytes, checksum_mode="inline" if pulled else c.checksum_mode,
                            lease_s=c.lease_s, lease=lease, checksum_threads=c.copy_threads)

    def send(self, exported, timeout: float | None = None) -> Ack:
        """Send one export (manifest + payload) and wait for its ack; the export's lease is released
        on the receiver's answer (ack or nack), kept on a timeout (the receiver may have committed)."""
        return drive(self.send_steps(exported, timeout))

    def send_steps(self, exported, timeout: float | None = None) -> Steps:
        yield from self._plan_steps()
        inline = exported.manifest.checksum_mode == "inline"

        def pieces(_):
            for f, c, view, slot in exported.chunks():
                yield (f, c, slot, checksum(view) if inline else 0), view

        ack, _ = yield from self._transfer(exported.manifest, [(exported, None)], pieces,
                                           timeout or self.config.transfer_timeout_s, frames=exported.frames,
                                           on_verdict=exported.release)
        return ack

    def migrate(self, manager, seq_id, request_id: str, epoch: int, state=None, *, dedupe: bool = True,
                leases=None, timeout: float | None = None, lease: bool = True) -> Ack:
        """Dedupe query (when asked and the payload is above `inline_bytes`: a small one goes in one
        round trip), export (re-blocked here into the receiver's block size when it differs), send.
        The phases (query, export, wire and the receiver's RECEIVER_PHASES, in ms) are left in
        `last_phases`. Resends once in full after a DedupeMiss (a held block was evicted meanwhile)
        and once after HandshakeRequired (the receiver restarted). Exports are added to `leases`
        (a LeaseTable) when given; with lease=False the caller keeps the blocks allocated until
        this returns (see ExportConfig.lease)."""
        return drive(self.migrate_steps(manager, seq_id, request_id, epoch, state, dedupe=dedupe,
                                        leases=leases, timeout=timeout, lease=lease))

    def migrate_steps(self, manager, seq_id, request_id: str, epoch: int, state=None, *, dedupe: bool = True,
                      leases=None, timeout: float | None = None, lease: bool = True) -> Steps:
        from transfer.export import export_sequence

        t0 = time.perf_counter()
        plan = yield from self._plan_steps()
        reuse: list[int] = []
        c = self.config
        t = manager.table(seq_id)
        nbytes = -(-t.num_computed // manager.block_size) * manager.storage.layout.block_bytes  # none reused
        if dedupe and nbytes > c.inline_bytes:
            prefix = t.token_ids[:t.num_computed]
            reuse = yield from self.query_steps(request_id, prefix, t.extra_key, timeout)
        cfg = yield from self.export_config_steps(manager.storage, lease=lease)
        phases = self.last_phases = {"query_ms": (time.perf_counter() - t0) * 1e3}
        for attempt in range(2):
            t1 = time.perf_counter()
            ex = export_sequence(manager, seq_id, request_id, epoch, state, reuse=reuse,
                                 reuse_block_size=plan.dst_block_size if reuse else 0, config=cfg,
                                 limits=c.limits, frame_block_size=plan.dst_block_size if plan.reblock else 0)
            if leases is not None:
                leases.add(ex)
            t2 = time.perf_counter()
            try:
                ack = yield from self.send_steps(ex, timeout)
            except DedupeMiss:
                if attempt or not reuse:
                    raise
                reuse = []
                continue
            except HandshakeRequired:
                if attempt:
                    raise
                plan = yield from self.connect_steps()
                continue
            phases.update(export_ms=(t2 - t1) * 1e3, wire_ms=(time.perf_counter() - t2) * 1e3)
            phases.update({k: v for k, v in ack.timings.items() if k in RECEIVER_PHASES})
            return ack
        raise AssertionError("unreachable")

    def migrate_streamed(self, manager, request_id: str, epoch: int, token_ids: list[int], sampling: dict,
                         feed, extra_key: str | None = None, timeout: float | None = None) -> Ack:
        """A streamed migration (transfer.stream_export): offer the sequence now, send its blocks as
        `feed` yields them (lists of (logical, physical) blocks whose K/V is complete), and close
        with the (last blocks, DecodeState) pair it yields last; a feed that ends without one
        cancels the transfer. last_phases: streamed_ms (offer to final), exposed_ms (final to ack),
        overlap_pct (payload sent before the prefill finished) and the receiver's phases. Raises
        the receiver's typed error."""
        return drive(self.migrate_streamed_steps(manager, request_id, epoch, token_ids, sampling, feed,
                                                 extra_key, timeout))

    def migrate_streamed_steps(self, manager, request_id: str, epoch: int, token_ids: list[int],
                               sampling: dict, feed, extra_key: str | None = None,
                               timeout: float | None = None) -> Steps:
        plan = yield from self._plan_steps(timeout)
        t0 = time.perf_counter()
        reuse = yield from self.query_steps(request_id, token_ids, extra_key, timeout)
        sx = StreamedExport(manager, request_id, epoch, token_ids, sampling, extra_key, reuse=reuse,
                            reuse_block_size=plan.dst_block_size if reuse else 0,
                            chunk_bytes=self.config.chunk_bytes, limits=self.config.limits)
        m, sent, before_last = sx.manifest, [0], [0]

        def pieces(blocks):
            before_last[0] = sent[0]  # once the final item came: the bytes sent while prefilling
            sent[0] += sx.nbytes(blocks)
            return sx.chunks(blocks)

        def final_of(state):
            return seal(encode(Final(m.request_id, m.epoch, state)))

        limit = timeout or self.config.transfer_timeout_s
        ack, t1 = yield from self._transfer(m, feed, pieces, limit, final_of=final_of)
        self.last_phases = {"streamed_ms": (t1 - t0) * 1e3, "exposed_ms": (time.perf_counter() - t1) * 1e3,
                            "overlap_pct": 100.0 * before_last[0] / max(1, m.payload_bytes),
                            **{k: v for k, v in ack.timings.items() if k in RECEIVER_PHASES}}
        return ack

    def close(self) -> None:
        self.plan = None
        self.channel.close()
