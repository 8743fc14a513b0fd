"""`pdserve up` as a user runs it: a subprocess that starts its own local Ray, serves the API on
loopback, answers a completion (with the tokens and the weight format, named by its
system_fingerprint, of `generate --local`), and on SIGTERM stops everything it started and exits 0."""

import json
import os
import re
import select
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from pdserve_cli.main import main

pytest.importorskip("ray")


def test_up_serves_and_stops_cleanly_on_sigterm(capsys):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "pdserve_cli.main", "up", "--model", "tiny", "--port", "0",
           "--num-blocks", "128"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    seen = ""
    try:
        deadline, m = time.monotonic() + 180, None
        while m is None and time.monotonic() < deadline and proc.poll() is None:
            if select.select([proc.stdout], [], [], 1.0)[0]:
                seen += proc.stdout.readline()
                m = re.search(r"on http://127\.0\.0\.1:(\d+)/v1", seen)
        assert m, f"pdserve up did not come up:\n{seen}"
        base = f"http://127.0.0.1:{m.group(1)}"
        body = json.dumps({"prompt": [256, 1, 2, 3], "max_tokens": 4, "temperature": 0}).encode()
        req = urllib.request.Request(base + "/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            out = json.loads(r.read())
        assert len(out["choices"][0]["token_ids"]) == 4
        assert out["pdserve"]["backend"]["migration"]["transport"] == "zmq"
        assert main(["generate", "--local", "--model", "tiny", "--prompt-ids", "256,1,2,3", "--max-tokens",
                     "4", "--json"]) == 0
        local = json.loads(capsys.readouterr().out)
        assert out["system_fingerprint"] == local["system_fingerprint"] == "pdserve-bf16"
        assert out["choices"][0]["token_ids"] == local["choices"][0]["token_ids"]
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=90)
        seen += rest
        assert proc.returncode == 0, seen
        assert "pdserve up: stopped" in seen
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    # The Ray it started is gone: nothing of its process group (raylet, GCS, workers) is left.
    deadline = time.monotonic() + 30
    while _group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _group_alive(proc.pid), "processes started by pdserve up are still running"


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True
