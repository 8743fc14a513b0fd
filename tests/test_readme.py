"""The README's examples run and answer what it shows.

The README's fenced blocks are parsed in order; a `text` block right after a `bash` or `python`
block is that example's shown output. One `pdserve up` (the default model, SmolLM2, on a free
port) serves every query example; its port replaces the README's 8000. A shown output may elide
with `...`: its pieces must appear in the real output in order. The Quickstart's `make` lines are
not run here (`make test` runs this file; the demo's answers are checked by
tests/test_default_model.py). The results table must be what `pdserve bench report` gives.
"""

import os
import re
import select
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.report import headline

pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", re.M | re.S)
DEFAULT_PORT = "127.0.0.1:8000"


def examples() -> list[tuple[str, str, str | None]]:
    """(language, code, shown output or None) for every bash and python block of the README."""
    blocks = [(m.group(1), m.group(2), m.end(), m.start()) for m in FENCE.finditer(README)]
    out = []
    for i, (lang, code, end, _) in enumerate(blocks):
        if lang not in ("bash", "python"):
            continue
        shown = None
        if i + 1 < len(blocks) and blocks[i + 1][0] == "text" and not README[end:blocks[i + 1][3]].strip():
            shown = blocks[i + 1][1]
        out.append((lang, code, shown))
    return out


def matches(shown: str, actual: str) -> bool:
    """Every piece of `shown` between `...` elisions, line by line, appears in `actual` in order."""
    at = 0
    for line in shown.strip().splitlines():
        for piece in (p.strip() for p in line.split("...")):
            if not piece:
                continue
            found = actual.find(piece, at)
            if found < 0:
                return False
            at = found + len(piece)
    return True


def test_readme_shape():
    assert len(README.splitlines()) <= 200
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", README), "a dated note in the README"
    langs = [(lang, code.split()[0]) for lang, code, _ in examples()]
    assert ("bash", "make") in langs and ("bash", "pdserve") in langs and ("bash", "curl") in langs
    assert any(lang == "python" for lang, _ in langs)
    for _, code, shown in examples():
        if code.split()[0] != "make":
            assert shown is not None, f"no shown output after:\n{code}"


def test_readme_results_table_is_the_report():
    table = [line for line in README.splitlines() if line.startswith("| ") and "`" in line.split("|")[1]]
    assert table == headline(ROOT / "docs/results")[2:]


def test_matches_elides():
    assert matches('{"a": 1, ... "c": 3 ...}', '{"a": 1, "b": 2, "c": 3, "d": 4}')
    assert not matches('"c": 3 ... "a": 1', '{"a": 1, "b": 2, "c": 3}')


@pytest.fixture(scope="module")
def cluster():
    """The README's `pdserve up`, on a free port; yields (port, its first lines of output)."""
    (code, shown), = [(c, s) for lang, c, s in examples() if lang == "bash" and c.split()[0] == "pdserve"]
    argv = shlex.split(code.split("#")[0])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "pdserve_cli.main", *argv[1:], "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT,
                            start_new_session=True)
    seen, port = "", None
    try:
        deadline = time.monotonic() + 300
        while port is None and time.monotonic() < deadline and proc.poll() is None:
            # all that arrived, not one line: lines left in a reader buffer are invisible to select
            if select.select([proc.stdout], [], [], 1.0)[0]:
                seen += os.read(proc.stdout.fileno(), 1 << 16).decode(errors="replace")
                found = re.search(r"on http://127\.0\.0\.1:(\d+)/v1", seen)
                port = found.group(1) if found else None
        assert port, f"pdserve up did not come up:\n{seen}"
        assert matches(shown.replace(DEFAULT_PORT, f"127.0.0.1:{port}"), seen), seen
        yield port
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=120)
        assert proc.returncode == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


@pytest.mark.parametrize("index", [i for i, (lang, code, _) in enumerate(examples())
                                   if code.split()[0] not in ("make", "pdserve")])
def test_readme_example_answers_as_shown(cluster, index):
    lang, code, shown = examples()[index]
    code = code.replace(DEFAULT_PORT, f"127.0.0.1:{cluster}")
    argv = ["bash", "-c", code] if lang == "bash" else [sys.executable, "-c", code]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert matches(shown, done.stdout), f"shown:\n{shown}\ngot:\n{done.stdout}"


def test_every_relative_link_of_the_manual_resolves():
    link = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
    broken = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in link.findall(page.read_text()):
            if "://" not in target and not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, broken
