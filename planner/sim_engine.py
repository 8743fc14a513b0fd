"""One simulated engine: its queues, its chunked steps and its memory. Memory is a real
kvcache.allocator.BlockAllocator: a job reserves every block it will ever need when it is admitted
(prompt blocks on a prefill worker; prompt + output blocks where it decodes: an assumption, the
real engine grows tables a block at a time and preempts), sharing the full blocks of a cached
shared prefix (`acquire_cached`), registering them once computed, and freeing tail-first when done.
A job that does not fit waits at the head of its queue (first come, first served); one that could
never fit (more blocks than the pool) is refused by the caller (`fits`). A step is planned as the
engine's scheduler does (engine.scheduler, Sarathi / vLLM v1): every decoding sequence one token,
then chunks of prompts already prefilling, then new admissions, within `step_budget` tokens.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from kvcache.allocator import BlockAllocator
from planner.workload import Req


@dataclass(eq=False)
class Job:
    req: Req
    reserve_tokens: int            # tokens whose blocks this engine reserves for the job
    remaining: int = 0             # prompt tokens still to compute here (0: importing or decoding)
    generated: int = 0             # output tokens produced so far
    blocks: list[int] = field(default_factory=list)
    cached_tokens: int = 0         # prompt tokens found in this engine's prefix cache at admission

    @property
    def context(self) -> int:
        return self.req.prompt_tokens + self.generated


def prefix_hashes(req: Req, block_size: int) -> list[int]:
    """One hash per full block of the request's shared prefix (a chain: block i names blocks 0..i)."""
    if not req.prefix_id:
        return []
    return [hash((req.prefix_id, i)) & ((1 << 62) - 1) for i in range(req.prefix_tokens // block_size)]


@dataclass
class Plan:
    decode: list[Job]
    chunks: list[tuple[Job, int]]

    @property
    def empty(self) -> bool:
        return not self.decode and not self.chunks


class SimEngine:
    def __init__(self, name: str, role: str, num_blocks: int, block_size: int, step_budget: int,
                 max_num_seqs: int = 256):
        self.name, self.role = name, role          # role: prefill, decode or colocated
        self.alloc = BlockAllocator(num_blocks)
        self.block_size, self.step_budget, self.max_num_seqs = block_size, step_budget, max_num_seqs
        self.waiting: deque[Job] = deque()         # to prefill here, not admitted yet
        self.importing: deque[Job] = deque()       # prefilled elsewhere, waiting for blocks here
        self.prefilling: list[Job] = []
        self.running: list[Job] = []
        self.busy = False
        self.waited_for_memory = 0                 # admissions deferred because the pool was full
        self.reported = (num_blocks, 0)            # (free or cached blocks, -queue) of its last report
        self.reported_ms = 0.0                     # when it last reported (engines report as they start)

    def report(self, now_ms: float) -> None:
        """What the worker's report tells the router: its state after the step it follows."""
        self.reported, self.reported_ms = (self.alloc.num_available, -len(self.waiting)), now_ms

    # ---- memory -------------------------------------------------------------------------
    def blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_size)

    def fits(self, tokens: int) -> bool:
        return self.blocks_for(tokens) <= self.alloc.num_blocks

    def cached_tokens(self, req: Req) -> int:
        """Prompt tokens whose blocks this engine's prefix cache holds (leading chain only)."""
        n = 0
        for h in prefix_hashes(req, self.block_size):
            if self.alloc.lookup(h) is None:
                break
            n += 1
        return min(n * self.block_size, req.prompt_tokens - 1)  # at least one token is computed

    def reserve(self, job: Job) -> bool:
        """Take the job's blocks (cached prefix blocks shared); False, and nothing taken, if short."""
        hashes = prefix_hashes(job.req, self.block_size)[:self.cached_tokens(job.req) // self.block_size]
        shared = [self.alloc.acquire_cached(h) for h in hashes]
        fresh = self.alloc.allocate_many(max(0, self.blocks_for(job.reserve_tokens) - len(shared)))
        if fresh is None:
            self.alloc.free_many(list(reversed(shared)))
            self.waited_for_memory += 1
            return False
        job.blocks = [b for b in shared if b is not None] + fresh
        job.cached_tokens = len(shared) * self.block_size
        return True

    def register_prefix(self, job: Job) -> None:
        for h, b in zip(prefix_hashes(job.req, self.block_size), job.blocks):
            self.alloc.register(b, h)      # False when another block holds it already: fine

    def release(self, job: Job) -> None:
        self.alloc.free_many(list(reversed(job.blocks)))  # tail first: the prefix is evicted last
        job.blocks = []

    # ---- steps --------------------------------------------------------------------------
    @property
    def load(self) -> int:
        return len(self.waiting) + len(self.importing) + len(self.prefilling) + len(self.running)

    def plan(self) -> Plan:
        decode = list(self.running) if self.role != "prefill" else []
        budget, chunks = self.step_budget - len(decode), []
        for job in self.prefilling:
            if budget <= 0:
                break
            take = min(job.remaining, budget)
            chunks.append((job, take))
            budget -= take
        while self.waiting and budget > 0 and len(self.prefilling) + len(self.running) < self.max_num_seqs:
            job = self.waiting[0]
            if not self.reserve(job):
                break                      # NOTE: head of line waits for memory; later jobs wait behind it
            self.waiting.popleft()
            job.remaining = job.req.prompt_tokens - job.cached_tokens
            self.prefilling.append(job)
            take = min(job.remaining, budget)
            chunks.append((job, take))
            budget -= take
        return Plan(decode, chunks)
