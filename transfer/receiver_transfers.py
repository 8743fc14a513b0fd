"""How a receiver's transfers end (`Payloads`, a collaborator every channel's
`transfer.receiver.MessageReceiver` makes with itself): superseded by a newer epoch of the same
request (`supersede`), payload chunks that came as messages (`chunk`), payloads that finished
landing on the bulk link (`commit_landed`, from `bulk_receiver`'s reader threads), payloads read
from the sender's own pool (`pull`, `transfer.pull`; `sums` when their checksums follow), a
streamed transfer's closing state (`final`) or its cancellation (`cancel`), and the commit with
its ack (`end`). Everything here runs on the receiver's owner thread; a failure goes through the
receiver's `_fail` (reservation released, nack, count).
"""

from __future__ import annotations

import dataclasses
import queue
import time

from transfer.checksum import copy_hashed
from transfer.errors import MalformedMessage, StaleEpoch, TransferError, TransportClosed
from transfer.importer import ImportResult
from transfer.pull import land_pulled, read_ahead
from transfer.wire import TOKEN
from transfer.wire_codec import decode, unseal
from transfer.wire_messages import Ack, Final


class Payloads:
    """How the transfers of receiver `rx` end (a `transfer.receiver.MessageReceiver`: its message
    being read, bulk links, transfers in flight, metrics, config, `_fail` and `_send`)."""

    def __init__(self, rx):
        self.rx = rx

    def abort_request(self, request_id: str) -> int:
        """End the transfers of request `request_id` still in flight (transfer ids are
        'request_id/i'): the coordinator aborted it, so their blocks come back now, not at the
        idle timeout. Returns how many were ended."""
        n = 0
        for ident, p in list(self.rx.active.items()):
            if p.session.manifest.request_id.rpartition("/")[0] == request_id:
                try:
                    self.rx._fail(ident, p, TransportClosed(f"request {request_id!r} was aborted"))
                except TransferError:
                    n += 1
        return n

    def supersede(self, m) -> None:
        """An admitted transfer of a newer epoch ends an older one of the same request still in
        flight on another connection: the coordinator re-ran the request because that sender
        died or froze, and the old transfer would otherwise hold its blocks and the epoch until
        its idle timeout, refusing the rerun."""
        for ident, p in list(self.rx.active.items()):
            old = p.session.manifest
            if old.request_id == m.request_id and old.epoch < m.epoch:
                try:
                    self.rx._fail(ident, p, StaleEpoch(f"request {m.request_id!r}: epoch {old.epoch} "
                                                    f"superseded by {m.epoch}"))
                except TransferError:
                    pass

    def commit_landed(self) -> ImportResult | None:
        """Commit (or fail) the next payload that finished landing on the bulk link."""
        if self.rx.bulk is None:
            return None
        self.rx.bulk.wake.clear()
        try:
            landing = self.rx.bulk.finished.get_nowait()
        except queue.Empty:
            return None
        for ident, peer in self.rx.active.items():
            if peer.landing is landing:
                peer.landing = None
                if landing.error is not None:
                    return self.rx._fail(ident, peer, landing.error)
                if peer.awaits_final and peer.final is None:
                    peer.landed = True  # the closing state is still on its way
                    return None
                return self.end(ident, peer, landing.token)
        return None  # its transfer was failed meanwhile

    def final(self, ident: bytes, peer, token: int, body) -> ImportResult | None:
        """A streamed migration's closing state: commit now if its payload already landed."""
        s = peer.session
        if s is None or token != peer.token or not peer.awaits_final or peer.final is not None:
            self.rx.metrics.add("stray_finals")
            if token > peer.token:  # its offer never arrived (lost): the sender waits on this answer
                self.rx._nack(ident, TOKEN.pack(b"A", token),
                           TransportClosed(f"no transfer {token} was offered on this connection"))
            return None
        try:
            final = decode(unseal(body), self.rx.config.limits, Final)
            m = s.manifest
            n = m.num_tokens
            if (final.request_id, final.epoch) != (m.request_id, m.epoch) \
                    or final.state.token_ids[:n] != m.state.token_ids[:n] or len(final.state.token_ids) < n:
                raise MalformedMessage("final state does not continue the offered sequence")
        except TransferError as e:
            return self.rx._fail(ident, peer, e)
        peer.final = final
        s.manifest = dataclasses.replace(m, state=final.state)
        # landed on the bulk link already, or its chunks came on this channel before the final
        return self.end(ident, peer, token) if peer.landed or peer.landing is None else None

    def cancel(self, ident: bytes, peer, token: int) -> None:
        """The sender gave the transfer up (its feed failed): every reserved block returns now."""
        if peer.session is None or token != peer.token:
            self.rx.metrics.add("stray_cancels")
            return None
        return self.rx._fail(ident, peer, TransportClosed("the sender cancelled the transfer"))

    def pull(self, ident: bytes, peer, token: int, body) -> ImportResult | None:
        """A whole transfer's payload named by offsets in the sender's pool: read, verify, commit.
        When its checksums follow ("K", an "inline" manifest), it is read now and verified then."""
        s = peer.session
        if (s is None or token != peer.token or peer.landing is not None or peer.awaits_final
                or peer.pulled is not None):
            self.rx.metrics.add("stray_ends")
            return None
        t0 = time.perf_counter()
        try:
            if peer.source is None:
                raise MalformedMessage("pool offsets on a connection whose pool this receiver does not read")
            if s.manifest.checksum_mode == "inline":
                peer.pulled = (bytes(body), read_ahead(s, peer.source, body, self.rx.config.copy_threads))
            else:
                land_pulled(s, peer.source, body, self.rx.config.copy_threads)
        except TransferError as e:
            return self.rx._fail(ident, peer, e)
        s.timings["land_ms"] = (time.perf_counter() - t0) * 1e3  # reads and checksums
        return None if peer.pulled is not None else self.end(ident, peer, token)

    def sums(self, ident: bytes, peer, token: int, body) -> ImportResult | None:
        """A pulled payload's chunk checksums, sent after its offsets: verify what landed, commit."""
        s = peer.session
        if s is None or token != peer.token:
            self.rx.metrics.add("stray_ends")
            return None
        t0 = time.perf_counter()
        try:
            if peer.pulled is None or peer.source is None:  # (the pool offered again meanwhile)
                raise MalformedMessage("chunk checksums before the pool offsets they check")
            offsets, landed = peer.pulled
            land_pulled(s, peer.source, offsets, self.rx.config.copy_threads, sums=body, landed=landed)
        except TransferError as e:
            return self.rx._fail(ident, peer, e)
        s.timings["verify_ms"] = (time.perf_counter() - t0) * 1e3
        return self.end(ident, peer, token)

    def chunk(self, ident: bytes, peer, f: int, c: int, cs: int) -> None:
        s, parts, t0 = peer.session, self.rx.parts, time.perf_counter()
        try:
            bufs = s.chunk_buffers(f, c)
        except TransferError as e:
            parts.drain()
            return self.rx._fail(ident, peer, e)
        buf = parts.next().buffer  # a view of the message (ZeroMQ's, or the object store's)
        n, landed = buf.nbytes, None
        if n == sum(b.nbytes for b in bufs):  # else chunk_done refuses the size, nothing copied
            landed = copy_hashed(bufs, buf)
        if parts.drain():
            return self.rx._fail(ident, peer, MalformedMessage("data message with extra parts"))
        t1 = time.perf_counter()
        try:
            s.chunk_done(f, c, n, bufs, cs, landed_checksum=landed)
        except TransferError as e:
            return self.rx._fail(ident, peer, e)
        tm = s.timings  # the same phases as the bulk link's reader reports
        tm["land_ms"] = tm.get("land_ms", 0.0) + (t1 - t0) * 1e3
        tm["verify_ms"] = tm.get("verify_ms", 0.0) + (time.perf_counter() - t1) * 1e3
        return None

    def end(self, ident: bytes, peer, token: int) -> ImportResult | None:
        s = peer.session
        if s is None or token != peer.token or (peer.awaits_final and peer.final is None):
            self.rx.metrics.add("stray_ends")
            return None
        if peer.landing is not None:  # NOTE: its payload is still landing on the bulk link
            # An end marker on the control socket does not finish a streamed transfer (its stream's
            # END does): committing here would race the reader thread (a commit that fails or not
            # depending on which socket won, beside a reader still in the session) and leave the
            # landing on the peer, so the connection's next transfer would drop its chunks as
            # stray. The commit runs when the landing finishes (`commit_landed`), bounded by its timeouts.
            self.rx.metrics.add("ends_before_landing")
            return None
        s.timings["recv_ms"] = (time.perf_counter() - peer.t0) * 1e3
        try:
            result = s.commit()
        except TransferError as e:
            return self.rx._fail(ident, peer, e)
        peer.session = None
        self.rx._send(ident, TOKEN.pack(b"A", token), Ack(result.request_id, result.epoch, result.new_blocks,
                                                        result.reused_blocks, result.nbytes, result.timings))
        return result

