"""The cluster across Ray nodes that are machines of their own (tests/netns_nodes.py: a head on a
bridge in the root namespace, a prefill node and a decode node each with its own network namespace,
address and /dev/shm), driven as the README says: `pdserve up --address HEAD --config
deploy/multinode.yaml --model tiny --device cpu`. The workers sit on their nodes' namespace
addresses, the decode worker's KV receiver binds on its node's address (not loopback), greedy tokens
over zmq, Ray and NIXL equal the local engine's, and the migrated bytes cross the decode node's veth
(its counters). The decode node's link is then cut for a few seconds mid-load: each request is
answered with the local engine's tokens or fails with a clean 5xx, never wrong (the cut lands on the
first streamed token of a long request: one request is in flight at the fault, an event rather than
a guess at timing), and once the link is back the cluster answers right again (the decode worker
reconnected, or was replaced). Then, on one more `pdserve up` with two spare decode nodes added
after placement: the decode node killed whole, and the next decode node's link cut for good; each
time every answer right or a clean 5xx, the worker replaced on a live node, no block leaked (counts
and recovery time printed). Last, a Hugging Face checkpoint the decode nodes lack reaches them from
Ray's object store. Skipped where the harness cannot run (not root, no `ip`).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import threading
import time
import urllib.error

import pytest

ray = pytest.importorskip("ray")

import cluster_client as cc  # noqa: E402
import netns_nodes  # noqa: E402

from bench.netns_serve import start_up, stop_up  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402
from transfer.channels.nixl_pool import available as nixl_available  # noqa: E402

WHY = netns_nodes.unavailable()
pytestmark = [pytest.mark.skipif(WHY is not None, reason=WHY or ""), pytest.mark.timeout(300),
              pytest.mark.own_ray]  # joins its netns Ray nodes in this process (conftest)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = [list(range(5, 40)), [9, 8, 7] * 11, [(j * 13) % 200 + 2 for j in range(30)]]
GREEDY = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
# the request a fault lands in: streamed, its first token the moment of the fault, then this many
# more tokens to decode (hundreds of steps: it is still decoding when the fault lands)
LONG = {"prompt": PROMPTS[0], "max_tokens": 400, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def nodes():
    if ray.is_initialized():
        pytest.skip("a Ray instance is already initialised in this process")
    specs = [netns_nodes.NodeSpec({"prefill_node": 1}), netns_nodes.NodeSpec({"decode_node": 1})]
    with netns_nodes.NetnsCluster(specs) as cluster:
        cluster.connect()
        yield cluster


def _up(cluster, transport: str, model: str = "tiny"):
    """`pdserve up` joined to the namespaced cluster, one worker per role; returns (process, port)."""
    return start_up(cluster, transport, model)


def _answer(port: int, prompt: list[int]):
    """(token ids, the response's migration record), or (the status of a clean failure, None)."""
    try:
        body = cc.complete(port, {"prompt": prompt, **GREEDY})
    except urllib.error.HTTPError as e:
        return e.code, None
    return body["choices"][0]["token_ids"], body["pdserve"]["backend"].get("migration")


def _references(local_engine) -> tuple[list[list[int]], list[int]]:
    """The local engine's greedy tokens for PROMPTS (GREEDY) and for LONG."""
    want = [r[0] for r in cc.reference(local_engine, PROMPTS, SamplingParams(max_tokens=12, ignore_eos=True))]
    [[want_long]] = cc.reference(local_engine, [LONG["prompt"]],
                                 SamplingParams(max_tokens=LONG["max_tokens"], ignore_eos=True))
    return want, want_long


def _fault_in_flight(pool, port: int, inflict) -> tuple[concurrent.futures.Future, float]:
    """Stream LONG on `pool` and call inflict() when its first token arrives: the fault lands while
    that request is in flight (an event, not a guess at timing). Returns (the future of the stream's
    outcome, see _long_outcome; the monotonic time of the fault)."""
    landed, at = threading.Event(), []

    def fault() -> None:
        try:
            inflict()
        finally:
            at.append(time.monotonic())
            landed.set()

    future = pool.submit(cc.stream_killing, port, LONG, fault)
    while not landed.wait(0.1):  # bounded: the stream's own HTTP timeout ends a stuck request
        assert not future.done(), f"the long request ended before its first token: {future.result()}"
    return future, at[0]


def _long_outcome(lines: list[str]) -> list[int] | str:
    """The streamed token ids, or 'failed clean' when the stream ended with an error chunk; either
    way it must end with [DONE]."""
    assert lines and lines[-1] == "[DONE]", lines[-3:]
    chunks = [json.loads(line) for line in lines[:-1]]
    if "error" in chunks[-1]:
        return "failed clean"
    return [t for c in chunks for choice in c.get("choices", []) for t in choice.get("token_ids") or []]


NIXL = pytest.param("nixl", marks=pytest.mark.skipif(not nixl_available(), reason="nixl is not installed"))


@pytest.mark.parametrize("transport", ["zmq", "ray", NIXL])
def test_prefill_and_decode_on_their_own_nodes_and_a_cut_link(nodes, local_engine, transport):
    want, want_long = _references(local_engine)
    proc, port = _up(nodes, transport)
    try:
        info = cc.cluster_info(port)
        by_role = {w["role"]: w for w in info["workers"]}
        prefill, decode = by_role["prefill"], by_role["decode"]
        assert prefill["node_address"] == nodes.node_ip(0) and decode["node_address"] == nodes.node_ip(1)
        if decode["address"].startswith("tcp://"):  # zmq, nixl: the receiver binds on the node's address
            assert nodes.node_ip(1) in decode["address"] and "127.0.0.1" not in decode["address"], decode
        assert prefill["address"] != decode["address"]

        before = nodes.link_bytes(1)
        moved = 0
        for prompt, reference in zip(PROMPTS, want):
            tokens, migration = _answer(port, prompt)
            assert tokens == reference, (prompt, tokens, reference, migration)
            assert migration["transport"] == transport and migration["to"] == decode["name"], migration
            moved += migration["bytes"]
        after = nodes.link_bytes(1)
        # the KV crossed the decode node's link: over Ray, the object-store path, not the same-node
        # /dev/shm one (the decode node has a /dev/shm of its own, so it cannot map the sender's pool)
        assert after["to_node"] - before["to_node"] >= moved > 0

        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS) * 2 + 1) as pool:
            answers = [pool.submit(_answer, port, p) for p in PROMPTS * 2]
            try:
                long, cut = _fault_in_flight(pool, port, lambda: nodes.link(1, up=False))
                time.sleep(3.0)  # the fault's length, not a bound on anything
            finally:
                nodes.link(1, up=True)
            got = [a.result(timeout=180)[0] for a in answers]
            long_got = _long_outcome(long.result(timeout=180))
        for answer, reference in zip(got, want * 2):  # right, or a clean server-side failure
            assert answer == reference or answer in (500, 503, 504), (answer, reference)
        assert long_got in (want_long, "failed clean"), long_got

        deadline, last = time.monotonic() + 90, None  # bounded: reconnected, or replaced
        while time.monotonic() < deadline:
            last = _answer(port, PROMPTS[0])[0]
            if last == want[0]:
                break
            time.sleep(0.5)
        recovered = time.monotonic() - cut
        assert last == want[0], json.dumps(cc.cluster_info(port))[:2000]
        rest = cc.wait_at_rest(port, 30)
        leaked = sum(w["used_blocks"] + w.get("reserved_blocks", 0) for w in rest["workers"] if w["alive"])
        print(f"link cut 3 s ({transport}): {sum(a == r for a, r in zip(got, want * 2))} right, "
              f"{sum(isinstance(a, int) for a in got)} failed clean, of {len(got)}; the streamed one in "
              f"flight: {'right' if long_got == want_long else long_got}; {leaked} leaked blocks; "
              f"answering right again {recovered:.1f}s after the cut")
        assert rest["ledger"]["active_requests"] == 0 and leaked == 0, rest["workers"]
        live_decode = [w for w in rest["workers"] if w["role"] == "decode" and w["alive"]]
        assert live_decode and all(w["node_address"] == nodes.node_ip(1) for w in live_decode)
    finally:
        stop_up(proc)


