"""The chaos benchmark's faults: what each one does to the running cluster, and the load it runs under.

A `Fault` names an injector (called once per phase, while the phase's load is in flight, on a
`Target`: the in-process `ClusterServer`, its HTTP port, the layout fingerprint of the model),
the prompt and output lengths of its load, and the transfer fault it arms, if any. Kills send
SIGKILL to a worker's process (its pid from /v1/cluster) at the moment its last report shows it in
the wanted state: a prefill worker with prompts queued or running (mid-prefill), a decode worker
with a reservation open for an incoming migration (mid-transfer; the prefill worker's next sends
are delayed by 0.2 s so the window is wide enough to hit), or with sequences decoding (mid-decode).
Transfer faults arm the prefill workers' senders (`InjectFault`) so their next migrations each
suffer one. The forged event is a worker report pushed from a socket without the cluster's CURVE
keys; the forged import is a KV sender without the cluster secret, first handshaking and then
skipping the handshake and sending a manifest with payload anyway. Hostile input (bad HTTP fields,
forged KV handshakes) is bench.chaos_hostile's. Each injector returns a detail
dict; `breaches` in it counts what the cluster accepted from a forger (each one is a wrong answer).
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from dataclasses import dataclass

from bench.chaos_hostile import hostile_input
from protocol.messages import TRANSFER_FAULTS, InjectFault

CORRUPTIONS = ("flip_payload", "flip_manifest")


@dataclass
class Target:
    """What an injector acts on: the ClusterServer (in this process), its port, the model's
    KV layout fingerprint (for the forged sender), and the number of faults each arming sets."""

    server: object
    port: int
    fingerprint: dict
    fault_count: int = 3
    log: object = print
    settle_s: float = 5.0  # how long a death takes to be noticed (the heartbeat timeout and a bit)


def cluster_info(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/cluster", timeout=10) as r:
        return json.loads(r.read())


def live(info: dict, role: str) -> list[dict]:
    return [w for w in info["workers"] if w["alive"] and w["role"] == role]


def command(t: Target, name: str, cmd) -> None:
    """Send a typed command to a worker actor and check its reply."""
    import ray

    from protocol.codec import decode, encode

    reply = decode(ray.get(t.server.backend.workers[name].handle.command.remote(encode(cmd)), timeout=30))
    if getattr(reply, "error", ""):
        raise RuntimeError(f"{name} refused {cmd}: {reply.error}")


def arm(t: Target, kind: str, count: int) -> dict:
    """Arm every live prefill worker's senders with `count` faults of `kind`."""
    names = [w["name"] for w in live(cluster_info(t.port), "prefill")]
    for name in names:
        command(t, name, InjectFault(kind, count))
    return {"armed": count * len(names), "armed_on": names}


def _kill_when(t: Target, role: str, busy, wait_s: float = 15.0) -> dict:
    """SIGKILL the first live worker of `role` for which `busy(worker, ledger)` holds (its last
    report and the ledger's summary, polled every 50 ms, at most wait_s; then the busiest one, and
    the detail says the state was not caught). `fault_at`: when the kill was sent (monotonic)."""
    end = time.monotonic() + wait_s
    while True:
        info = cluster_info(t.port)
        workers = live(info, role)
        hit = [w for w in workers if busy(w, info["ledger"])]
        if hit or time.monotonic() > end:
            break
        time.sleep(0.05)
    victim = hit[0] if hit else max(workers, key=lambda w: w.get("active_requests", 0))
    os.kill(victim["pid"], signal.SIGKILL)
    at = time.monotonic()
    state = {k: victim.get(k) for k in ("active_requests", "queue_depth", "running", "used_blocks",
                                        "reserved_blocks") if k in victim}
    state["ledger_by_phase"] = info["ledger"].get("by_phase", {})
    return {"victim": victim["name"], "pid": victim["pid"], "state_caught": bool(hit), "state": state,
            "fault_at": at}


def kill_prefill(t: Target) -> dict:
    # a prefill worker reports after its step and its migrations: the ledger's PREFILLING requests
    # (submitted to it, not yet migrated) show the prompts it is working on
    return _kill_when(t, "prefill", lambda w, ledger: w["queue_depth"] > 0 or w["running"] > 0
                      or ledger.get("by_phase", {}).get("prefilling", 0) > 0)


def kill_decode_mid_transfer(t: Target) -> dict:
    detail = arm(t, "delay_data", t.fault_count)  # each send stalls 0.2 s mid-payload
    return {**_kill_when(t, "decode", lambda w, ledger: w.get("reserved_blocks", 0) > 0), **detail}


def kill_decode_mid_decode(t: Target) -> dict:
    return _kill_when(t, "decode", lambda w, ledger: w["running"] > 0)


def client_disconnect(t: Target) -> dict:
    return {}  # the phase's requests carry disconnect_after: the clients walk away themselves


