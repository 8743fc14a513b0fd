"""`pdserve up` as a user runs it: a subprocess that starts its own local Ray, says one line per
phase of its start, serves the API on loopback under the name it was given, answers a
completion (with the tokens and the weight format, named by its system_fingerprint, of
`generate --local`), and on SIGTERM stops everything it started and exits 0; Ctrl-C at each phase of the
start (Ray starting, workers starting, handshakes, HTTP bind) stops it as cleanly, with no
process of that run left; and what can be checked before Ray starts (the port, the model) fails
at once, with its cause, and starts no Ray."""

import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid

import pytest
from marked_processes import kill_marked, marked

from pdserve_cli.main import main

pytest.importorskip("ray")

UP = [sys.executable, "-m", "pdserve_cli.main", "up"]
RAY_STARTED = "Started a local Ray instance"  # Ray's own line when ray.init starts one


@pytest.fixture
def run_env():
    """The environment of one `up` run: a short private TMPDIR (Ray's temp folder goes in it; Unix
    socket paths must stay short) and a marker every process of the run inherits."""
    tmp = tempfile.mkdtemp(prefix="p", dir="/tmp")
    marker = f"PDSERVE_TEST_RUN={uuid.uuid4().hex}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": tmp, marker.split("=")[0]: marker.split("=")[1]}
    yield env, marker
    kill_marked(marker)  # a failed test's leftovers (a passing test has none: it checks)
    shutil.rmtree(tmp, ignore_errors=True)


