"""A `tokenizers.Tokenizer` built from a GGUF file's tokenizer metadata (model_files.gguf reads it).

GGUF files carry no tokenizer.json: the vocabulary (`tokenizer.ggml.tokens`), the BPE merges,
each token's type and the special ids are metadata, and `tokenizer.ggml.pre` names how text is
split before the merges apply. This builds the GPT-2 style byte-level BPE those describe
(`tokenizer.ggml.model == "gpt2"`, which Llama 3, SmolLM, Qwen and most recent Llama-family
files use): control tokens (type 3, e.g. `<|im_start|>`) become special added tokens, matched
whole in text and dropped by `decode(skip_special_tokens=True)`; user-defined tokens (type 4)
become plain added tokens; BOS is prepended only when the file says `add_bos_token`. A
SentencePiece vocabulary (`"llama"`, Llama 2 era files) is refused with `GGUFError`. No torch.
"""

from __future__ import annotations

import logging

from model_files.gguf import GGUFError

log = logging.getLogger(__name__)

CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types

# Llama 3's split: contractions, letters with one leading non-letter, numbers of up to 3 digits,
# punctuation runs, newlines, other whitespace.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_NAMES = {"llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx", "falcon3"}
_GPT2_NAMES = {None, "default", "gpt2", "gpt-2"}


def _pre_tokenizer(pre: str | None):
    """The text split `tokenizer.ggml.pre` names, followed by the byte-level mapping."""
    from tokenizers import Regex, pre_tokenizers

    if pre == "smollm":  # SmolLM's tokenizer.json: every digit alone, then GPT-2's split
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    if pre in _LLAMA3_NAMES:
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if pre not in _GPT2_NAMES:
        log.warning("GGUF pre-tokenizer %r is not known here: splitting text as GPT-2 does, which "
                    "may tokenize some text differently from llama.cpp", pre)
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def build_tokenizer(meta: dict, path: str = "GGUF file"):
    """The tokenizer `meta` (GGUFFile.tokenizer_metadata()) describes; GGUFError if unsupported."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    kind = meta.get("model")
    if kind != "gpt2":
        raise GGUFError(f"{path}: tokenizer model {kind!r} is unsupported; GGUF files with a "
                        "byte-level BPE vocabulary ('gpt2') are")
    tokens, merges = meta.get("tokens"), meta.get("merges")
    if not tokens or not merges:
        raise GGUFError(f"{path}: the tokenizer's tokens or merges are missing")
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)
    pairs = []
    for merge in merges:
        left, space, right = merge.partition(" ")
        if not space or not left or not right:
            raise GGUFError(f"{path}: malformed merge {merge!r}")
        pairs.append((left, right))
    tokenizer = Tokenizer(models.BPE(vocab, pairs, fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = _pre_tokenizer(meta.get("pre"))
    tokenizer.decoder = decoders.ByteLevel()
    types = meta.get("token_type") or [1] * len(tokens)
    control = [AddedToken(t, special=True, normalized=False)
               for t, k in zip(tokens, types) if k == CONTROL]
    user = [AddedToken(t, special=False, normalized=False)
            for t, k in zip(tokens, types) if k == USER_DEFINED]
    tokenizer.add_special_tokens(control)
    tokenizer.add_tokens(user)
    if tokenizer.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise GGUFError(f"{path}: the built tokenizer has {tokenizer.get_vocab_size(with_added_tokens=True)} "
                        f"ids, the file lists {len(tokens)} tokens (duplicate token strings?)")
    bos = meta.get("bos_token_id")
    steps = [processors.ByteLevel(trim_offsets=False)]
    if meta.get("add_bos") and bos is not None:
        text = tokens[bos]
        steps.append(processors.TemplateProcessing(single=f"{text} $A", pair=f"{text} $A {text} $B:1",
                                                   special_tokens=[(text, int(bos))]))
    tokenizer.post_processor = processors.Sequence(steps)
    return tokenizer
