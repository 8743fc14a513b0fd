"""Sampling parameters and the sampler.

Randomness is counter-based: the noise for output token i of a sequence comes from a generator
seeded with (request seed, sequence index, i) alone. A sampled output is therefore reproducible
from its seed, and it does not change when the sequence is preempted and recomputed or migrated
to another worker mid-stream: nothing but the seed and the token count has to travel.
Sampling uses the exponential-race trick: argmax(p / E) with E ~ Exp(1) draws from p.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field

import torch
import xxhash

MAX_N = 16


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings.

    max_tokens: tokens to generate at most (>= 1).
    temperature: 0 means greedy; otherwise logits are divided by it.
    top_p: nucleus mass kept (0 < top_p <= 1).
    top_k: keep the k most likely tokens (0 or -1: all).
    seed: makes sampled output reproducible; None draws one at request creation.
    stop_token_ids: generation ends after any of these (it is included in the output ids).
    stop: strings that end generation; the text is cut before the stop string.
    n: independent samples sharing the prompt's blocks (1..MAX_N).
    beam_width: > 1 runs beam search (greedy, length-normalised) instead of sampling.
    ignore_eos: keep going past the model's EOS token.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    n: int = 1
    beam_width: int = 1
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not 0.0 <= float(self.temperature) <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not 0.0 < float(self.top_p) <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 or a positive integer, got {self.top_k!r}")
        if not isinstance(self.n, int) or not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be an integer in 1..{MAX_N}, got {self.n!r}")
        if not isinstance(self.beam_width, int) or not 1 <= self.beam_width <= MAX_N:
            raise ValueError(f"beam_width must be an integer in 1..{MAX_N}, got {self.beam_width!r}")
        if self.beam_width > 1 and self.n > self.beam_width:
            raise ValueError(f"n ({self.n}) cannot exceed beam_width ({self.beam_width})")
        if self.seed is not None and not (isinstance(self.seed, int) and 0 <= self.seed < 2**63):
            raise ValueError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def with_seed(self) -> SamplingParams:
        """A copy with a concrete seed (drawn now when none was given)."""
        if self.seed is not None:
            return self
        d = asdict(self)
        d["seed"] = random.getrandbits(62)
        return SamplingParams(**d)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["stop_token_ids"] = list(self.stop_token_ids)
        d["stop"] = list(self.stop)
        return d

    @staticmethod
    def from_dict(d: dict) -> SamplingParams:
        d = dict(d)
        d["stop_token_ids"] = tuple(d.get("stop_token_ids", ()))
        d["stop"] = tuple(d.get("stop", ()))
        return SamplingParams(**d)


def _noise_seed(seed: int, seq_index: int, position: int) -> int:
    return xxhash.xxh3_64_intdigest(f"{seed}:{seq_index}:{position}".encode()) & (2**63 - 1)


def filter_logits(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """logits: (V,) float32 -> probabilities (V,) after temperature, top-k and top-p."""
    logits = logits / p.temperature
    if p.top_k > 0 and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_p, dim=-1)
        drop = (cum - sorted_p) >= p.top_p  # keep the smallest prefix whose mass reaches top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        probs = probs / probs.sum()
    return probs


def sample_token(logits: torch.Tensor, p: SamplingParams, seq_index: int, position: int) -> int:
    """One token from logits (V,) for output position `position` of sequence `seq_index`."""
    if p.greedy:
        return int(torch.argmax(logits))
    probs = filter_logits(logits.float(), p)
    g = torch.Generator().manual_seed(_noise_seed(p.seed or 0, seq_index, position))
    noise = torch.empty(probs.shape[-1]).exponential_(generator=g).to(probs.device)  # (V,)
    return int(torch.argmax(probs / noise))


@dataclass
class StopChecker:
    """Decides when a sequence is finished: max_tokens, stop ids, EOS, stop strings."""

    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    stop_ids: set[int] = field(init=False)

    def __post_init__(self) -> None:
        self.stop_ids = set(self.params.stop_token_ids)
        if not self.params.ignore_eos:
            self.stop_ids.update(self.eos_token_ids)

    def check(self, output_ids: list[int], text: str | None) -> str | None:
        """'stop', 'length' or None (keep going), after the latest token was appended."""
        if output_ids and output_ids[-1] in self.stop_ids:
            return "stop"
        if text is not None and any(s in text for s in self.params.stop):
            return "stop"
        if len(output_ids) >= self.params.max_tokens:
            return "length"
        return None


def cut_at_stop(text: str, stops: tuple[str, ...]) -> str:
    """Text before the earliest stop string (the whole text when none occurs)."""
    cut = len(text)
    for s in stops:
        i = text.find(s)
        if i != -1:
            cut = min(cut, i)
    return text[:cut]
