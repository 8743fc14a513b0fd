"""Tokenizers: a checkpoint's `tokenizer.json` through the `tokenizers` package, or the byte-level
fallback the tiny model (and any checkpoint directory without a tokenizer.json) uses.

Byte-level scheme (`ByteTokenizer`): text is UTF-8 encoded and each byte b becomes id b
(0..255). BOS and EOS are extra ids given by the model config (256 and 257 for the tiny model);
ids >= 256 other than those are unused. `encode` prepends BOS when asked (the default) and the
model has one; `decode` drops BOS, EOS and every id >= 256, then decodes the bytes with
errors="replace", so a cut-off multi-byte character shows as U+FFFD rather than raising.

Both classes share one API: encode(text, add_special_tokens=True) -> list[int],
decode(ids, skip_special_tokens=True) -> str, and the attributes bos_token_id (int | None),
eos_token_id (int | None), eos_token_ids (tuple), vocab_size and kind ('byte' or 'hf').
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # no runtime import: the coordinator loads tokenizers without torch
    from engine.config import ModelConfig


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, plus the model's BOS/EOS ids."""

    kind = "byte"

    def __init__(self, vocab_size: int, bos_token_id: int | None, eos_token_ids: tuple[int, ...] = ()):
        if vocab_size < 256:
            raise ValueError(f"a byte-level tokenizer needs at least 256 ids, vocabulary is {vocab_size}")
        self.vocab_size = vocab_size
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.eos_token_id = self.eos_token_ids[0] if self.eos_token_ids else None
        self._special = {i for i in (bos_token_id, *self.eos_token_ids) if i is not None}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        if add_special_tokens and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        # Ids >= 256 are no byte: they are dropped whatever skip_special_tokens says.
        data = bytes(i for i in ids if 0 <= i < 256 and not (skip_special_tokens and i in self._special))
        return data.decode("utf-8", errors="replace")


class HFTokenizer:
    """A `tokenizers.Tokenizer` from tokenizer.json; BOS/EOS ids come from the model config."""

    kind = "hf"

    def __init__(self, path: str, bos_token_id: int | None, eos_token_ids: tuple[int, ...] = ()):
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(path)
        self.path = path
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.eos_token_id = self.eos_token_ids[0] if self.eos_token_ids else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids; special tokens (e.g. BOS) are added as the tokenizer's post-processor says."""
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)


def load_tokenizer(directory: str | None, config: ModelConfig) -> ByteTokenizer | HFTokenizer:
    """tokenizer.json from `directory` when present, else the byte-level tokenizer. `config` is a
    ModelConfig or anything with vocab_size, bos_token_id and eos_token_ids (e.g. WorkerInfo)."""
    if directory is not None:
        path = os.path.join(directory, "tokenizer.json")
        if os.path.isfile(path):
            return HFTokenizer(path, config.bos_token_id, config.eos_token_ids)
    return ByteTokenizer(config.vocab_size, config.bos_token_id, config.eos_token_ids)
