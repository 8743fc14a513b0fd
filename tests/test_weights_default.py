"""The serving default of `--weights` (pdserve_cli.weights_arg.resolve): the flag wins; on CPU a
GGUF model gets its own blocks (`gguf`), any other model bf16; a GPU keeps f32; a cluster whose
decode model is not a GGUF file does not get `gguf` (that format refuses a non-GGUF model)."""

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
