"""Sampling parameters: one frozen dataclass with one set of bounds, used by the HTTP layer,
the engine and every wire that carries a request (the KV manifest's decode state included).
Constructing one validates it; a bad field raises ValueError naming the field.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, fields

MAX_N = 16                 # choices (n) and beam width per request
MAX_TEMPERATURE = 100.0
MAX_STOP_STRINGS = 4
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_SEED = 2**63           # seeds are in [0, MAX_SEED)
MAX_TOKEN_ID = 0xFFFFFFFF
MAX_TOKENS = 1 << 24       # max_tokens / min_tokens ceiling (the model's context bounds it further)
MAX_TOP_K = MAX_TOKEN_ID + 1  # top_k ceiling here; the HTTP edge bounds it by the vocabulary
MAX_LOGPROBS = 20          # top logprobs per token (as OpenAI)


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _utf8(s: str) -> bool:
    try:
        s.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings.

    max_tokens: tokens to generate at most (>= 1).
    temperature: 0 means greedy; otherwise logits are divided by it (0..MAX_TEMPERATURE).
    top_p: nucleus mass kept (0 < top_p <= 1).
    top_k: keep the k most likely tokens (0 or -1: all).
    seed: makes sampled output reproducible; None draws one at request creation.
    stop_token_ids: generation ends after any of these (it is included in the output ids).
    stop: strings that end generation; the text is cut before the stop string.
    n: independent samples sharing the prompt's blocks (1..MAX_N).
    beam_width: > 1 runs beam search (greedy, length-normalised) instead of sampling.
    ignore_eos: keep going past the model's EOS token.
    min_tokens: no EOS, stop token or stop string ends generation before this many tokens (vLLM);
        the sampler masks the stop ids until then.
    logprobs: None, or return each sampled token's log-probability (of the model's raw
        distribution) with this many top alternatives (0..MAX_LOGPROBS).
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
    min_tokens: int = 0
    logprobs: int | None = None

    def __post_init__(self) -> None:
        # lists (from msgpack or JSON) become tuples: the params stay hashable and immutable
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop", tuple(self.stop))
        if not is_int(self.max_tokens) or not 1 <= self.max_tokens <= MAX_TOKENS:
            raise ValueError(f"max_tokens must be an integer in 1..{MAX_TOKENS}, got {self.max_tokens!r}")
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in 0..max_tokens, got {self.min_tokens!r}")
        if self.logprobs is not None and not (is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be None or an integer in 0..{MAX_LOGPROBS}, "
                             f"got {self.logprobs!r}")
        for name, lo, hi in (("temperature", 0.0, MAX_TEMPERATURE), ("top_p", 0.0, 1.0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or not lo <= v <= hi:
                raise ValueError(f"{name} must be a number in [{lo:g}, {hi:g}], got {v!r}")
        if self.top_p == 0:
            raise ValueError("top_p must be in (0, 1], got 0")
        if not is_int(self.top_k) or not -1 <= self.top_k <= MAX_TOP_K:
            raise ValueError(f"top_k must be -1, 0 or a positive integer <= {MAX_TOP_K}, got {self.top_k!r}")
        if not is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be an integer in 1..{MAX_N}, got {self.n!r}")
        if not is_int(self.beam_width) or not 1 <= self.beam_width <= MAX_N:
            raise ValueError(f"beam_width must be an integer in 1..{MAX_N}, got {self.beam_width!r}")
        if self.beam_width > 1 and self.n > self.beam_width:
            raise ValueError(f"n ({self.n}) cannot exceed beam_width ({self.beam_width})")
        if self.seed is not None and not (is_int(self.seed) and 0 <= self.seed < MAX_SEED):
            raise ValueError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        if len(self.stop) > MAX_STOP_STRINGS or any(
                not isinstance(s, str) or not 0 < len(s) <= MAX_STOP_STRING_CHARS for s in self.stop):
            raise ValueError(f"stop takes at most {MAX_STOP_STRINGS} non-empty strings of at most "
                             f"{MAX_STOP_STRING_CHARS} characters")
        if not all(_utf8(s) for s in self.stop):
            raise ValueError("stop strings must be valid Unicode (no lone surrogates)")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS or any(
                not is_int(t) or not 0 <= t <= MAX_TOKEN_ID for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} token ids in "
                             f"0..{MAX_TOKEN_ID}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a boolean, got {self.ignore_eos!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def with_seed(self) -> SamplingParams:
        """A copy with a concrete seed (drawn now when none was given)."""
        if self.seed is not None:
            return self
        return SamplingParams(**{**asdict(self), "seed": random.getrandbits(62)})

    def to_dict(self) -> dict:
        """Plain, msgpack-safe fields (tuples as lists)."""
        d = {name: getattr(self, name) for name in FIELD_ORDER}  # every value immutable: no deep copy
        d["stop_token_ids"] = list(self.stop_token_ids)
        d["stop"] = list(self.stop)
        return d

    @staticmethod
    def from_dict(d) -> SamplingParams:
        """Validated params from a peer's map; unknown or missing keys raise ValueError."""
        if not isinstance(d, dict):
            raise ValueError(f"sampling parameters must be a map, got {type(d).__name__}")
        unknown = set(d) - FIELD_NAMES
        if unknown:
            raise ValueError(f"unknown field(s) {sorted(map(str, unknown))[:5]}")
        try:
            return SamplingParams(**d)
        except TypeError as e:  # e.g. a list where a number belongs, compared with <
            raise ValueError(f"bad sampling parameters: {e}") from None


FIELD_ORDER = tuple(f.name for f in fields(SamplingParams))  # to_dict's key order (the wire's)
FIELD_NAMES = frozenset(FIELD_ORDER)
