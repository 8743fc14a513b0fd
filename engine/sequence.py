"""Requests and their sequences as the engine tracks them.

A `Request` (a sequence group) owns 1..n `Sequence`s: one while its prompt waits for prefill,
n after parallel sampling forks it, up to beam_width under beam search. A sequence's tokens
are the prompt followed by its outputs; its KV lives in the cache manager under `seq_id`.
The scheduler moves whole requests between the waiting, running and swapped queues, so the
sequences of one request always step together.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

from engine.sampling import DecodedText, SamplingParams, StopChecker

_ids = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"      # needs a prefill (first time, or recompute after preemption)
    RUNNING = "running"      # resident, decoding
    SWAPPED = "swapped"      # blocks in the host pool
    FINISHED = "finished"


@dataclass
class Sequence:
    """One token stream. `index` is its position among the request's choices."""

    index: int
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    seq_id: int = field(default_factory=lambda: next(_ids))
    finish_reason: str | None = None
    cum_logprob: float = 0.0     # beam search score (sum of token log-probs)
    num_computed: int = 0        # tokens whose K/V are in the cache after the last step (prefill
                                 # progress: blocks below num_computed // block_size are complete)
    decoded: DecodedText = field(default_factory=DecodedText)  # output text, for stop strings

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def text(self) -> str:
        """Output text decoded so far (kept only while stop strings are checked)."""
        return self.decoded.text

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class Request:
    """A sequence group: the unit the scheduler admits, preempts and finishes."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    stop: StopChecker
    arrival: float
    seqs: list[Sequence] = field(default_factory=list)
    status: Status = Status.WAITING
    forked: bool = False          # n > 1 / beam children exist
    num_preemptions: int = 0
    first_token_time: float | None = None
    finished_beams: list[Sequence] = field(default_factory=list)
    cached_tokens: int | None = None  # prompt tokens the prefix cache supplied (set at its first chunk)
    prefix_key: str | None = None     # extra key of its prefix-cache hashes (a client's cache_salt, digested)

    @property
    def live_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.finished]

    @property
    def is_beam(self) -> bool:
        return self.params.beam_width > 1

    @property
    def width(self) -> int:
        """How many sequences the request runs at once after its first token."""
        return self.params.beam_width if self.is_beam else self.params.n

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


@dataclass
class StepOutput:
    """What one step produced for one sequence: its new tokens since the last report."""

    request_id: str
    index: int
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    text_delta: str = ""
    logprobs: object = None  # protocol.messages.TokenLogprobs of the new token, when the request asked
