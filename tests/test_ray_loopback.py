"""Issue 28 case 7: the embedded local Ray that `pdserve up` starts (deploy.launch.start_ray) listens
on loopback only: every listening TCP socket of this process and of every process it started
(GCS, raylet, agents, core workers, an actor's worker) is bound to 127.0.0.1, none to 0.0.0.0, ::
or the host's address. It runs with Ray's token authentication, and a client without the token
is refused. Joining a cluster with token auth and no token is refused up front, with the fix."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.own_ray  # starts or joins Ray in this process (conftest)

ray = pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")

LOOPBACK = {"127.0.0.1", "::ffff:127.0.0.1", "::1"}


def _listeners() -> list[tuple[str, str, int]]:
    """(process name, address, port) of every listening TCP socket of this process tree."""
    me = psutil.Process()
    found = []
    for proc in [me, *me.children(recursive=True)]:
        try:
            conns, name = proc.net_connections(kind="inet"), proc.name()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        found += [(name, c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN]
    return found


PROBE = ("from ray._raylet import GcsClient\n"
         "try:\n    client = GcsClient(address={gcs!r})\n"
         "    print('KEYS', len(client.internal_kv_keys(b'', namespace=None, timeout=20)))\n"
         "except Exception as e:\n    print('REFUSED', type(e).__name__, e)\n")


def _gcs_probe(gcs: str, home: str, **env: str) -> str:
    """One read of the GCS's key-value table from a fresh process with this environment."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    out = subprocess.run([sys.executable, "-c", PROBE.format(gcs=gcs)], env={**clean, "HOME": home, **env},
                         capture_output=True, text=True, timeout=120)
    return out.stdout.strip() or out.stderr[-500:]


def test_the_embedded_ray_listens_on_loopback_only_and_wants_a_token(tmp_path):
    from ray._raylet import AuthenticationMode, get_authentication_mode

    from deploy.launch import RayConfig, start_ray, stop_ray

    if ray.is_initialized():
        pytest.skip("a Ray instance is already initialised in this process")
    before = os.environ.get("RAY_AUTH_MODE")
    started = start_ray(RayConfig(num_cpus=1))
    try:
        assert started and ray.util.get_node_ip_address() == "127.0.0.1"
        assert get_authentication_mode() == AuthenticationMode.TOKEN

        @ray.remote(num_cpus=0)
        class Probe:
            def address(self) -> str:
                return ray.util.get_node_ip_address()

        probe = Probe.remote()  # a core worker of its own, with its own gRPC server
        assert ray.get(probe.address.remote(), timeout=120) == "127.0.0.1"
        listeners = _listeners()
        names = {name for name, _, _ in listeners}
        assert {"gcs_server", "raylet"} <= names, listeners
        exposed = [entry for entry in listeners if entry[1] not in LOOPBACK]
        assert exposed == [], f"Ray processes listening beyond loopback: {exposed}"

        gcs = ray.get_runtime_context().gcs_address
        assert gcs.startswith("127.0.0.1:")
        # A caller without the token (another local user has none of this user's files) is refused.
        assert _gcs_probe(gcs, str(tmp_path), RAY_AUTH_MODE="disabled").startswith("REFUSED")
        assert _gcs_probe(gcs, str(tmp_path), RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="not-it").startswith(
            "REFUSED AuthenticationError")
        assert _gcs_probe(gcs, os.path.expanduser("~"), RAY_AUTH_MODE="token").startswith("KEYS")
        ray.kill(probe)
    finally:
        stop_ray(started)
    assert os.environ.get("RAY_AUTH_MODE") == before  # the mode start_ray set is undone


def test_joining_a_cluster_with_token_auth_but_no_token_is_refused_with_the_fix(monkeypatch, tmp_path):
    from deploy.launch import RayConfig, start_ray

    if ray.is_initialized():
        pytest.skip("a Ray instance is already initialised in this process")
    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(RuntimeError, match="RAY_AUTH_TOKEN_PATH"):
        start_ray(RayConfig(address="10.255.255.1:6379"))
    assert not ray.is_initialized()
    monkeypatch.setenv("RAY_AUTH_MODE", "bogus")
    with pytest.raises(ValueError, match="RAY_AUTH_MODE"):
        start_ray(RayConfig(address="10.255.255.1:6379"))
