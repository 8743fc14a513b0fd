"""Several Ray nodes on this one machine (`ray.cluster_utils.Cluster`: each node its own raylet,
object store and custom resources), driven the way the README's "Running across machines" says:
`pdserve up --address ... --config deploy/multinode.yaml`, as a subprocess. Prefill workers sit on
the `prefill_node` node and decode workers on the `decode_node` node; KV migrates between them over
each transport with the local engine's greedy tokens; a decode worker's process killed with
SIGKILL is replaced on a decode node; and when the coordinator itself is killed, Ray ends every
worker it owned (none is left holding blocks). All traffic stays on this machine.
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import time

import pytest

ray = pytest.importorskip("ray")

import cluster_client as cc  # noqa: E402

from engine.sampling import SamplingParams  # noqa: E402

pytestmark = [pytest.mark.timeout(400), pytest.mark.own_ray]  # joins its Ray nodes here (conftest)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = [list(range(5, 30)), [9, 8, 7] * 11]
GREEDY = {"max_tokens": 10, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    """Three nodes with Ray's token auth on, as the README says to start them; the token file is
    handed to every node, to this driver and to `pdserve up` through RAY_AUTH_TOKEN_PATH."""
    from ray.cluster_utils import Cluster

    from deploy.ray_guard import auth_env

    if ray.is_initialized():
        pytest.skip("a Ray instance is already initialised in this process")
    token = tmp_path_factory.mktemp("ray-auth") / "auth_token"
    token.write_text(os.urandom(16).hex())
    saved = os.environ.get("RAY_AUTH_TOKEN_PATH")
    os.environ["RAY_AUTH_TOKEN_PATH"] = str(token)
    try:
        with auth_env("token"):
            head = {"num_cpus": 1, "include_dashboard": False}
            cluster = Cluster(initialize_head=True, head_node_args=head)
            cluster.add_node(num_cpus=1, resources={"prefill_node": 1})
            cluster.add_node(num_cpus=1, resources={"decode_node": 1})
            cluster.wait_for_nodes()
            ray.init(address=cluster.address, log_to_driver=False)
            try:
                yield cluster
            finally:
                ray.shutdown()
                cluster.shutdown()
    finally:
        if saved is None:
            os.environ.pop("RAY_AUTH_TOKEN_PATH", None)
        else:
            os.environ["RAY_AUTH_TOKEN_PATH"] = saved


def _up(address: str, transport: str):
    """`pdserve up` against the cluster with the shipped multi-node config (model and device
    overridden for this machine); returns (process, port)."""
    cmd = [sys.executable, "-m", "pdserve_cli.main", "up", "--address", address, "--config",
           os.path.join(ROOT, "deploy", "multinode.yaml"), "--model", "tiny", "--device", "cpu",
           "--num-blocks", "128", "--host", "127.0.0.1", "--port", "0", "--transport", transport,
           "--weights", "f32"]  # compared with the local engine's f32 tokens (up defaults to bf16 on CPU)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    seen, found, deadline = "", None, time.monotonic() + 240
    while found is None and time.monotonic() < deadline and proc.poll() is None:
        # all that arrived, not one line: lines left in a reader buffer are invisible to select
        if select.select([proc.stdout], [], [], 1.0)[0]:
            seen += os.read(proc.stdout.fileno(), 1 << 16).decode(errors="replace")
            found = re.search(r"on http://127\.0\.0\.1:(\d+)/v1", seen)
    if found is None:
        proc.kill()
        raise AssertionError(f"pdserve up did not come up:\n{seen}{proc.stdout.read()}")
    return proc, int(found.group(1))


@pytest.mark.parametrize("transport", ["zmq", "ray"])
def test_roles_on_their_nodes_migrate_and_recover(nodes, local_engine, transport):
    proc, port = _up(nodes.address, transport)
    namespace = ""
    try:
        info = cc.cluster_info(port)
        by_role = {role: {w["node_id"] for w in info["workers"] if w["role"] == role}
                   for role in ("prefill", "decode")}
        node_resources = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
        assert all("prefill_node" in node_resources[n] for n in by_role["prefill"])
        assert all("decode_node" in node_resources[n] for n in by_role["decode"])
        assert not by_role["prefill"] & by_role["decode"] and len(info["workers"]) == 4

        want = cc.reference(local_engine, PROMPTS, SamplingParams(max_tokens=10, ignore_eos=True))
        for prompt, reference in zip(PROMPTS, want):
            got = cc.complete(port, {"prompt": prompt, **GREEDY})
            assert [c["token_ids"] for c in got["choices"]] == reference
            assert got["pdserve"]["backend"]["migration"]["transport"] == transport

        victim = next(w for w in info["workers"] if w["role"] == "decode")
        os.kill(victim["pid"], signal.SIGKILL)  # every worker process is on this machine
        replacement = f"{victim['name']}-r1"
        workers = cc.poll_workers(port, lambda ws: replacement in ws and ws[replacement]["alive"], 90)
        assert workers[replacement]["node_id"] in by_role["decode"] | {
            n for n, r in node_resources.items() if "decode_node" in r}
        got = cc.complete(port, {"prompt": PROMPTS[0], **GREEDY})
        assert [c["token_ids"] for c in got["choices"]] == want[0]
        namespace = next(a["namespace"] for a in ray.util.list_named_actors(all_namespaces=True)
                         if a["name"] == replacement)
    finally:
        proc.send_signal(signal.SIGKILL)  # the coordinator dies without a word
        proc.wait(30)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # its workers die with it (Ray ends actors with their owner)
        left = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == namespace]
        if not left:
            break
        time.sleep(1)
    assert left == [], json.dumps(left)