class Up:
    """`pdserve up ARGS` in its own process group (as a terminal's job is), its output read line by
    line on a thread (select on the pipe would miss lines already in the reader's buffer)."""

    def __init__(self, args: list[str], env: dict):
        self.proc = subprocess.Popen(UP + args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=env, start_new_session=True)
        self.lines: queue.Queue = queue.Queue()
        self.seen = ""
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def until(self, pattern: str, timeout: float = 180.0) -> re.Match | None:
        """Read up to the first line that matches `pattern` (bounded); None when it never came."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=1.0)
            except queue.Empty:
                continue
            if line is None:
                return None
            self.seen += line
            m = re.search(pattern, line)
            if m:
                return m
        return None

    def finish(self, timeout: float = 90.0) -> int:
        """Wait for it to exit (bounded) and read the rest of its output; its exit status."""
        rc = self.proc.wait(timeout)
        while (line := self.lines.get(timeout=10)) is not None:
            self.seen += line
        return rc

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)


def _assert_nothing_left(proc: subprocess.Popen, marker: str) -> None:
    deadline = time.monotonic() + 30  # Ray's processes exit asynchronously after its shutdown
    while (marked(marker) or _group_alive(proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert marked(marker) == [], "processes started by pdserve up are still running"
    assert not _group_alive(proc.pid), "processes of pdserve up's process group are still running"


def test_up_serves_and_stops_cleanly_on_sigterm(run_env, capsys):
    env, marker = run_env
    up = Up(["--model", "tiny", "--port", "0", "--num-blocks", "128", "--served-model-name", "my-model"], env)
    try:
        m = up.until(r"on http://127\.0\.0\.1:(\d+)/v1")
        assert m, f"pdserve up did not come up:\n{up.seen}"
        for phase in ("starting Ray", "starting 1 prefill + 1 decode worker", "handshakes:",
                      "binding the HTTP API"):  # one line per phase, in order
            assert phase in up.seen, up.seen
        base = f"http://127.0.0.1:{m.group(1)}"
        with urllib.request.urlopen(base + "/v1/models", timeout=60) as r:
            assert [model["id"] for model in json.loads(r.read())["data"]] == ["my-model"]
        body = json.dumps({"model": "my-model", "prompt": [256, 1, 2, 3], "max_tokens": 4,
                           "temperature": 0}).encode()
        req = urllib.request.Request(base + "/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            out = json.loads(r.read())
        assert len(out["choices"][0]["token_ids"]) == 4 and out["model"] == "my-model"
        assert out["pdserve"]["backend"]["migration"]["transport"] == "zmq"
        assert main(["generate", "--local", "--model", "tiny", "--prompt-ids", "256,1,2,3", "--max-tokens",
                     "4", "--json"]) == 0
        local = json.loads(capsys.readouterr().out)
        assert out["system_fingerprint"] == local["system_fingerprint"] == "pdserve-bf16"
        assert out["choices"][0]["token_ids"] == local["choices"][0]["token_ids"]
        assert marked(marker), "the marker should be in the run's processes"
        up.proc.send_signal(signal.SIGTERM)
        assert up.finish() == 0, up.seen
        assert "pdserve up: stopped" in up.seen
    finally:
        up.kill()
    _assert_nothing_left(up.proc, marker)


# The line `up` prints as each phase of its start begins.
PHASES = {"ray": r"starting Ray \(local", "workers": r"starting 1 prefill \+ 1 decode worker",
          "handshakes": r"handshakes:", "http": r"binding the HTTP API"}


@pytest.mark.parametrize("phase,sig", [(phase, "SIGINT") for phase in PHASES] + [("ray", "SIGTERM")])
def test_ctrl_c_at_each_phase_of_the_start_stops_cleanly(phase, sig, run_env):
    """Ctrl-C (SIGINT to the whole process group, as a terminal sends it) the moment `up` says a
    phase began: it exits 0 within a bounded time, and no process of that run is left. SIGTERM
    (to `up` alone, as `kill` sends it) during Ray's start too: Ray's own handler is kept out."""
    env, marker = run_env
    up = Up(["--model", "tiny", "--port", "0", "--num-blocks", "128"], env)
    try:
        assert up.until(PHASES[phase]), f"pdserve up never said it was at phase {phase}:\n{up.seen}"
        if sig == "SIGINT":
            os.killpg(up.proc.pid, signal.SIGINT)
        else:
            up.proc.send_signal(signal.SIGTERM)
        assert up.finish() == 0, up.seen
        assert f"{sig}: stopping" in up.seen and "pdserve up: stopped" in up.seen, up.seen
    finally:
        up.kill()
    _assert_nothing_left(up.proc, marker)


def _fails_before_ray(args: list[str], env: dict) -> str:
    """`up` with `args` exits 2 without starting Ray; returns what it said."""
    out = subprocess.run(UP + args, capture_output=True, text=True, env=env, timeout=120)
    said = out.stdout + out.stderr
    assert out.returncode == 2, said
    assert RAY_STARTED not in said and "starting Ray" not in said, said
    return said


def test_a_fake_gguf_is_refused_before_ray_starts(run_env, tmp_path):
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"this is not a GGUF file at all")
    said = _fails_before_ray(["--model", str(fake), "--port", "0"], run_env[0])
    assert "no GGUF magic" in said and str(fake) in said


def test_a_broken_config_json_is_named_before_ray_starts(run_env, tmp_path):
    syntax = tmp_path / "syntax"
    syntax.mkdir()
    (syntax / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "hidden_size": 64')
    said = _fails_before_ray(["--model", str(syntax), "--port", "0"], run_env[0])
    assert f"{syntax}/config.json cannot be read as JSON" in said
    lacking = tmp_path / "lacking"  # valid JSON, a field the loader needs is missing (checked with torch)
    lacking.mkdir()
    (lacking / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"],
                                                     "hidden_size": 64}))
    said = _fails_before_ray(["--model", str(lacking), "--port", "0"], run_env[0])
    assert f"{lacking}/config.json has no 'num_attention_heads'" in said


def test_a_port_in_use_is_refused_before_ray_starts(run_env):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        said = _fails_before_ray(["--model", "tiny", "--port", str(port)], run_env[0])
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in said


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_bad_setting_in_the_config_file_is_refused_before_ray_starts(run_env, tmp_path):
    config = tmp_path / "up.yaml"
    config.write_text("routing: bogus\n")
    said = _fails_before_ray(["--model", "tiny", "--port", "0", "--config", str(config)], run_env[0])
    assert "routing policy must be one of" in said and "'bogus'" in said
