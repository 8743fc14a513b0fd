"""The sampler (the parameters themselves are `protocol.sampling.SamplingParams`).

Randomness is counter-based: the noise for output token i of a sequence comes from a generator
seeded with (request seed, sequence index, i) alone. A sampled output is therefore reproducible
from its seed, and it does not change when the sequence is preempted and recomputed or migrated
to another worker mid-stream: nothing but the seed and the token count has to travel.
Sampling uses the exponential-race trick: argmax(p / E) with E ~ Exp(1) draws from p.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import xxhash

from protocol.sampling import MAX_N, SamplingParams  # noqa: F401  (defined once, torch-free)


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