@pytest.fixture(scope="module")
def spared(nodes):
    """One `pdserve up` over zmq with its decode worker on node 1, then two spare decode nodes
    (added after the workers were placed, so only a replacement lands there): one per fault below,
    which each take out the node the decode worker is on."""
    proc, port = _up(nodes, "zmq")
    try:
        spares = [nodes.add_node(netns_nodes.NodeSpec({"decode_node": 1})) for _ in range(2)]
        yield port, spares
    finally:
        stop_up(proc)


def _fault(nodes, port: int, want: list, want_long: list[int], inflict, what: str) -> dict:
    """Load, `inflict(i)` on the node i of the live decode worker once a request is in flight (the
    first token of a long stream, _fault_in_flight), then:
    every answer right or a clean 5xx (bounded); a decode worker replaced on another live node; the
    recovery time (fault to the first right answer from the replacement); no block leaked."""
    ips = {nodes.node_ip(i): i for i in range(len(nodes.specs))}
    (decode,) = [w for w in cc.cluster_info(port)["workers"] if w["role"] == "decode" and w["alive"]]
    lost = ips[decode["node_address"]]
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS) * 2 + 1) as pool:
        answers = [pool.submit(_answer, port, p) for p in PROMPTS * 2]
        long, start = _fault_in_flight(pool, port, lambda: inflict(lost))
        got = [a.result(timeout=180)[0] for a in answers]
        long_got = _long_outcome(long.result(timeout=180))
    answered = time.monotonic() - start
    counts = {"correct": sum(a == r for a, r in zip(got, want * 2)),
              "failed_clean": sum(a in (500, 503, 504) for a in got)}
    counts["wrong"] = len(got) - counts["correct"] - counts["failed_clean"]
    counts["in_flight"] = "right" if long_got == want_long else long_got  # the long stream's outcome

    deadline, last, replacement = time.monotonic() + 120, None, None  # bounded
    while time.monotonic() < deadline:
        last = _answer(port, PROMPTS[0])[0]
        live = [w for w in cc.cluster_info(port)["workers"] if w["role"] == "decode" and w["alive"]]
        replacement = next((w for w in live if w["node_address"] != nodes.node_ip(lost)), None)
        if last == want[0] and replacement is not None:
            break
        time.sleep(0.25)
    counts["recovery_s"] = round(time.monotonic() - start, 1)
    rest = cc.wait_at_rest(port, 30)
    live = [w for w in rest["workers"] if w["alive"]]
    counts["leaked_blocks"] = sum(w["used_blocks"] + w.get("reserved_blocks", 0) for w in live)
    print(f"{what}: {counts['correct']} correct, {counts['failed_clean']} failed clean, {counts['wrong']} "
          f"wrong, of {len(got)}, the streamed one in flight {counts['in_flight']} (all answered "
          f"{answered:.1f}s after the fault); {counts['leaked_blocks']} "
          f"leaked blocks; recovered in {counts['recovery_s']}s (decode worker on node {lost} -> "
          f"{replacement and replacement['name']} on {replacement and replacement['node_address']})")
    assert counts["wrong"] == 0, (got, want)
    assert long_got in (want_long, "failed clean"), long_got
    assert last == want[0] and replacement is not None, json.dumps(cc.cluster_info(port))[:2000]
    assert ips[replacement["node_address"]] != lost and ips[replacement["node_address"]] != 0
    assert rest["ledger"]["active_requests"] == 0 and counts["leaked_blocks"] == 0, rest["workers"]
    assert cc.ledger_differences(rest) == {}
    return counts