def transfer_fault(kind: str):
    def inject(t: Target) -> dict:
        return arm(t, kind, t.fault_count)
    inject.__name__ = kind
    return inject


def forged_event(t: Target) -> dict:
    """A WorkerReport claiming to be a live decode worker, pushed without the CURVE keys."""
    import zmq

    from protocol.codec import encode
    from protocol.messages import WorkerReport

    victim = live(cluster_info(t.port), "decode")[0]["name"]
    stats = {"used_blocks": 999_999, "failed": "forged"}
    forged = WorkerReport(victim, stats, {"ghost-request": 999_999}, [])
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, 2000)
    sent = 0
    try:
        sock.connect(t.server.backend._pull.address)
        for _ in range(3):
            try:
                sock.send(encode(forged))
                sent += 1
            except zmq.Again:  # the CURVE handshake never completes: nothing can be queued
                break
        time.sleep(1.0)
    finally:
        sock.close(0)
        ctx.term()
    seen = {w["name"]: w for w in cluster_info(t.port)["workers"]}.get(victim, {})
    holdings = t.server.backend.workers.get(victim)
    breached = (seen.get("used_blocks") == 999_999 or seen.get("failed") == "forged"
                or (holdings is not None and "ghost-request" in holdings.holdings))
    return {"victim": victim, "messages_queued": sent, "breaches": int(breached)}


def forged_import(t: Target) -> dict:
    """KV offered to a decode worker without the cluster secret: the handshake must be refused,
    and a manifest sent without a handshake must be refused too; nothing may land."""
    import torch

    from kvcache.storage import KVLayout
    from measure.pools import fill_random_sequence, make_manager
    from protocol.sampling import SamplingParams
    from transfer.errors import TransferError
    from transfer.reblock import check_compatible
    from transfer.registry import get as get_transport
    from transfer.transport import TransportConfig
    from transfer.wire_messages import DecodeState

    fp = t.fingerprint
    layout = KVLayout(fp["num_layers"], fp["num_kv_heads"], fp["head_dim"], fp["block_size"], fp["dtype"],
                      fp["model"])
    manager = make_manager(layout, 16)
    tokens = list(range(300, 364))
    fill_random_sequence(manager, "forged", len(tokens), torch.Generator().manual_seed(7), tokens)
    dw = live(cluster_info(t.port), "decode")[0]
    refused, breaches = [], 0
    cluster = t.server.backend  # the coordinator in this process: its transport and Ray namespace
    transport = get_transport(cluster.config.transport)
    for step in ("handshake", "manifest_without_handshake"):
        config = TransportConfig(address=dw["address"], peer_name="prefill-0", connect_timeout_s=5,
                                 transfer_timeout_s=5, checksum_mode=transport.checksum_mode)
        sender = transport.make_sender(layout.fingerprint(), config, receiver=dw["name"],
                                       options=transport.pick_options({"namespace": cluster.namespace}),
                                       pool=manager.storage)
        try:
            if step == "handshake":
                sender.connect()
            else:  # act as if the handshake had passed and send the manifest + payload straight away
                sender.plan = check_compatible(layout.fingerprint(), layout.fingerprint())
                state = DecodeState(tokens, SamplingParams().to_dict(), 0)
                sender.migrate(manager, "forged", "forged-request/0", 1, state, dedupe=False)
            breaches += 1
        except TransferError as e:
            refused.append(f"{step}: {type(e).__name__}")
        finally:
            sender.close()
    return {"victim": dw["name"], "refused": refused, "breaches": breaches}


@dataclass(frozen=True)
class Fault:
    """One phase of the benchmark. prompt_len / max_tokens: inclusive ranges of the load's
    requests. disconnect: a share of the streamed requests walk away after 2 chunks. kills:
    restarts this fault causes (the phase waits for the replacement)."""

    name: str
    inject: object
    prompt_len: tuple[int, int] = (8, 96)
    max_tokens: tuple[int, int] = (8, 32)
    disconnect: bool = False
    kills: int = 0

    @property
    def transfer(self) -> bool:
        return self.name in TRANSFER_FAULTS


FAULTS = [
    Fault("none", lambda t: {}),
    Fault("kill_prefill_mid_prefill", kill_prefill, prompt_len=(256, 768), kills=1),
    Fault("kill_decode_mid_transfer", kill_decode_mid_transfer, prompt_len=(256, 768), kills=1),
    Fault("kill_decode_mid_decode", kill_decode_mid_decode, max_tokens=(48, 96), kills=1),
    Fault("client_disconnect", client_disconnect, max_tokens=(32, 64), disconnect=True),
    *(Fault(kind, transfer_fault(kind), prompt_len=(64, 400)) for kind in TRANSFER_FAULTS),
    Fault("forged_event", forged_event),
    Fault("forged_import", forged_import),
    Fault("hostile_input", hostile_input),
]
BY_NAME = {f.name: f for f in FAULTS}
