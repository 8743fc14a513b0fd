"""Imports flow one way: pdserve_cli/bench -> deploy -> coordinator -> workers -> runtime ->
transfer/engine -> kvcache -> protocol/model_files. Every import of every package module,
including the ones inside functions, is read with `ast`; sibling packages on one layer
(prefill_worker and decode_worker, transfer and engine) never import each other, and nothing in
the runtime imports bench. The coordinator imports neither the engine nor torch (it tokenizes
through model_files), and loading every coordinator module loads neither.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = [
    {"protocol", "model_files"},
    {"kvcache"},
    {"transfer", "engine"},
    {"runtime"},
    {"prefill_worker", "decode_worker"},
    {"coordinator"},
    {"deploy", "dst"},  # dst: the deterministic simulation (transfer, kvcache, the coordinator's ledger)
    {"bench", "pdserve_cli"},
]
LAYER = {package: level for level, packages in enumerate(LAYERS) for package in packages}
ALLOWED_UPWARD = {("pdserve_cli", "bench")}  # the CLI's `bench` commands call into bench/
# (package, what it never imports, even downward): the coordinator runs without the model's code
FORBIDDEN = {("coordinator", name) for name in ("engine", "torch", "triton")} | \
            {("model_files", name) for name in ("torch", "triton")}


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, top-level package) of every absolute import in the file, nested ones included."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module.split(".")[0]))
    return out


def violations(root: Path = ROOT) -> list[str]:
    bad = []
    for package in LAYER:
        for path in sorted((root / package).rglob("*.py")):
            for line, target in imports_of(path):
                upward = target in LAYER and target != package and LAYER[target] >= LAYER[package] \
                    and (package, target) not in ALLOWED_UPWARD
                if upward or (package, target) in FORBIDDEN:
                    bad.append(f"{path.relative_to(root)}:{line} imports {target}")
    return bad


def test_imports_flow_one_way():
    assert violations() == []


def test_the_checker_sees_nested_imports(tmp_path):
    """The rule can fail: a function-level upward import is reported."""
    sample = tmp_path / "sample.py"
    sample.write_text("def f():\n    from coordinator.cluster import ClusterBackend\n"
                      "    import bench.serve\n")
    assert imports_of(sample) == [(2, "coordinator"), (3, "bench")]


def test_the_checker_reports_a_forbidden_downward_import(tmp_path):
    """The coordinator sits above the engine, yet importing it (even inside a function) is reported."""
    package = tmp_path / "coordinator"
    package.mkdir()
    (package / "sample.py").write_text("def f():\n    from engine.tokenizer import load_tokenizer\n")
    assert violations(tmp_path) == ["coordinator/sample.py:2 imports engine"]


def test_every_coordinator_module_loads_without_the_engine_or_torch():
    """Import every module of coordinator/ and model_files/ in a fresh interpreter: nothing of the
    engine, torch or triton may be loaded, directly or through another package."""
    code = ("import importlib, pkgutil, sys\n"
            "for package in ('coordinator', 'model_files'):\n"
            "    for m in pkgutil.iter_modules(importlib.import_module(package).__path__):\n"
            "        importlib.import_module(f'{package}.{m.name}')\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('engine', 'torch', 'triton')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
