"""Iteration-level scheduler with chunked prefill: which tokens run in the next step, and who
gets preempted.

A step has a token budget (`max_num_batched_tokens`), spent as in vLLM v1 / Sarathi: (1) every
running sequence that has sampled a token gets a slot for it and costs one token, the latest-
arrived running requests preempted when blocks run out (recompute: drop the blocks and requeue;
swap: move them to the host pool); (2) running requests whose prompt is not fully computed yet
continue it with a chunk of what the budget has left; (3) swapped requests come back while
blocks allow; (4) waiting requests are admitted first-come first-served while blocks,
max_num_seqs and the budget allow, each starting with a chunk. A long prompt therefore shares
steps with running decodes instead of stalling them. An admitted request's blocks are all
allocated at admission; its table's `num_computed` says how far its prefill has come. Requests
move as a whole (all their sequences); one with several live sequences (a recompute after n > 1
or beam forks) prefills in one piece, so its sequences sample together.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from engine.sequence import Request, Sequence, Status
from engine.step_pacer import StepPacer
from kvcache.manager import KVCacheManager

log = logging.getLogger(__name__)


@dataclass
class SchedulerConfig:
    """max_num_seqs: sequences resident at once; max_num_batched_tokens: tokens per step (one per
    decoding sequence plus prefill chunks); enable_chunked_prefill: split prompts across steps
    (off: a prompt prefills whole, alone when it is over the budget); preemption_mode:
    'recompute' or 'swap'; step_target_s: > 0 sizes each step's budget so the step takes about
    this long, as measured on the steps run so far (engine.step_pacer), never over
    max_num_batched_tokens; 0 keeps the fixed budget (deterministic chunking)."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    preemption_mode: str = "recompute"
    enable_chunked_prefill: bool = True
    step_target_s: float = 0.0

    def __post_init__(self) -> None:
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")


