"""Imports flow one way: pdserve_cli/bench -> deploy -> coordinator -> workers -> runtime ->
transfer/engine -> kvcache -> protocol. Every import of every package module, including the ones
inside functions, is read with `ast`; sibling packages on one layer (prefill_worker and
decode_worker, transfer and engine) never import each other, and nothing in the runtime imports
bench. The coordinator's HTTP layer and cluster backend load without torch.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = [
    {"protocol"},
    {"kvcache"},
    {"transfer", "engine"},
    {"runtime"},
    {"prefill_worker", "decode_worker"},
    {"coordinator"},
    {"deploy"},
    {"bench", "pdserve_cli"},
]
LAYER = {package: level for level, packages in enumerate(LAYERS) for package in packages}
ALLOWED_UPWARD = {("pdserve_cli", "bench")}  # the CLI's `bench` commands call into bench/


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


def violations() -> list[str]:
    bad = []
    for package in LAYER:
        for path in sorted((ROOT / package).rglob("*.py")):
            for line, target in imports_of(path):
                if target not in LAYER or target == package or (package, target) in ALLOWED_UPWARD:
                    continue
                if LAYER[target] >= LAYER[package]:
                    bad.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    return bad


def test_imports_flow_one_way():
    assert violations() == []


def test_the_checker_sees_nested_imports(tmp_path):
    """The rule can fail: a function-level upward import is reported."""
    sample = tmp_path / "sample.py"
    sample.write_text("def f():\n    from coordinator.cluster import ClusterBackend\n"
                      "    import bench.serve\n")
    assert imports_of(sample) == [(2, "coordinator"), (3, "bench")]


def test_coordinator_http_and_cluster_load_without_torch():
    code = ("import sys, coordinator.http, coordinator.cluster, coordinator.reports, protocol.queues; "
            "print(sorted(m for m in ('torch', 'triton') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
