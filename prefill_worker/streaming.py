"""Streamed migration on the prefill side, as a mixin of `PrefillHandler`: while a one-choice
request's prompt is still being prefilled, its complete blocks are pinned (referenced until the
transfer returns) and fed to the decode worker's transfer thread (`prefill_worker.shipper`), and
once the prompt is computed the last blocks go with the first token's decode state. Each attempt
(target) of a request streams at most once: a stream that failed while the prompt was computing
is not restarted, the request migrates whole after its prefill. `Flight` is one migration on a
transfer thread, streamed or whole. Runs on the loop thread.
"""

from __future__ import annotations

import queue
from dataclasses import dataclass, field

from prefill_worker.shipper import ShipJob
from transfer.messages import DecodeState


@dataclass
class Flight:
    """A request whose migration runs on a transfer thread; its blocks are freed when it returns.
    A streamed one starts while the request is still prefilling (request None until finalized)."""

    request: object
    cancelled: bool = False  # aborted or superseded meanwhile: free the blocks, report nothing
    feed: queue.SimpleQueue | None = None  # streamed: what the transfer thread sends next
    sent: int = 0                          # streamed: logical blocks handed to the feed so far
    pinned: list = field(default_factory=list)  # streamed: blocks referenced until the result
    finalized: bool = False                # streamed: the final state went out

    def cancel(self) -> None:
        self.cancelled = True
        if self.feed is not None and not self.finalized:
            self.feed.put(None)


class StreamingMixin:
    """Needs from the host class: engine, targets, inflight, shipper, streamed."""

    def _stream_progress(self) -> None:
        """Start or feed streamed migrations of one-choice requests still prefilling."""
        for rid, flight in list(self.inflight.items()):  # ended at its first token, or gone
            if flight.feed is not None and not (flight.finalized or flight.cancelled) \
                    and rid not in self.engine.requests and rid not in self.engine.prefilled:
                flight.cancel()
        tried = self.__dict__.setdefault("_stream_tried", {})  # request id -> the target it streamed to
        for rid in [rid for rid, target in tried.items() if self.targets.get(rid) is not target]:
            del tried[rid]  # that attempt ended (finalized, superseded, aborted)
        for rid, target in self.targets.items():
            req = self.engine.requests.get(rid)
            if req is None or req.params.n != 1 or req.is_beam or len(req.seqs) != 1:
                continue
            s = req.seqs[0]
            t = self.engine.kv.tables.get(s.seq_id)
            flight = self.inflight.get(rid)
            if t is None or t.swapped or s.output_ids or (flight is not None and flight.feed is None):
                continue
            done = self.engine.computed_blocks(rid)[0]  # blocks whose K/V is complete
            if flight is None:
                if not done or s.num_computed >= len(s.token_ids) or tried.get(rid) is target:
                    continue
                tried[rid] = target
                flight = self.inflight[rid] = Flight(None, feed=queue.SimpleQueue())
                self.shipper.ship(ShipJob(rid, target.decode_worker, target.decode_address, target.epoch, [],
                                          flight.feed, list(s.token_ids), req.params.to_dict()))
                self.streamed += 1
            if not (flight.finalized or flight.cancelled):
                new = self._pin(flight, done)
                if new:
                    flight.feed.put(new)

    def _pin(self, flight: Flight, blocks: list[int]) -> list:
        """(logical, physical) pairs of `blocks` (physical, by logical index) not handed over yet,
        each referenced until the transfer returns."""
        new = list(enumerate(blocks))[flight.sent:]
        for _, b in new:
            self.engine.kv.allocator.incref(b)
        flight.pinned += [b for _, b in new]
        flight.sent = max(flight.sent, len(blocks))
        return new

    def _finalize(self, rid: str, flight: Flight) -> None:
        """The prompt is computed: the last blocks and the decode state close the stream."""
        req = flight.request = self.engine.prefilled.pop(rid)
        self.targets.pop(rid, None)
        s = req.seqs[0]
        blocks = self.engine.kv.table(s.seq_id).blocks[:-(-s.num_computed // self.engine.config.block_size)]
        last = self._pin(flight, blocks)  # the partial last block too
        flight.feed.put((last, DecodeState(list(s.token_ids), req.params.to_dict(), len(s.output_ids))))
        flight.finalized = True