@dataclass
class Schedule:
    decode: list[tuple[Request, Sequence]] = field(default_factory=list)  # one new token each
    prefill: list[tuple[Request, Sequence, int]] = field(default_factory=list)  # (.., tokens this step)

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode

    @property
    def num_tokens(self) -> int:
        return len(self.decode) + sum(n for _, _, n in self.prefill)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager):
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        self.preemptions = 0
        self.swap_fallbacks = 0  # swap asked for, host pool full, recomputed instead
        self.pacer = StepPacer(config.step_target_s, config.max_num_batched_tokens)  # the engine feeds it

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

    def uncomputed(self, seq: Sequence) -> int:
        """Tokens of the sequence that have a slot but no K/V yet."""
        table = self.kv.table(seq.seq_id)
        return table.num_tokens - table.num_computed

    # ---- the step's plan ----------------------------------------------------------------
    def schedule(self) -> Schedule:
        plan = Schedule()
        preempted, prefilling = self._grow_running(plan)
        budget = self.pacer.budget() - len(plan.decode)
        budget = self._continue_prefills(plan, prefilling, budget)
        if not preempted:
            self._swap_in()
        if not preempted and not self.swapped:
            self._admit(plan, budget)
        return plan

    def _grow_running(self, plan: Schedule) -> tuple[bool, list[Request]]:
        """Give each sequence that sampled a token a slot for it; preempt on shortage. Returns
        whether it preempted, and the running requests that still have prompt tokens to compute."""
        preempted = False
        prefilling: list[Request] = []
        self.running.sort(key=lambda r: r.arrival)
        tables = self.kv.tables
        i = 0
        while i < len(self.running):
            req = self.running[i]
            grow, pending = [], False
            for s in req.seqs:
                if s.finish_reason is None:
                    table = tables[s.seq_id]
                    if table.num_tokens < s.num_tokens:
                        grow.append(s)
                    elif table.num_computed < table.num_tokens:
                        pending = True
            need = sum(self.kv.blocks_needed_to_append(s.seq_id, 1) for s in grow)
            while need > self.kv.available() and self.running[-1] is not req:
                self._preempt(self.running.pop())
                preempted = True
            if need > self.kv.available():
                self.running.pop(i)
                self._preempt(req)
                preempted = True
                continue
            for s in grow:
                table = tables[s.seq_id]
                if not self.kv.append(s.seq_id, s.output_ids[table.num_tokens - s.num_tokens:]):
                    raise RuntimeError("append failed after the availability check")
                if table.num_tokens - table.num_computed == 1:
                    plan.decode.append((req, s))
                else:
                    pending = True
            if pending:
                prefilling.append(req)
            i += 1
        return preempted, prefilling

    def _continue_prefills(self, plan: Schedule, prefilling: list[Request], budget: int) -> int:
        """Next chunks of running requests whose prompt is not fully computed; returns the budget left."""
        decoding = {s.seq_id for _, s in plan.decode}
        for req in prefilling:
            seqs = [s for s in req.live_seqs if s.seq_id not in decoding and self.uncomputed(s) > 0]
            if seqs and budget > 0:
                budget = self._add_chunks(plan, req, seqs, budget, alone_ok=False)
        return budget

    def _add_chunks(self, plan: Schedule, req: Request, seqs: list[Sequence], budget: int,
                    alone_ok: bool) -> int:
        """Schedule the request's uncomputed tokens within `budget`; returns the budget left. A
        request that cannot be split runs whole only if it fits, or alone (alone_ok, empty plan)."""
        want = [self.uncomputed(s) for s in seqs]
        if self.config.enable_chunked_prefill and len(seqs) == 1:
            take = min(want[0], budget)
            plan.prefill.append((req, seqs[0], take))
            return budget - take
        if sum(want) > budget and not (alone_ok and plan.empty):
            return budget
        plan.prefill += [(req, s, n) for s, n in zip(seqs, want)]
        return budget - sum(want)

    def make_room(self, blocks: int) -> int:
        """Preempt running requests, latest admitted first, until `blocks` are available (a decode
        worker keeping the room it promised a migration); returns how many were preempted."""
        n = 0
        while self.kv.allocator.num_available < blocks and self.running:
            self._preempt(self.running.pop())
            n += 1
        return n

    def _preempt(self, req: Request) -> None:
        req.num_preemptions += 1
        self.preemptions += 1
        if self.config.preemption_mode == "swap":
            if self.kv.swap_out_group([s.seq_id for s in req.live_seqs]):
                req.status = Status.SWAPPED
                self.swapped.append(req)
                return
            self.swap_fallbacks += 1  # host pool full: recompute instead, and count it
            log.warning("swap space full: request %s preempted by recompute instead", req.request_id)
        for s in req.live_seqs:
            if s.seq_id in self.kv.tables:
                self.kv.free(s.seq_id)
        req.status = Status.WAITING
        self.waiting.appendleft(req)

    def _swap_in(self) -> None:
        """Bring swapped requests back while their blocks fit with one block to spare for every
        running sequence (each may need a new block for its next token)."""
        while self.swapped:
            req = self.swapped[0]
            ids = [s.seq_id for s in req.live_seqs]
            need = self.kv.swap_in_blocks(ids)
            reserve = sum(len(r.live_seqs) for r in self.running) + len(req.live_seqs)
            if need + reserve > self.kv.available():
                return
            if not self.kv.swap_in_group(ids):
                raise RuntimeError("swap-in failed after the availability check")
            self.swapped.popleft()
            req.status = Status.RUNNING
            self.running.append(req)

    def _admit(self, plan: Schedule, budget: int) -> None:
        resident = sum(len(r.live_seqs) for r in self.running)
        while self.waiting and budget > 0:
            req = self.waiting[0]
            seqs = req.live_seqs
            if resident + max(len(seqs), req.width) > self.config.max_num_seqs:
                return
            got: list[Sequence] = []
            for s in seqs:
                if self.kv.allocate(s.seq_id, s.token_ids, req.prefix_key) is None:
                    break
                got.append(s)
            left = budget if len(got) == len(seqs) else None
            if left is not None:
                left = self._add_chunks(plan, req, seqs, budget, alone_ok=True)
            if left is None or left == budget and any(self.uncomputed(s) for s in seqs):
                for s in got:
                    self.kv.free(s.seq_id)
                return
            budget = left
            resident += len(seqs)
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
