"""One step's sampling with the per-request extras: `min_tokens` and `logprobs`.

`sample_rows(logits, batch)` samples every row of a step as `sample_batch` does, after masking
the stop ids (EOS unless ignore_eos, plus stop_token_ids) of each sequence that has fewer than
`min_tokens` output tokens (vLLM's rule: no stop before min_tokens), and returns, for each row
whose request asked for logprobs, a `TokenLogprobs`: the sampled token's log-probability and the
top-N alternatives. NOTE: they are the log-softmax of the model's raw logits (vLLM's default
`raw_logprobs`: before temperature, top-k/top-p and the min_tokens mask), so they mean the same for
greedy and sampled requests and for evaluation tools. The log-softmax runs only over the rows
that asked: a step where no request wants logprobs pays nothing but one list comprehension.
"""

from __future__ import annotations

import torch

from engine.sampling import sample_batch
from protocol.messages import TokenLogprobs


def token_logprobs(logits: torch.Tensor, tokens: list[int], tops: list[int]) -> list[TokenLogprobs]:
    """logits (R, V) float32 raw rows, tokens[r] sampled from row r, tops[r] alternatives wanted."""
    lp = torch.log_softmax(logits.float(), dim=-1)  # (R, V)
    chosen = lp.gather(1, torch.tensor(tokens, device=lp.device)[:, None])[:, 0].tolist()  # (R,)
    k = max(tops)
    top_lp, top_ids = torch.topk(lp, k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())  # (R, k)
    top_lp, top_ids = top_lp.tolist(), top_ids.tolist()
    return [TokenLogprobs(chosen[r], top_ids[r][:n], top_lp[r][:n]) for r, n in enumerate(tops)]


def sample_rows(logits: torch.Tensor, batch: list) -> tuple[list[int], list[TokenLogprobs | None]]:
    """batch: (request, sequence, row) per logits row, in order -> (token per row, logprobs per row
    or None where the request did not ask)."""
    raw = logits
    early = [(r, sorted(req.stop.stop_ids)) for r, (req, s, _) in enumerate(batch)
             if len(s.output_ids) < req.params.min_tokens and req.stop.stop_ids]
    if early:  # a copy: the logprobs below read the raw logits
        logits = logits.clone()
        V = logits.shape[-1]
        for r, ids in early:
            logits[r, [t for t in ids if 0 <= t < V]] = float("-inf")
    tokens = sample_batch(logits, [req.params for req, _, _ in batch], [s.index for _, s, _ in batch],
                          [len(s.output_ids) for _, s, _ in batch])
    want = [r for r, (req, _, _) in enumerate(batch) if req.params.logprobs is not None]
    out: list[TokenLogprobs | None] = [None] * len(batch)
    if want:
        rows = raw if len(want) == len(batch) else raw[torch.tensor(want, device=raw.device)]
        values = token_logprobs(rows, [tokens[r] for r in want], [batch[r][0].params.logprobs for r in want])
        for r, value in zip(want, values):
            out[r] = value
    return tokens, out
