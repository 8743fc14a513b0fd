"""What a request must satisfy before an engine takes it: token ids inside the vocabulary, prompt
plus output within the model's context, a worst case that fits the KV pool, and beam search only
on a colocated engine. `RequestError` is the typed refusal (a ValueError: the HTTP layer answers
400 with its message).
"""

from __future__ import annotations

from engine.sampling import SamplingParams


class RequestError(ValueError):
    """A request the engine cannot run (bad prompt, ids outside the vocabulary, too long)."""


def validate_prompt(prompt_ids: list[int], params: SamplingParams, *, vocab: int, context: int,
                    block_size: int, num_blocks: int, role: str) -> None:
    """Raise RequestError unless an engine with these limits can run the request."""
    if not prompt_ids:
        raise RequestError("prompt is empty")
    bad = [t for t in prompt_ids if not isinstance(t, int) or not 0 <= t < vocab]
    if bad:
        raise RequestError(f"prompt token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
    if len(prompt_ids) + params.max_tokens > context:
        raise RequestError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) "
                           f"exceeds the model's context of {context} tokens")
    width = max(params.n, params.beam_width)
    need = width * (-(-(len(prompt_ids) + params.max_tokens) // block_size))
    if need > num_blocks:
        raise RequestError(f"request needs up to {need} KV blocks; the pool has {num_blocks}")
    if role != "colocated" and params.beam_width > 1:
        raise RequestError("beam search runs on colocated engines only")
