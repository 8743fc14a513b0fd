"""Test-only mutants: known bugs put back into the real code for the length of a `with mutant(name)`
block, to prove the simulator finds each (tests/test_dst.py states in how many seeds). Nothing
outside the block sees them: each replaces one attribute and puts the original back.

Historical (the bugs CI found late):
- `late_migrated` (fixed in 1cce57b): the reconciler calls a request vanished on its decode worker
  even when every token arrived (it ignores `generated`), so a late Migrated report fails a request
  that was answered right;
- `late_submit` (fixed in 6a35fe1): the reconciler calls a request vanished as soon as its worker's
  reports do not list it, though the worker never listed it under this epoch (its Submit is late);
- `reoffer` (fixed in 81cf81a, test e41ba0a): the receiver reads checksums ("K") after the pool was
  offered again and declined in between, with no source left to read from.
Our own, in the protocol's riskiest branches:
- `skip_checksum`: a landed chunk is not compared with its checksum (corrupt bytes commit);
- `fail_keeps_reservation`: a failed transfer is nacked but its reserved blocks are not returned;
- `abort_keeps_reused`: an aborted import returns its fresh blocks but not the cached prefix blocks
  it took a reference on (dedupe).
Of a transport's declared guarantees (`dst.guarantees`):
- `late_read_lands`: a connection's pool reader (`transfer.pull.PoolReader`) forgets a source whose
  read missed its bound without closing it, under a transport whose issued reads cannot be
  cancelled: the read's bytes land in the blocks the receiver freed.
"""

from __future__ import annotations

import contextlib


def _late_migrated():
    from coordinator.reconcile import Reconciler

    real = Reconciler.check

    def check(self, worker, role, stats, holdings, assigned, generated=frozenset(), now=None):
        return real(self, worker, role, stats, holdings, assigned, frozenset(), now)
    return Reconciler, "check", check


def _late_submit():
    from coordinator.ledger import Phase
    from coordinator.reconcile import Reconciler

    real = Reconciler.check

    def check(self, worker, role, stats, holdings, assigned, generated=frozenset(), now=None):
        for entry in self.ledger.active():  # as if listed already: vanished as soon as it is not
            responsible = entry.owner == worker and (
                entry.phase is Phase.DECODING or (entry.phase is Phase.PREFILLING and role == "prefill"))
            if responsible:
                self._listed[(worker, entry.request_id)] = entry.epoch
        return real(self, worker, role, stats, holdings, assigned, generated, now)
    return Reconciler, "check", check


def _reoffer():
    import time

    from transfer.errors import MalformedMessage, TransferError
    from transfer.pull import land_pulled
    from transfer.receiver_transfers import Payloads

    def sums(self, ident, peer, token, body):  # as before 81cf81a
        s, rx = peer.session, self.rx
        if s is None or token != peer.token:
            rx.metrics.add("stray_ends")
            return None
        t0 = time.perf_counter()
        try:
            if peer.pulled is None:
                raise MalformedMessage("chunk checksums before the pool offsets they check")
            offsets, landed = peer.pulled
            land_pulled(s, peer.source, offsets, rx.config.copy_threads, sums=body, landed=landed)
        except TransferError as e:
            return rx._fail(ident, peer, e)
        s.timings["verify_ms"] = (time.perf_counter() - t0) * 1e3
        return self.end(ident, peer, token)
    return Payloads, "sums", sums


def _skip_checksum():
    from transfer.importer import ImportSession

    real = ImportSession.chunk_done

    def chunk_done(self, frame, chunk, nbytes, bufs, inline_checksum=None, landed_checksum=None):
        m = self.manifest
        expect = inline_checksum if m.checksum_mode == "inline" else m.frames[frame].checksums[chunk]
        return real(self, frame, chunk, nbytes, bufs, inline_checksum, landed_checksum=expect)
    return ImportSession, "chunk_done", chunk_done


def _fail_keeps_reservation():
    from transfer.receiver import MessageReceiver
    from transfer.wire import TOKEN
    from transfer.wire_messages import Nack

    def _fail(self, ident, peer, err):
        s = self._stop(peer)
        self.metrics.record_error(err)
        if s is not None:  # nacked, but s.abort(err) is not called
            self._send(ident, TOKEN.pack(b"A", peer.token), Nack(s.manifest.request_id, s.manifest.epoch,
                                                                 err.code, str(err)))
        raise err
    return MessageReceiver, "_fail", _fail


def _abort_keeps_reused():
    from transfer.importer import ImportSession

    real = ImportSession.abort

    def abort(self, err=None):
        self._acquired = []  # the cached blocks it acquired keep their reference
        return real(self, err)
    return ImportSession, "abort", abort


def _late_read_lands():
    from transfer.errors import TransferError
    from transfer.pull import PoolReader

    def read_many(self, items, threads: int = 1):
        if self.source is None:
            self.source = self._open()
        try:
            return self.source.read_many(items, threads)
        except TransferError:
            self.source = None  # forgotten, not closed: its issued read still lands
            raise
    return PoolReader, "read_many", read_many


MUTANTS = {"late_migrated": _late_migrated, "late_submit": _late_submit, "reoffer": _reoffer,
           "skip_checksum": _skip_checksum, "fail_keeps_reservation": _fail_keeps_reservation,
           "abort_keeps_reused": _abort_keeps_reused, "late_read_lands": _late_read_lands}


@contextlib.contextmanager
def mutant(name: str | None):
    """Run the block with mutant `name` in place (None: the real code); KeyError naming the known."""
    if name is None:
        yield
        return
    if name not in MUTANTS:
        raise KeyError(f"unknown mutant {name!r}; known: {', '.join(MUTANTS)}")
    owner, attr, patched = MUTANTS[name]()
    real = owner.__dict__[attr]
    setattr(owner, attr, patched)
    try:
        yield
    finally:
        setattr(owner, attr, real)
