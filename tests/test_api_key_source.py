"""Issue 28 case 6: the HTTP API key of `pdserve up` / `pdserve serve` comes from a file or from
$PDSERVE_API_KEY, never needs the command line (where every local user reads it in `ps`), and
`--api-key K` still works but warns. A served process started with `--api-key-file` guards its
routes with the file's key while its command line and its environment hold no trace of it."""

from __future__ import annotations

import argparse
import json
import os
import re
import select
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from pdserve_cli import api_key

KEY = "k3y-from-a-file"


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    api_key.add_arguments(p)
    return p.parse_args(argv)


def _resolve(*argv: str):
    warnings: list[str] = []
    return api_key.resolve(_args(*argv), warn=warnings.append), warnings


def test_the_key_comes_from_the_environment_and_leaves_it(monkeypatch):
    monkeypatch.setenv("PDSERVE_API_KEY", " s3cret\n")
    assert _resolve() == ("s3cret", [])
    assert "PDSERVE_API_KEY" not in os.environ  # the Ray processes started next do not inherit it


def test_no_key_means_no_auth(monkeypatch):
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    assert _resolve() == (None, [])


def test_a_key_file_is_read_and_stripped(tmp_path):
    f = tmp_path / "key"
    f.write_text(KEY + "\n")
    os.chmod(f, 0o600)
    assert _resolve("--api-key-file", str(f)) == (KEY, [])


def test_a_key_file_open_to_others_warns(tmp_path):
    f = tmp_path / "key"
    f.write_text(KEY)
    os.chmod(f, 0o644)
    key, warnings = _resolve("--api-key-file", str(f))
    assert key == KEY and len(warnings) == 1 and "readable by group or other" in warnings[0]


def test_the_key_on_the_command_line_warns():
    key, warnings = _resolve("--api-key", "visible")
    assert key == "visible" and len(warnings) == 1 and "visible to every local user" in warnings[0]


@pytest.mark.parametrize("content", ["", "  \n", "a\x00b", "x" * 5000])
def test_an_empty_or_odd_key_is_refused(tmp_path, content):
    f = tmp_path / "key"
    f.write_text(content)
    with pytest.raises(ValueError):
        _resolve("--api-key-file", str(f))


def test_a_missing_key_file_or_both_sources_are_refused(tmp_path):
    with pytest.raises(ValueError, match="cannot read --api-key-file"):
        _resolve("--api-key-file", str(tmp_path / "absent"))
    with pytest.raises(ValueError, match="not both"):
        _resolve("--api-key-file", str(tmp_path / "absent"), "--api-key", "x")


def _status(url: str, headers: dict) -> int:
    body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 2}).encode()
    req = urllib.request.Request(url, body, {"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_serve_with_a_key_file_keeps_the_key_off_its_command_line(tmp_path):
    f = tmp_path / "key"
    f.write_text(KEY + "\n")
    os.chmod(f, 0o600)
    env = {k: v for k, v in os.environ.items() if k != "PDSERVE_API_KEY"}
    cmd = [sys.executable, "-m", "pdserve_cli.main", "serve", "--model", "tiny", "--port", "0",
           "--num-blocks", "32", "--api-key-file", str(f)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**env, "OMP_NUM_THREADS": "1"})
    seen = ""
    try:
        deadline, m = time.monotonic() + 120, None
        while m is None and time.monotonic() < deadline and proc.poll() is None:
            # all that arrived, not one line: lines left in a reader buffer are invisible to select
            if select.select([proc.stdout], [], [], 1.0)[0]:
                seen += os.read(proc.stdout.fileno(), 1 << 16).decode(errors="replace")
                m = re.search(r"on http://127\.0\.0\.1:(\d+)/v1", seen)
        assert m, f"pdserve serve did not come up:\n{seen}"
        with open(f"/proc/{proc.pid}/cmdline", "rb") as c, open(f"/proc/{proc.pid}/environ", "rb") as e:
            assert KEY.encode() not in c.read() and KEY.encode() not in e.read()
        url = f"http://127.0.0.1:{m.group(1)}/v1/completions"
        assert _status(url, {}) == 401
        assert _status(url, {"Authorization": "Bearer wrong"}) == 401
        assert _status(url, {"Authorization": f"Bearer {KEY}"}) == 200
        assert "warning" not in seen
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
