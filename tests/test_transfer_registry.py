"""The transport registry (transfer.registry) and the receiver contract (transfer.channel): every
registered transport's receiver endpoint meets `ReceiverEndpoint`, unknown names are refused with
the registered ones named, and the registry loads without torch (the coordinator validates with it).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvcache.storage import KVLayout
from measure.pools import make_manager
from transfer import registry
from transfer.admission import OPEN
from transfer.channel import ReceiverEndpoint
from transfer.transport import TransportConfig

ROOT = Path(__file__).resolve().parent.parent


def test_names_and_refusal():
    assert registry.names() == ("zmq", "ray", "nixl")
    ray, zmq = registry.get("ray"), registry.get("zmq")
    assert ray.capabilities.same_node_pool and not zmq.capabilities.same_node_pool
    assert registry.get("ray").engine_options == {"kv_shm": True} and registry.get("zmq").engine_options == {}
    with pytest.raises(ValueError, match="'zmq', 'ray', 'nixl'"):
        registry.get("nccl")
    with pytest.raises(ValueError, match="registered already"):
        registry.register(registry.get("zmq"))


@pytest.mark.parametrize("name", registry.names())
def test_every_receiver_meets_the_contract(name):
    if name == "nixl":  # NOTE: an optional dependency
        pytest.importorskip("nixl")
    manager = make_manager(KVLayout(2, 2, 8, 16, "float16"), 16)
    rx = registry.get(name).make_receiver(manager, TransportConfig(peer_name="decode-r"), admission=OPEN)
    try:
        assert isinstance(rx, ReceiverEndpoint)
        assert rx.address  # what the coordinator hands the prefill worker
        assert rx.in_flight() == {} and rx.abort_request("r") == 0
        assert rx.poll(0.001) is None  # nothing sent: no import, no error
    finally:
        rx.close()
    assert manager.usage()["used_blocks"] == 0


def test_registry_loads_without_torch():
    code = "import sys, transfer.registry; print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"



def test_pool_readers_are_declared_in_the_registry_without_import_side_effects():
    code = ("import sys, transfer.pull, transfer.registry as r; "
            "print(r.source_ways(), 'transfer.nixl_channel' in sys.modules, r.source_opener('sim'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "('shm', 'nixl') False None"
    assert registry.source_opener("shm").__name__ == "ShmSource"
    assert registry.register_source("shm", "transfer.pull:ShmSource") == "shm"  # the same again: a no-op
    with pytest.raises(ValueError, match="declared already"):
        registry.register_source("shm", "elsewhere:Reader")
    with pytest.raises(ValueError, match="module:callable"):
        registry.register_source("odd", "no_colon")
