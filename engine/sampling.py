"""The sampler (the parameters themselves are `protocol.sampling.SamplingParams`).

Randomness is counter-based: the noise for output token i of a sequence comes from a generator
seeded with (request seed, sequence index, i) alone. A sampled output is therefore reproducible
from its seed, and it does not change when the sequence is preempted and recomputed or migrated
to another worker mid-stream: nothing but the seed and the token count has to travel.
Sampling uses the exponential-race trick: argmax(p / E) with E ~ Exp(1) draws from p.
`sample_batch` samples every row of a step at once (greedy rows by one argmax; sampled rows with
per-row temperature, top-k and top-p, each row's own noise); `sample_token` is the one-row
reference it must agree with. Top-k keeps exactly k tokens (ties at the k-th logit go to the
lower token ids). Stop strings are checked on text decoded incrementally (`DecodedText`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import xxhash

from protocol.sampling import MAX_N, SamplingParams  # noqa: F401  (defined once, torch-free)

REPLACEMENT = "\ufffd"


def _noise_seed(seed: int, seq_index: int, position: int) -> int:
    return xxhash.xxh3_64_intdigest(f"{seed}:{seq_index}:{position}".encode()) & (2**63 - 1)


def exponential_noise(p: SamplingParams, seq_index: int, position: int, vocab: int) -> torch.Tensor:
    """(V,) float32 Exp(1) noise for output token `position` of sequence `seq_index` (CPU)."""
    g = torch.Generator().manual_seed(_noise_seed(p.seed or 0, seq_index, position))
    return torch.empty(vocab).exponential_(generator=g)


def _keep_top_k(logits: torch.Tensor, ks: torch.Tensor) -> torch.Tensor:
    """logits (R, V), ks (R,) int64 in 1..V-1 -> bool (R, V) marking exactly k_r tokens per row:
    every logit above the k-th largest, then the lowest ids among those equal to it."""
    kth = torch.topk(logits, int(ks.max()), dim=-1).values.gather(1, (ks - 1)[:, None])  # (R, 1)
    above = logits > kth  # (R, V)
    ties = logits == kth  # (R, V)
    room = ks - above.sum(-1)  # (R,) ties still to keep
    return above | (ties & (ties.cumsum(-1) <= room[:, None]))


def _top_p(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """probs (R, V), top_p (R,) -> the smallest descending prefix whose mass reaches top_p, renormalised."""
    sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)  # (R, V)
    cum = torch.cumsum(sorted_p, dim=-1)
    sorted_p = sorted_p.masked_fill((cum - sorted_p) >= top_p[:, None], 0.0)
    kept = torch.zeros_like(probs).scatter_(-1, order, sorted_p)  # (R, V)
    return kept / kept.sum(-1, keepdim=True)


def filter_logits(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """logits: (V,) float32 -> probabilities (V,) after temperature, top-k and top-p (one row)."""
    x = logits[None, :] / torch.tensor([p.temperature], dtype=logits.dtype)[:, None]  # (1, V)
    if 0 < p.top_k < x.shape[-1]:
        x = x.masked_fill(~_keep_top_k(x, torch.tensor([p.top_k])), float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if p.top_p < 1.0:
        probs = _top_p(probs, torch.tensor([p.top_p], dtype=probs.dtype))
    return probs[0]


def sample_token(logits: torch.Tensor, p: SamplingParams, seq_index: int, position: int) -> int:
    """One token from logits (V,) for output position `position` of sequence `seq_index`."""
    if p.greedy:
        return int(torch.argmax(logits))
    probs = filter_logits(logits.float(), p)
    noise = exponential_noise(p, seq_index, position, probs.shape[-1]).to(probs.device)  # (V,)
    return int(torch.argmax(probs / noise))


def sample_batch(logits: torch.Tensor, params: list[SamplingParams], seq_indices: list[int],
                 positions: list[int]) -> list[int]:
    """One token per row of logits (R, V) float32; row r belongs to sequence seq_indices[r] and is
    its output token positions[r]. Equal, row for row, to `sample_token`."""
    R, V = logits.shape
    greedy = [r for r, p in enumerate(params) if p.greedy]
    if len(greedy) == R:
        return logits.argmax(-1).tolist()
    out = [0] * R
    if greedy:
        for r, tok in zip(greedy, logits[greedy].argmax(-1).tolist()):
            out[r] = tok
    rows = [r for r, p in enumerate(params) if not p.greedy]
    ps = [params[r] for r in rows]
    temps = torch.tensor([p.temperature for p in ps], dtype=torch.float32, device=logits.device)  # (n,)
    x = logits[rows] / temps[:, None]  # (n, V)
    top_k = [i for i, p in enumerate(ps) if 0 < p.top_k < V]
    if top_k:
        ks = torch.tensor([ps[i].top_k for i in top_k], device=logits.device)  # (m,)
        x[top_k] = x[top_k].masked_fill(~_keep_top_k(x[top_k], ks), float("-inf"))
    probs = torch.softmax(x, dim=-1)  # (n, V)
    top_p = [i for i, p in enumerate(ps) if p.top_p < 1.0]
    if top_p:
        limits = torch.tensor([ps[i].top_p for i in top_p], dtype=probs.dtype, device=logits.device)
        probs[top_p] = _top_p(probs[top_p], limits)
    noise = torch.stack([exponential_noise(p, seq_indices[r], positions[r], V) for p, r in zip(ps, rows)])
    for r, tok in zip(rows, torch.argmax(probs / noise.to(probs.device), dim=-1).tolist()):
        out[r] = tok
    return out


@dataclass
class DecodedText:
    """A sequence's output text, decoded incrementally: each step decodes only a window (the
    tokens of the last settled piece plus the new ones, as vLLM's detokenizer does) and holds
    text back while it ends in an incomplete character (U+FFFD)."""

    text: str = ""
    prefix: int = 0  # window start: tokens before it are settled and out of context
    read: int = 0    # tokens whose text is in `text`

    def advance(self, tokenizer, ids: list[int]) -> int:
        """Take in ids (all output ids so far); returns where the text was before this call."""
        old = len(self.text)
        before = tokenizer.decode(ids[self.prefix:self.read])
        window = tokenizer.decode(ids[self.prefix:])
        if len(window) > len(before) and not window.endswith(REPLACEMENT):
            self.text += window[len(before):]
            self.prefix, self.read = self.read, len(ids)
        return old


@dataclass
class StopChecker:
    """Decides when a sequence is finished: max_tokens, stop ids, EOS, stop strings."""

    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    stop_ids: set[int] = field(init=False)
    longest_stop: int = field(init=False)

    def __post_init__(self) -> None:
        self.stop_ids = set(self.params.stop_token_ids)
        if not self.params.ignore_eos:
            self.stop_ids.update(self.eos_token_ids)
        self.longest_stop = max((len(s) for s in self.params.stop), default=0)

    def check(self, output_ids: list[int], text: str | None, new_from: int = 0) -> str | None:
        """'stop', 'length' or None (keep going), after the latest token was appended. text: the
        output text; new_from: where text added since the last check starts (a stop string that
        is there must end past it, so the search starts longest_stop - 1 characters earlier)."""
        if len(output_ids) < self.params.min_tokens:  # nothing stops it before min_tokens
            return None
        if output_ids and output_ids[-1] in self.stop_ids:
            return "stop"
        if text is not None:
            start = max(0, new_from - self.longest_stop + 1)
            if any(text.find(s, start) != -1 for s in self.params.stop):
                return "stop"
        if len(output_ids) >= self.params.max_tokens:
            return "length"
        return None

    def check_sequence(self, output_ids: list[int], decoded: DecodedText, tokenizer) -> str | None:
        """`check` after a sequence's newest token, stop strings searched only in the text that
        token could complete (decoded incrementally into `decoded`; none without a tokenizer)."""
        if not self.params.stop:
            return self.check(output_ids, None)
        new_from = decoded.advance(tokenizer, output_ids) if tokenizer is not None else 0
        return self.check(output_ids, decoded.text, new_from)


def cut_at_stop(text: str, stops: tuple[str, ...]) -> str:
    """Text before the earliest stop string (the whole text when none occurs)."""
    cut = len(text)
    for s in stops:
        i = text.find(s)
        if i != -1:
            cut = min(cut, i)
    return text[:cut]
