"""The simulator models exactly what a transport declares (dst.guarantees): every registered
transport holds every invariant under its own guarantees; the faults drawn for it are only those
its guarantees allow; each guarantee changes what the network does; a failure's replay line names
the transport it ran under, and replays only under it."""

import dataclasses
import shlex

import pytest

from dst.faults import KINDS
from dst.guarantees import NetModel, net_model
from dst.net import Network
from dst.run import quiet, replay_command, run_seed, run_seeds, shrink
from pdserve_cli.main import main
from transfer.registry import get, names

SEEDS = 300  # per transport


@pytest.fixture(autouse=True)
def _quiet():
    quiet()


def _model(name: str, base: str = "zmq", **changes) -> NetModel:
    return NetModel(name, dataclasses.replace(get(base).guarantees, **changes))


@pytest.mark.parametrize("transport", names())
def test_each_transport_holds_every_invariant_drawing_only_what_it_allows(transport):
    model, drawn, failures, answered = net_model(transport), set(), [], 0
    for seed in range(SEEDS):
        out = run_seed(seed, transport=transport)
        drawn |= {f.kind for f in out.faults}
        answered += out.answered
        if out.violation is not None:
            failures.append((seed, out.violation, replay_command(seed, out.faults, transport=transport)))
    assert failures == []
    assert answered > SEEDS // 2
    g = get(transport).guarantees
    assert drawn <= set(model.kinds) and len(drawn) >= len(model.kinds) - 1  # (the swarm draws nearly all)
    assert ("reorder" in drawn) == (not g.ordered_per_caller)  # every registered one: ordered per caller
    assert "cut" in drawn and "delay" in drawn  # every registered one: a reply can be lost after running
    assert ("late_read" in model.kinds) == g.one_sided_reads_are_events


def test_the_fault_kinds_follow_each_guarantee():
    zmq = net_model("zmq")
    assert "reorder" not in zmq.kinds and "late_read" not in zmq.kinds and "cut" in zmq.kinds
    assert "reorder" in _model("unordered", ordered_per_caller=False).kinds
    no_lost = _model("no-lost-replies", reply_may_be_lost_after_running=False)
    assert not {"cut", "delay"} & set(no_lost.kinds) and "drop" in no_lost.kinds
    assert not no_lost.admits("drop", kv=True, reply=True) and no_lost.admits("drop", kv=True, reply=False)
    assert zmq.admits("drop", kv=True, reply=True)
    assert "late_read" in net_model("nixl").kinds and net_model("nixl").late_reads_land
    assert not _model("cancellable", "nixl", issued_read_cancellable=True).late_reads_land
    for model in (zmq, net_model("ray"), net_model("nixl")):  # the control plane: only ever late
        assert [k for k in KINDS if model.admits(k, kv=False, reply=False) and k in
                ("drop", "dup", "reorder", "corrupt", "cut", "late_read")] == []


def test_a_transport_that_keeps_replies_never_loses_one():
    """Drawn at every send, drop hits only requests; cut and delay are never drawn."""
    net = Network(0, rates={"drop": 1.0, "cut": 1.0, "delay": 1.0},
                  model=_model("no-lost-replies", reply_may_be_lost_after_running=False))
    for i in range(10):
        net.send("prefill-0", "decode-0", [b"H", b"%d" % i], b"prefill-0#1")  # a request
        net.send("decode-0", "prefill-0", [b"h", b"%d" % i], b"prefill-0#1")  # its reply
    assert [(f.at, f.kind) for f in net.fired] == [(at, "drop") for at in range(1, 21, 2)]


class _Node:
    def __init__(self):
        self.incarnation, self.got = 0, []

    def on_message(self, env):
        self.got.append((env.conn, env.payload[1]))


def _deliveries(model, crash_after: int | None = None, conns=(b"p#1",), n=30) -> list:
    net = Network(7, model=model)
    node = net.nodes["d"] = _Node()
    for i in range(n):
        if i == crash_after:
            while net.step():
                pass
            node.incarnation += 1  # a restart, its memory lost
        net.send("p", "d", [b"D", b"%d" % i], conns[i % len(conns)])
    while net.step():
        pass
    return node.got


def test_ordered_per_caller_orders_each_connection_and_only_that():
    got = _deliveries(net_model("zmq"), conns=(b"p#1", b"p#2"))
    for conn in (b"p#1", b"p#2"):  # each connection in the order it was sent
        mine = [int(x) for c, x in got if c == conn]
        assert mine == sorted(mine) and len(mine) == 15
    assert [int(x) for _, x in got] != list(range(30))  # the two connections interleave freely
    unordered = [int(x) for _, x in _deliveries(_model("unordered", ordered_per_caller=False))]
    assert sorted(unordered) == list(range(30)) and unordered != list(range(30))


def test_restarts_decide_whether_an_old_connection_reaches_the_new_process():
    # restarted under the same name (ray): the old connection reaches the new process
    assert [x for _, x in _deliveries(net_model("ray"), crash_after=10)] == [b"%d" % i for i in range(30)]
    # back at a new address (zmq): what the old connection sends after the restart goes nowhere,
    # while a connection opened since reaches it
    assert [x for _, x in _deliveries(net_model("zmq"), crash_after=10)] == [b"%d" % i for i in range(10)]
    got = _deliveries(net_model("zmq"), crash_after=10, conns=(b"p#1",) * 10 + (b"p#2",) * 20)
    assert [x for _, x in got] == [b"%d" % i for i in range(30)]


def test_a_late_read_lands_where_reads_cannot_be_cancelled_and_the_replay_names_the_transport():
    """Under nixl, a pool reader that does not stop a timed-out read before the receiver frees its
    blocks (the mutant) is caught; the replay line names nixl and replays it; zmq, which reads no
    pool, refuses that schedule; the real code survives it."""
    name = "late_read_lands"
    [out] = run_seeds(0, 200, mutant_name=name, transport="nixl")["failures"]
    small = shrink(out.seed, out.faults, name, transport="nixl")
    assert [f.kind for f in small] == ["late_read"] and "written while free" in out.violation
    cmd = replay_command(out.seed, small, name, transport="nixl")
    assert " --transport nixl " in cmd
    argv = shlex.split(cmd)[1:]
    assert main(argv) == 1
    assert main(argv[:argv.index("--mutant")]) == 0  # the real code (NixlSource closes first)
    argv[argv.index("nixl")] = "zmq"
    assert main(argv) == 2  # zmq does not allow late_read: not silently replayed without it
    assert replay_command(3, []).endswith("--transport zmq")  # the default is named too


def test_a_failed_pool_read_does_not_poison_the_connections_later_transfers():
    # found by the simulator: one nixl read past its bound closed the connection's pool reader, and
    # every later pulled transfer on that connection failed on the closed reader (TransportClosed)
    # until a timeout reset the connection. transfer.pull.PoolReader opens a new one instead
    from dst.faults import parse_schedule

    faults = parse_schedule("13:late_read:4944")
    out = run_seed(70, faults, transport="nixl", requests=3)
    assert out.violation is None
    assert (out.answered, out.failed) == (2, 1), out  # only the request whose read was late fails
    clean = run_seed(70, [], transport="nixl", requests=3)
    assert (clean.answered, clean.failed) == (3, 0)
