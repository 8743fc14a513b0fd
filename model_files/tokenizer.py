"""Tokenizers: a checkpoint's `tokenizer.json` (or a GGUF file's tokenizer metadata, see
model_files.gguf_tokenizer) through the `tokenizers` package, or the byte-level fallback the tiny
model (and any checkpoint directory without a tokenizer.json) uses.

Byte-level scheme (`ByteTokenizer`): text is UTF-8 encoded and each byte b becomes id b
(0..255). BOS and EOS are extra ids given by the model config (256 and 257 for the tiny model);
ids >= 256 other than those are unused. `encode` prepends BOS when asked (the default) and the
model has one; `decode` drops BOS, EOS and every id >= 256, then decodes the bytes with
errors="replace", so a cut-off multi-byte character shows as U+FFFD rather than raising.

Both classes share one API: encode(text, add_special_tokens=True) -> list[int],
decode(ids, skip_special_tokens=True) -> str, and the attributes bos_token_id (int | None),
eos_token_id (int | None), eos_token_ids (tuple), vocab_size, kind ('byte' or 'hf') and
chat_template (an model_files.chat_template.ChatTemplate, or None when the model ships none).
"""

from __future__ import annotations

import json
import os
from typing import Protocol

from model_files.chat_template import ChatTemplate
from model_files.gguf import GGUFFile, is_gguf_spec, resolve_model_spec
from model_files.gguf_tokenizer import build_tokenizer


class SpecialIds(Protocol):
    """What a tokenizer takes from the model's config: engine.model_config.ModelConfig on a worker,
    the workers' protocol.messages.WorkerInfo on the coordinator."""

    vocab_size: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, plus the model's BOS/EOS ids."""

    kind = "byte"
    chat_template = None

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
    """A `tokenizers.Tokenizer` (from a tokenizer.json path, or already built); BOS/EOS ids come
    from the model config."""

    kind = "hf"

    def __init__(self, source, bos_token_id: int | None, eos_token_ids: tuple[int, ...] = (),
                 chat_template: ChatTemplate | None = None):
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(source) if isinstance(source, str) else source
        self.path = source if isinstance(source, str) else None
        self.chat_template = chat_template
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.eos_token_id = self.eos_token_ids[0] if self.eos_token_ids else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids; special tokens (e.g. BOS) are added as the tokenizer's post-processor says."""
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def save(self, path: str) -> None:
        """Write it as a tokenizer.json (what transformers' AutoTokenizer reads)."""
        self._tok.save(path)


def load_tokenizer(spec: str | None, config: SpecialIds) -> ByteTokenizer | HFTokenizer:
    """The tokenizer of a model spec: a GGUF file's (a shipped name such as 'smollm2' or a .gguf
    path), tokenizer.json from a checkpoint directory when present, else the byte-level tokenizer
    (spec None or 'tiny' too)."""
    if is_gguf_spec(spec):
        return gguf_tokenizer(GGUFFile(resolve_model_spec(spec)), config)
    if spec is not None and spec != "tiny":
        path = os.path.join(spec, "tokenizer.json")
        if os.path.isfile(path):
            tok = HFTokenizer(path, config.bos_token_id, config.eos_token_ids)
            tok.chat_template = _directory_chat_template(spec, tok)
            return tok
    return ByteTokenizer(config.vocab_size, config.bos_token_id, config.eos_token_ids)


def gguf_tokenizer(gguf_file: GGUFFile, config: SpecialIds) -> HFTokenizer:
    """The tokenizer (and chat template, when the file has one) of an open GGUF file."""
    meta = gguf_file.tokenizer_metadata()
    tok = HFTokenizer(build_tokenizer(meta, gguf_file.path), config.bos_token_id, config.eos_token_ids)
    if meta["chat_template"]:
        tokens = meta["tokens"]
        tok.chat_template = ChatTemplate(meta["chat_template"], _token_text(tokens, config.bos_token_id),
                                         _token_text(tokens, (*config.eos_token_ids, None)[0]))
    return tok


def _token_text(tokens: list[str], token_id: int | None) -> str:
    return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else ""


def _directory_chat_template(directory: str, tok: HFTokenizer) -> ChatTemplate | None:
    """chat_template.jinja, or `chat_template` of tokenizer_config.json (a string, or a list of
    named templates of which 'default' is used); None when the checkpoint has neither."""
    source, settings = None, {}
    path = os.path.join(directory, "tokenizer_config.json")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            settings = json.load(f)
        source = settings.get("chat_template")
        if isinstance(source, list):
            source = next((t.get("template") for t in source if t.get("name") == "default"), None)
    jinja = os.path.join(directory, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            source = f.read()
    if not source:
        return None

    def text(name: str, token_id: int | None) -> str:
        value = settings.get(name)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            return value
        return tok.decode([token_id], skip_special_tokens=False) if token_id is not None else ""

    return ChatTemplate(source, text("bos_token", tok.bos_token_id), text("eos_token", tok.eos_token_id))
