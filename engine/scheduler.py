"""Iteration-level scheduler: which requests run in the next step, and who gets preempted.

Each step it (1) gives every running sequence a slot for its newest token, preempting the
latest-arrived running requests when blocks run out (recompute: drop the blocks and requeue;
swap: move them to the host pool); (2) swaps requests back in while blocks allow; (3) admits
waiting requests first-come first-served while blocks, the per-step prefill-token budget and
max_num_seqs allow. Requests move as a whole (all their sequences), so a sequence group never
half-runs. It returns the sequences to compute; the engine runs the model on them.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from engine.sequence import Request, Sequence, Status
from kvcache.manager import KVCacheManager

log = logging.getLogger(__name__)


@dataclass
class SchedulerConfig:
    """max_num_seqs: sequences resident at once; max_num_batched_tokens: prefill tokens per
    step (a single longer prompt still runs, alone); preemption_mode: 'recompute' or 'swap'."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    preemption_mode: str = "recompute"

    def __post_init__(self) -> None:
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")


@dataclass
class Schedule:
    prefill: list[tuple[Request, Sequence]] = field(default_factory=list)
    decode: list[tuple[Request, Sequence]] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager):
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        self.preemptions = 0
        self.swap_fallbacks = 0  # swap asked for, host pool full, recomputed instead

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def add_running(self, req: Request) -> None:
        """A request whose KV was imported (decode worker): it decodes from the next step."""
        req.status = Status.RUNNING
        self.running.append(req)

    def remove(self, req: Request) -> None:
        for q in (self.waiting, self.running, self.swapped):
            if req in q:
                q.remove(req)

    # ---- the step's plan ----------------------------------------------------------------
    def schedule(self) -> Schedule:
        plan = Schedule()
        preempted = self._grow_running(plan)
        if not preempted:
            self._swap_in()
        if not preempted and not self.swapped:
            self._admit(plan)
        return plan

    def _grow_running(self, plan: Schedule) -> bool:
        """Give each running sequence a slot for its newest token; preempt on shortage."""
        preempted = False
        self.running.sort(key=lambda r: r.arrival)
        i = 0
        while i < len(self.running):
            req = self.running[i]
            seqs = [s for s in req.live_seqs if self.kv.table(s.seq_id).num_tokens < s.num_tokens]
            need = sum(self.kv.blocks_needed_to_append(s.seq_id, 1) for s in seqs)
            while need > self.kv.allocator.num_available and self.running[-1] is not req:
                self._preempt(self.running.pop())
                preempted = True
            if need > self.kv.allocator.num_available:
                self.running.pop(i)
                self._preempt(req)
                preempted = True
                continue
            for s in seqs:
                if not self.kv.append(s.seq_id, s.token_ids[self.kv.table(s.seq_id).num_tokens:]):
                    raise RuntimeError("append failed after the availability check")
                plan.decode.append((req, s))
            i += 1
        return preempted

    def _preempt(self, req: Request) -> None:
        req.num_preemptions += 1
        self.preemptions += 1
        if self.config.preemption_mode == "swap":
            done = []
            for s in req.live_seqs:
                if not self.kv.swap_out(s.seq_id):
                    break
                done.append(s)
            if len(done) == len(req.live_seqs):
                req.status = Status.SWAPPED
                self.swapped.append(req)
                return
            for s in done:  # host pool full: undo nothing, fall back to recompute, count it
                self.kv.free(s.seq_id)
            self.swap_fallbacks += 1
            log.warning("swap space full: request %s preempted by recompute instead", req.request_id)
        for s in req.live_seqs:
            if s.seq_id in self.kv.tables:
                self.kv.free(s.seq_id)
        req.status = Status.WAITING
        self.waiting.appendleft(req)

    def _swap_in(self) -> None:
        while self.swapped:
            req = self.swapped[0]
            need = sum(len(self.kv.table(s.seq_id).blocks) for s in req.live_seqs)
            if need + len(self.running) > self.kv.allocator.num_available:
                return
            for s in req.live_seqs:
                if not self.kv.swap_in(s.seq_id):
                    raise RuntimeError("swap-in failed after the availability check")
            self.swapped.popleft()
            req.status = Status.RUNNING
            self.running.append(req)

    def _admit(self, plan: Schedule) -> None:
        budget = self.config.max_num_batched_tokens
        resident = sum(len(r.live_seqs) for r in self.running)
        while self.waiting:
            req = self.waiting[0]
            seqs = req.live_seqs
            if resident + max(len(seqs), req.width) > self.config.max_num_seqs:
                return
            got: list[tuple[Sequence, int]] = []
            for s in seqs:
                cached = self.kv.allocate(s.seq_id, s.token_ids)
                if cached is None:
                    break
                got.append((s, cached))
            new_tokens = sum(s.num_tokens - c for s, c in got)
            if len(got) < len(seqs) or (plan.prefill and new_tokens > budget):
                for s, _ in got:
                    self.kv.free(s.seq_id)
                return
            budget -= new_tokens
            resident += len(seqs)
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            plan.prefill += [(req, s) for s in seqs]
