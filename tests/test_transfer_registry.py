"""The transport registry (transfer.registry) and the receiver contract (transfer.channel): every
registered transport's receiver endpoint meets `ReceiverEndpoint`, unknown names are refused with
the registered ones named, and the registry loads without torch (the coordinator validates with it).
"""

from __future__ import annotations

import dataclasses
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
            "print(r.source_ways(), 'transfer.channels.nixl' in sys.modules, r.source_opener('sim'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "('shm', 'nixl') False None"
    assert registry.source_opener("shm").__name__ == "ShmSource"
    assert registry.register_source("shm", "transfer.pull:ShmSource") == "shm"  # the same again: a no-op
    with pytest.raises(ValueError, match="declared already"):
        registry.register_source("shm", "elsewhere:Reader")
    with pytest.raises(ValueError, match="module:callable"):
        registry.register_source("odd", "no_colon")


MEMORY = "memory_channel:MemoryChannel"  # tests/memory_channel.py, a channel outside transfer/


def test_a_transport_is_loaded_by_module_path(tmp_path, monkeypatch):
    memory = registry.get(MEMORY)
    assert memory.name == MEMORY and registry.get(MEMORY) is memory  # named by its path, loaded once
    assert registry.validate(MEMORY) == MEMORY and MEMORY not in registry.names()
    manager = make_manager(KVLayout(2, 2, 8, 16, "float16"), 16)
    rx = memory.make_receiver(manager, TransportConfig(peer_name="decode-m"), admission=OPEN)
    try:
        assert isinstance(rx, ReceiverEndpoint) and rx.address == "memory://decode-m"
    finally:
        rx.close()
    # a Transport itself, or a factory of one
    (tmp_path / "plugged.py").write_text(
        "from memory_channel import MemoryChannel\n"
        "ENTRY = MemoryChannel.TRANSPORT\n"
        "def entry():\n    return ENTRY\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert registry.get("plugged:ENTRY").sender == registry.get("plugged:entry").sender == memory.sender


@pytest.mark.parametrize("path, why", [
    ("no_such_module_here:Channel", "ModuleNotFoundError"),
    ("memory_channel:NoSuchChannel", "AttributeError"),
    ("memory_channel:_ENDPOINTS", "names a dict, not a transfer.registry.Transport"),
    ("memory_channel:make_sender", "its factory raised TypeError"),
    (":Channel", "is not 'module:attr'"),
])
def test_a_bad_module_path_is_a_typed_error_naming_it(path, why):
    with pytest.raises(registry.TransportPathError, match=why) as info:
        registry.get(path)
    assert repr(path) in str(info.value) and isinstance(info.value, ValueError)


def test_up_refuses_a_bad_transport_before_starting_anything(capsys):
    from pdserve_cli.main import main

    assert main(["up", "--transport", "no_such_module_here:Channel"]) == 2
    assert "'no_such_module_here:Channel' cannot be loaded" in capsys.readouterr().err
    assert main(["up", "--transport", "nccl"]) == 2
    assert "'zmq', 'ray', 'nixl'" in capsys.readouterr().err  # the built-in names


@pytest.mark.parametrize("name", registry.names() + (MEMORY,))
def test_every_transport_declares_its_delivery_guarantees(name):
    declared = registry.get(name).guarantees
    assert isinstance(declared, registry.Guarantees)
    assert all(type(v) is bool for v in dataclasses.asdict(declared).values())
    with pytest.raises(TypeError, match="guarantees"):  # an entry cannot leave them out
        registry.Transport(name, "m:make_sender", "m:make_receiver")


def test_the_declared_guarantees_say_what_issue_53_says():
    ray, nixl, zmq = (registry.get(n).guarantees for n in ("ray", "nixl", "zmq"))
    # Ray: calls from one caller arrive in order, a call can run while its reply is lost, actors restart
    assert ray.ordered_per_caller and ray.reply_may_be_lost_after_running and ray.restarts
    # NIXL and same-node pool reads: a read is an event, not a message, and cannot be cancelled once issued
    for g in (ray, nixl):
        assert g.one_sided_reads_are_events and not g.issued_read_cancellable
    assert not zmq.one_sided_reads_are_events and not zmq.restarts and not nixl.restarts


def test_each_transport_takes_its_own_frozen_options():
    """The factories take the transport's own options dataclass (issue 53), not the union of every
    transport's keywords: a worker's config carries its fields by name, and the coordinator offers
    every setting while each entry picks its own."""
    zmq, ray, nixl = (registry.get(n) for n in ("zmq", "ray", "nixl"))
    assert (zmq.options, ray.options, nixl.options) == (registry.ZmqOptions, registry.RayOptions,
                                                        registry.NixlOptions)
    for kind in (zmq, ray, nixl):
        assert dataclasses.is_dataclass(kind.options) and kind.options.__dataclass_params__.frozen
    offered = {"kv_port_min": 7000, "kv_port_max": 7010, "namespace": "pd"}
    assert zmq.pick_options(offered) == {"kv_port_min": 7000, "kv_port_max": 7010}
    assert ray.pick_options(offered) == {"namespace": "pd"}
    assert zmq.options_of(zmq.pick_options(offered)) == registry.ZmqOptions(7000, 7010)
    assert ray.options_of(None) == registry.RayOptions()
    made = registry.NixlOptions(kv_port_min=1)
    assert nixl.options_of(made) is made
    with pytest.raises(ValueError, match="'zmq' takes options"):
        zmq.options_of({"namespace": "pd"})  # Ray's, not ZeroMQ's


def test_the_ray_channel_is_not_the_zeromq_channel():
    """They share the message pipe's protocol (`MessageChannel`), not a subclass relation."""
    from transfer.channels.message_channel import MessageChannel
    from transfer.channels.ray import RayChannel
    from transfer.channels.zmq import ZmqChannel

    assert not issubclass(RayChannel, ZmqChannel)
    assert issubclass(RayChannel, MessageChannel) and issubclass(ZmqChannel, MessageChannel)


def test_the_zeromq_receiver_listens_in_its_options_port_range():
    """`ZmqOptions(kv_port_min, kv_port_max)`: the first free port of the range (a firewall's)."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        first = probe.getsockname()[1]  # taken while the probe holds it: the receiver skips it
        manager = make_manager(KVLayout(2, 2, 8, 16, "float16"), 16)
        config = TransportConfig(address="tcp://127.0.0.1:0", peer_name="decode-p")
        options = {"kv_port_min": first, "kv_port_max": first + 40}
        rx = registry.get("zmq").make_receiver(manager, config, options, admission=OPEN)
        try:
            port = int(rx.address.rsplit(":", 1)[1])
            assert first < port <= first + 40
        finally:
            rx.close()


def test_the_workers_get_their_transports_options_from_the_cluster_config():
    """coordinator.workers offers the cluster's settings; each transport's workers carry only its
    own (validated by the worker configs against the entry)."""
    from coordinator.config import ClusterConfig
    from coordinator.workers import transport_options
    from decode_worker.handler import DecodeWorkerConfig
    from prefill_worker.handler import PrefillWorkerConfig

    zmq = transport_options(ClusterConfig(transport="zmq", kv_port_min=7000, kv_port_max=7010), "pd-1")
    ray = transport_options(ClusterConfig(transport="ray", kv_port_min=7000, kv_port_max=7010), "pd-1")
    assert zmq == {"kv_port_min": 7000, "kv_port_max": 7010} and ray == {"namespace": "pd-1"}
    DecodeWorkerConfig("d", "", transport="zmq", transport_options=zmq)
    PrefillWorkerConfig("p", "", transport="ray", transport_options=ray)
    with pytest.raises(ValueError, match="takes options"):
        DecodeWorkerConfig("d", "", transport="zmq", transport_options=ray)


@pytest.mark.parametrize("command", [["bench", "serve"], ["bench", "chaos"], ["bench", "soak"], ["demo"]])
def test_every_cluster_command_takes_a_transport_by_module_path_and_refuses_a_bad_one(command, capsys):
    from pdserve_cli.main import build_parser

    parser = build_parser()
    assert parser.parse_args([*command, "--transport", MEMORY]).transport == MEMORY
    assert parser.parse_args([*command, "--transport", "ray"]).transport == "ray"
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args([*command, "--transport", "no_such_module_here:Channel"])
    assert exit_.value.code == 2
    assert "'no_such_module_here:Channel' cannot be loaded" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args([*command, "--transport", "nccl"])
    assert "unknown transport 'nccl'" in capsys.readouterr().err


def test_a_receiver_on_a_taken_port_leaves_no_thread_or_context_behind():
    """A taken port (make_receiver then tries the next one) stops the CURVE authenticator's thread
    and ends the context: left behind, the context's collection blocked in term() on that thread's
    socket, hanging whatever collected it."""
    import socket
    import threading

    import zmq

    from transfer.channels.zmq_receiver import ZmqReceiver

    manager = make_manager(KVLayout(2, 2, 8, 16, "float16"), 16)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        before = {t.ident for t in threading.enumerate()}
        config = TransportConfig(address=f"tcp://127.0.0.1:{port}", peer_name="decode-t", secret="s" * 32)
        with pytest.raises(zmq.ZMQError):
            ZmqReceiver(manager, config, admission=OPEN)
        assert {t.ident for t in threading.enumerate() if t.is_alive()} <= before