def test_a_node_lost_whole(nodes, spared, local_engine):
    """Every process in the decode node's namespace killed at once (raylet, the decode worker)."""
    want, want_long = _references(local_engine)
    _fault(nodes, spared[0], want, want_long, nodes.kill_node, "node lost (zmq)")


def test_a_link_down_for_good(nodes, spared, local_engine):
    """The decode node's link cut and never restored: the node is alive but unreachable (Ray's
    health checks declare it dead; its raylet and worker run on, cut off, until the harness ends)."""
    want, want_long = _references(local_engine)
    _fault(nodes, spared[0], want, want_long, lambda i: nodes.link(i, up=False), "link down for good (zmq)")


def test_the_model_reaches_a_node_that_lacks_it(nodes, tmp_path):
    """A Hugging Face checkpoint that every namespaced node but the prefill node's lacks (an empty
    tmpfs over its parent directory in their mount namespaces, so the path does not exist there; an
    empty directory at the path itself would count as local: runtime.model_store.resolve checks
    only that the path exists): with model_distribution auto (the default) the decode worker loads
    the coordinator's copy from Ray's object store across the link, and its greedy tokens equal
    the local engine's."""
    from bench.engine_speed import write_random_llama
    from engine.engine import EngineConfig, LLMEngine

    ckpt = write_random_llama(str(tmp_path / "llama"), seed=3, vocab=300, hidden=64, layers=2, heads=4,
                              kv_heads=2, intermediate=128)
    engine = LLMEngine(EngineConfig(model=ckpt))
    want = [r[0] for r in cc.reference(engine, PROMPTS, SamplingParams(max_tokens=12, ignore_eos=True))]
    hidden = [i for i in range(1, len(nodes.specs)) if nodes.hide(i, str(tmp_path))]
    assert hidden and os.listdir(ckpt)  # still there for this (the coordinator's) namespace
    proc, port = _up(nodes, "zmq", model=ckpt)
    try:
        by_role = {w["role"]: w for w in cc.cluster_info(port)["workers"] if w["alive"]}
        assert by_role["prefill"]["node_address"] == nodes.node_ip(0)
        assert by_role["prefill"]["model_source"] == "local", by_role["prefill"]
        assert by_role["decode"]["model_source"] == "object_store", by_role["decode"]
        assert by_role["decode"]["node_address"] in map(nodes.node_ip, hidden)
        got = [_answer(port, p)[0] for p in PROMPTS]
        decode = by_role["decode"]
        print("model from the object store:", decode["name"], "on", decode["node_address"], "tokens equal:",
              got == want)
        assert got == want
    finally:
        stop_up(proc)
