"""Beam search over the paged cache (greedy, length-normalised scores).

Each step expands every live beam by its top 2k tokens, keeps the best k continuations by
summed log-probability, and maps them back onto sequences: a parent's first survivor reuses
the parent's sequence, further survivors fork it (sharing every block, +1 ref each) and a
parent with no survivor is pruned, releasing its blocks so the shared prefix's count drops.
A continuation ending in a stop token becomes a finished hypothesis scored by
sum(logprob) / length ** length_penalty; the request ends when k hypotheses are finished and
no live beam can still reach a better score than the worst of them (see `_best_reachable`), or
at max_tokens.
"""

from __future__ import annotations

import torch

from engine.sequence import Request, Sequence
from kvcache.manager import KVCacheManager

LENGTH_PENALTY = 1.0


def _norm(score: float, length: int) -> float:
    return score / max(length, 1) ** LENGTH_PENALTY


def beam_step(req: Request, rows: dict[int, torch.Tensor], kv: KVCacheManager) -> None:
    """Advance the request's beams given each live beam's logits row (V,), keyed by seq_id."""
    k = req.params.beam_width
    beams = req.live_seqs
    cands: list[tuple[float, Sequence, int]] = []
    for b in beams:
        logp = torch.log_softmax(rows[b.seq_id].float(), dim=-1)  # (V,)
        top = torch.topk(logp, min(2 * k, logp.shape[-1]))
        cands += [(b.cum_logprob + float(v), b, int(t)) for v, t in zip(top.values, top.indices)]
    cands.sort(key=lambda c: -c[0])

    survivors: list[tuple[float, Sequence, int]] = []
    for score, parent, tok in cands:
        if len(survivors) == k:
            break
        if tok in req.stop.stop_ids:
            hyp = Sequence(index=-1, prompt_ids=req.prompt_ids, output_ids=parent.output_ids + [tok],
                           cum_logprob=score, finish_reason="stop")
            req.finished_beams.append(hyp)
            continue
        survivors.append((score, parent, tok))

    by_parent: dict[int, list[tuple[float, int]]] = {}
    for score, parent, tok in survivors:
        by_parent.setdefault(parent.seq_id, []).append((score, tok))
    new_beams: list[Sequence] = []
    for parent in beams:
        kids = by_parent.get(parent.seq_id, [])
        if not kids:
            kv.free(parent.seq_id)  # pruned: its private blocks go back, shared counts drop
            continue
        for score, tok in kids[1:]:
            child = Sequence(index=-1, prompt_ids=parent.prompt_ids, output_ids=parent.output_ids + [tok],
                             cum_logprob=score)
            kv.fork(parent.seq_id, child.seq_id)
            new_beams.append(child)
        parent.output_ids.append(kids[0][1])
        parent.cum_logprob = kids[0][0]
        new_beams.append(parent)
    for i, b in enumerate(new_beams):
        b.index = i
    req.seqs = new_beams
    req.forked = True

    length = len(new_beams[0].output_ids) if new_beams else 0
    at_limit = length >= req.params.max_tokens
    if at_limit or not new_beams or _done(req):
        for b in new_beams:
            b.finish_reason = "length" if at_limit else "stop"
            req.finished_beams.append(b)
            kv.free(b.seq_id)
        req.seqs = []


def _best_reachable(beam: Sequence, max_tokens: int) -> float:
    """The highest length-normalised score the live beam can still reach. Log-probabilities are
    <= 0, so its summed score can only fall, while the length that divides it can grow to
    max_tokens: for a negative sum the normalised score *rises* with length, so the bound is the
    sum over the longest reachable length (today's normalised score is not an upper bound)."""
    if beam.cum_logprob >= 0:
        return _norm(beam.cum_logprob, len(beam.output_ids))
    return _norm(beam.cum_logprob, max(max_tokens, len(beam.output_ids)))


def _done(req: Request) -> bool:
    """True when k hypotheses are finished and no live beam can still beat the k-th best."""
    k = req.params.beam_width
    if len(req.finished_beams) < k:
        return False
    worst = sorted(_norm(h.cum_logprob, len(h.output_ids)) for h in req.finished_beams)[-k]
    best_live = max(_best_reachable(b, req.params.max_tokens) for b in req.live_seqs)
    return best_live <= worst


def best_hypotheses(req: Request) -> list[Sequence]:
    """The request's n best finished hypotheses, best first, re-indexed 0..n-1."""
    ranked = sorted(req.finished_beams, key=lambda h: -_norm(h.cum_logprob, len(h.output_ids)))
    out = ranked[:req.params.n]
    for i, h in enumerate(out):
        h.index = i
    return out
