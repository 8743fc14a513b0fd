"""The batched sampler against the one-row reference, the counter-based noise it must keep, top-k
with ties, and stop strings checked on incrementally decoded text."""

import random

import torch
import xxhash

from engine.sampling import (
    DecodedText,
    SamplingParams,
    StopChecker,
    exponential_noise,
    filter_logits,
    sample_batch,
    sample_token,
)
from model_files.tokenizer import ByteTokenizer


def _old_noise(seed: int, seq_index: int, position: int, vocab: int) -> torch.Tensor:
    """The noise as engine/sampling.py drew it before batching (it must never change)."""
    key = xxhash.xxh3_64_intdigest(f"{seed}:{seq_index}:{position}".encode()) & (2**63 - 1)
    return torch.empty(vocab).exponential_(generator=torch.Generator().manual_seed(key))


def test_noise_is_unchanged():
    for seed, index, position in [(0, 0, 0), (7, 2, 31), (2**40 + 3, 5, 1000)]:
        p = SamplingParams(temperature=1.0, seed=seed)
        assert torch.equal(exponential_noise(p, index, position, 300), _old_noise(seed, index, position, 300))


def _params(rng: random.Random) -> SamplingParams:
    kind = rng.choice(["greedy", "temp", "top_k", "top_p", "both"])
    if kind == "greedy":
        return SamplingParams(temperature=0.0)
    return SamplingParams(temperature=rng.choice([0.5, 1.0, 1.7]), seed=rng.randrange(1000),
                          top_k=rng.choice([1, 5, 40]) if kind in ("top_k", "both") else 0,
                          top_p=rng.choice([0.3, 0.9]) if kind in ("top_p", "both") else 1.0)


def test_batched_sampling_reproduces_the_per_row_stream():
    rng = random.Random(3)
    gen = torch.Generator().manual_seed(3)
    for _ in range(20):
        rows = rng.randint(1, 12)
        logits = torch.randn(rows, 300, generator=gen) * 3  # (R, V)
        params = [_params(rng) for _ in range(rows)]
        indices = [rng.randrange(4) for _ in range(rows)]
        positions = [rng.randrange(100) for _ in range(rows)]
        want = [sample_token(logits[r], params[r], indices[r], positions[r]) for r in range(rows)]
        assert sample_batch(logits, params, indices, positions) == want


def test_a_seeded_stream_does_not_depend_on_its_batch_neighbours():
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(6, 300, generator=gen)
    mine = SamplingParams(temperature=0.9, top_p=0.95, seed=42)
    others = [SamplingParams(temperature=1.3, top_k=3, seed=i) for i in range(5)]
    alone = sample_batch(logits[:1], [mine], [1], [17])[0]
    together = sample_batch(logits, [mine] + others, [1, 0, 0, 1, 2, 3], [17, 2, 3, 4, 5, 6])[0]
    assert alone == together


def test_top_k_keeps_exactly_k_tokens_even_with_ties():
    logits = torch.tensor([1.0, 5.0, 3.0, 3.0, 3.0, 0.5])
    probs = filter_logits(logits, SamplingParams(temperature=1.0, top_k=2))
    assert torch.nonzero(probs).flatten().tolist() == [1, 2]  # the tie at the 2nd logit: lowest id
    probs = filter_logits(logits, SamplingParams(temperature=1.0, top_k=4))
    assert torch.nonzero(probs).flatten().tolist() == [1, 2, 3, 4]
    batch = [SamplingParams(temperature=1.0, top_k=2, seed=s) for s in range(50)]
    drawn = sample_batch(logits.expand(50, 6).clone(), batch, [0] * 50, list(range(50)))
    assert set(drawn) <= {1, 2} and 2 in drawn


def test_greedy_rows_take_the_first_maximum():
    logits = torch.tensor([[0.0, 2.0, 2.0], [3.0, 1.0, 3.0]])
    assert sample_batch(logits, [SamplingParams(temperature=0.0)] * 2, [0, 0], [0, 0]) == [1, 0]


def test_incremental_stop_strings_match_decoding_the_whole_output():
    """Byte tokens: a stop string across tokens and a multi-byte character split across tokens."""
    tok = ByteTokenizer(512, 256, (257,))
    text = "ab é STOP?x"  # 'é' is two bytes, so one step ends mid-character
    ids = list(text.encode())
    for stop in (("STOP",), ("é S",), ("zz",), ("b", "x")):
        params = SamplingParams(max_tokens=100, stop=stop)
        checker, decoded = StopChecker(params, (257,)), DecodedText()
        for n in range(1, len(ids) + 1):
            got = checker.check_sequence(ids[:n], decoded, tok)
            full = tok.decode(ids[:n])
            assert got == ("stop" if any(s in full for s in stop) else None), (stop, n)
            if got:
                break
        assert decoded.text == tok.decode(ids[:n])[:len(decoded.text)]
