"""Routing policies: which worker of a role takes the next request.

`round_robin` cycles; `least_loaded` picks the most free blocks, then the shortest queue;
`prefix_aware` picks the prefill worker that most likely holds the longest cached prefix of
the prompt (the router remembers the full-block prefix hashes it sent to each worker, bounded
LRU), falling back to least loaded. Workers are described by `WorkerLoad` snapshots the
cluster refreshes; dead workers are never picked.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass

from protocol.prefix_hash import hash_chain

POLICIES = ("round_robin", "least_loaded", "prefix_aware")


@dataclass
class WorkerLoad:
    worker_id: str
    free_blocks: int = 0
    queue_depth: int = 0
    block_size: int = 16
    alive: bool = True


class NoWorkerError(RuntimeError):
    """No live worker of the role asked for (the API answers 503)."""


class Router:
    def __init__(self, policy: str = "least_loaded", remember: int = 4096):
        if policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {POLICIES}, got {policy!r}")
        self.policy = policy
        self._rr = itertools.count()
        self._remember = remember
        self._seen: dict[str, OrderedDict[int, None]] = {}

    def pick(self, workers: list[WorkerLoad], role: str, prompt_ids: list[int] | None = None,
             exclude: set[str] = frozenset()) -> str:
        live = [w for w in workers if w.alive and w.worker_id not in exclude]
        if not live:
            raise NoWorkerError(f"no live {role} worker")
        if self.policy == "round_robin":
            return live[next(self._rr) % len(live)].worker_id
        if self.policy == "prefix_aware" and prompt_ids is not None:
            best = max(live, key=lambda w: (self._match(w, prompt_ids), w.free_blocks, -w.queue_depth))
            if self._match(best, prompt_ids) > 0:
                self.remember(best.worker_id, prompt_ids, best.block_size)
                return best.worker_id
        w = max(live, key=lambda w: (w.free_blocks, -w.queue_depth))
        if self.policy == "prefix_aware" and prompt_ids is not None:
            self.remember(w.worker_id, prompt_ids, w.block_size)
        return w.worker_id

    @staticmethod
    def _hashes(prompt_ids: list[int], block_size: int) -> list[int]:
        return hash_chain(prompt_ids, block_size, stop=(len(prompt_ids) - 1) // block_size)

    def _match(self, w: WorkerLoad, prompt_ids: list[int]) -> int:
        seen = self._seen.get(w.worker_id)
        if not seen:
            return 0
        n = 0
        for h in self._hashes(prompt_ids, w.block_size):
            if h not in seen:
                break
            n += 1
        return n

    def cached_tokens(self, w: WorkerLoad, prompt_ids: list[int]) -> int:
        """Prompt tokens, in full blocks, this router believes `w` caches: the longest prefix it sent
        there (an estimate: the worker may have evicted it since; coordinator.decide reads it)."""
        return self._match(w, prompt_ids) * w.block_size

    def remember(self, worker_id: str, prompt_ids: list[int], block_size: int) -> None:
        seen = self._seen.setdefault(worker_id, OrderedDict())
        for h in self._hashes(prompt_ids, block_size):
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self._remember:
            seen.popitem(last=False)

    def forget(self, worker_id: str) -> None:
        self._seen.pop(worker_id, None)
