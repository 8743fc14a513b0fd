"""Imports flow one way: pdserve_cli/bench -> planner -> measure/allocsim -> deploy -> coordinator ->
workers -> runtime -> transfer/engine -> kvcache -> protocol/model_files. Every import of every package
module, including the ones inside functions, is read with `ast`; sibling packages on one layer
(prefill_worker and decode_worker, transfer and engine) never import each other, and nothing outside
bench/ and tests/ imports bench but the CLI's `bench` commands (pdserve_cli/cmd_bench_*.py). The
coordinator imports neither the engine nor torch (it tokenizes through model_files), and loading every
coordinator module loads neither.
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
    {"prefill_worker", "decode_worker", "colocated_worker"},
    {"coordinator"},
    {"deploy", "dst"},  # dst: the deterministic simulation (transfer, kvcache, the coordinator's ledger)
    {"measure", "allocsim"},  # product features' measurements and the allocator simulator
    {"planner"},  # `pdserve plan` / `pdserve profile`: measures with measure/
    {"bench", "pdserve_cli"},
]
LAYER = {package: level for level, packages in enumerate(LAYERS) for package in packages}
ALLOWED_UPWARD = {("pdserve_cli", "bench")}  # the CLI's `bench` commands call into bench/ (bench_importers)
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


def bench_importers(root: Path = ROOT) -> list[str]:
    """Every import of bench from a .py file outside bench/ and tests/ (the virtual environment,
    build output and hidden folders aside), but for the CLI's `bench` commands."""
    bad = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] in ("bench", "tests", ".venv", "build", "out") or rel.parts[0].startswith(".") \
                or (rel.parts[0] == "pdserve_cli" and rel.name.startswith("cmd_bench_")):
            continue
        bad += [f"{rel}:{line} imports bench" for line, target in imports_of(path) if target == "bench"]
    return bad


def test_only_the_bench_commands_import_bench():
    """bench/ holds benchmarks only: no product module, script or the CLI's other commands import it."""
    assert bench_importers() == []


def test_the_bench_check_sees_a_product_import(tmp_path):
    """The rule can fail: a nested import of bench from a product package or a non-bench command is
    reported; the `bench` commands, bench/ and tests/ are not."""
    for rel, text in (("planner/x.py", "def f():\n    import bench.serve\n"),
                      ("pdserve_cli/cmd_plan.py", "from bench import serve\n"),
                      ("pdserve_cli/cmd_bench_serve.py", "import bench\n"),
                      ("bench/serve.py", "import bench\n"), ("tests/test_x.py", "import bench\n"),
                      ("tool.py", "x = 1\n")):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert bench_importers(tmp_path) == ["pdserve_cli/cmd_plan.py:1 imports bench",
                                         "planner/x.py:2 imports bench"]


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
