"""The Ray under pdserve, kept private (issue 49) and joined only when both sides agree on auth
(issue 50): the embedded Ray's temp folder (sessions, logs, sockets, which Ray makes 0777) lies in
a 0700 folder of this user's; the token a local start writes is 0600, and a token file others can
read is tightened; `up --address` to a Ray cluster started without token auth is refused with
what to set on which side, before any worker is placed."""

from __future__ import annotations

import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import uuid

import pytest

ray = pytest.importorskip("ray")

from marked_processes import kill_marked  # noqa: E402

from deploy import ray_guard  # noqa: E402
from runtime.model_store import ModelStoreError  # noqa: E402

pytestmark = pytest.mark.own_ray  # starts Ray in this process (conftest stops the shared one)
RAY = os.path.join(os.path.dirname(sys.executable), "ray")


@pytest.fixture
def short_tmp():
    """A short temp folder (Unix socket paths inside Ray's session folder must stay under 107
    bytes, so not pytest's long tmp_path)."""
    tmp = tempfile.mkdtemp(prefix="p", dir="/tmp")
    yield tmp
    shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture
def no_token(monkeypatch, tmp_path):
    """A HOME with no ~/.ray/auth_token and no token in the environment."""
    for name in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_MODE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return tmp_path / "home" / ".ray" / "auth_token"


def test_the_embedded_ray_keeps_its_files_private_and_writes_its_token_0600(no_token):
    from deploy.launch import RayConfig, start_ray, stop_ray

    if ray.is_initialized():
        pytest.skip("a Ray instance is already initialised in this process")
    started = start_ray(RayConfig(num_cpus=1))
    try:
        session = ray._private.worker._global_node.get_session_dir_path()
    finally:
        stop_ray(started)
    root = os.path.join(tempfile.gettempdir(), f"pdserve-ray-{os.geteuid()}")
    assert session.startswith(root + os.sep), session  # not Ray's shared /tmp/ray
    st = os.stat(root)
    assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
    st = os.stat(no_token)
    assert stat.S_IMODE(st.st_mode) == 0o600 and len(no_token.read_text()) == 64


def test_a_token_file_others_can_read_is_made_0600_unchanged(no_token):
    no_token.parent.mkdir(parents=True)
    no_token.write_text("a" * 64)
    os.chmod(no_token, 0o644)
    assert ray_guard.private_token() == str(no_token)
    assert stat.S_IMODE(os.stat(no_token).st_mode) == 0o600 and no_token.read_text() == "a" * 64


def test_a_ray_temp_folder_open_to_others_is_refused(short_tmp):
    root = os.path.join(short_tmp, f"pdserve-ray-{os.geteuid()}")
    os.mkdir(root)
    os.chmod(root, 0o755)
    with pytest.raises(ModelStoreError, match=r"Ray temp folder .* mode 0755 lets group/other in.*TMPDIR"):
        ray_guard.private_temp_dir(short_tmp)


def test_joining_with_auth_disabled_a_cluster_that_demands_tokens_says_what_to_set(monkeypatch):
    monkeypatch.setattr(ray_guard, "cluster_wants_token", lambda address: True)
    with pytest.raises(RuntimeError, match="demands token authentication.*unset RAY_AUTH_MODE"):
        ray_guard.check_cluster_auth("127.0.0.1:1", "disabled")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def head_without_token_auth(short_tmp):
    """`ray start --head` on loopback with RAY_AUTH_MODE=disabled (a cluster without token auth)."""
    port, marker = _free_port(), f"PDSERVE_TEST_HEAD={uuid.uuid4().hex}"
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", marker.split("=")[0]: marker.split("=")[1]}
    cmd = [RAY, "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port), "--num-cpus", "1",
           "--temp-dir", os.path.join(short_tmp, "head"), "--include-dashboard", "false",
           "--disable-usage-stats"]
    try:
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr
        yield f"127.0.0.1:{port}"
    finally:
        assert kill_marked(marker) == []  # SIGKILL: nothing of this throwaway head needs a graceful end


def test_up_joining_a_cluster_without_token_auth_says_what_to_set_on_which_side(head_without_token_auth):
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}
    env["RAY_AUTH_TOKEN"] = "b" * 64  # pdserve's side has a token, as the default asks
    cmd = [sys.executable, "-m", "pdserve_cli.main", "up", "--address", head_without_token_auth,
           "--model", "tiny", "--port", "0"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    said = out.stdout + out.stderr
    assert out.returncode == 2, said
    assert f"the Ray cluster at {head_without_token_auth} runs without token authentication" in said
    assert "restart every node of the cluster with RAY_AUTH_MODE=token" in said
    assert "run pdserve up with RAY_AUTH_MODE=disabled" in said
    assert "starting 1 prefill" not in said  # refused before any worker was placed
