"""The serving default of `--weights` (pdserve_cli.weights_arg.resolve): the flag wins; on CPU a
GGUF model gets its own blocks (`gguf`), any other model bf16; a GPU keeps f32; a cluster whose
decode model is not a GGUF file does not get `gguf` (that format refuses a non-GGUF model)."""

import json

from pdserve_cli.weights_arg import SERVING_DEFAULT, resolve


def test_the_flag_wins():
    assert resolve("int8", "cpu", "smollm2") == "int8"
    assert resolve("f32", "cuda", "smollm2") == "f32"


def test_cpu_default_follows_the_model():
    assert resolve(None, None, "smollm2") == "gguf"
    assert resolve(None, "cpu", "/models/x.Q4_1.GGUF") == "gguf"
    assert resolve(None, "cpu", "tiny") == SERVING_DEFAULT == "bf16"
    assert resolve(None, "cpu", "/models/hf-checkpoint") == "bf16"
    assert resolve(None, "cpu") == "bf16"  # no model named


def test_every_engine_must_load_a_gguf_file():
    assert resolve(None, "cpu", "smollm2", None) == "gguf"  # no separate decode model
    assert resolve(None, "cpu", "smollm2", "smollm2") == "gguf"
    assert resolve(None, "cpu", "smollm2", "/models/hf-checkpoint") == "bf16"


def test_gpus_keep_f32():
    assert resolve(None, "cuda", "smollm2") == "f32"


def test_generate_local_computes_in_the_serving_default(capsys):
    """`generate --local` and `up`/`serve` resolve the same format for tiny (not f32 for one and
    bf16 for the other); the answer names it, in the JSON and after the text."""
    from pdserve_cli.main import main

    argv = ["generate", "--local", "--model", "tiny", "--prompt-ids", "256,1,2", "--max-tokens", "2"]
    assert main([*argv, "--json"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert body["system_fingerprint"] == f"pdserve-{resolve(None, 'cpu', 'tiny')}" == "pdserve-bf16"
    assert main([*argv, "--weights", "f32"]) == 0
    assert capsys.readouterr().err.strip() == "(pdserve-f32)"  # the flag still wins
