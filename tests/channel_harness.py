"""Every registered KV transport (`transfer.registry`) driven the same way, for the channel
conformance suite (test_channel_conformance.py).

A `Rig` is one transport: receivers of a few block sizes (each made once, reset between tests)
and sender sessions built by the registry's `make_sender`, as a prefill worker's `SenderSessions`
builds them (checksum mode from the registry, signed with the cluster secret, addressed to the
receiver by name). Everything a test asks of a receiver runs on the receiver's owner thread, as a
decode worker's commands do: `Rx.call(fn, *args)` runs `fn(endpoint, *args)` there.

- zmq, nixl, and the test-only channel loaded by module path (memory_channel.py): the endpoint
  from the registry's `make_receiver` (a `ZmqReceiver`, ...), polled on a background
  thread (`Polled`) that runs queued calls between polls (woken by `wake()`).
- ray: the endpoint is a `measure.ray_receiver.PoolReceiver` actor (named, so the registry's
  `make_sender` finds it); calls run in the actor through `__ray_call__`, in order with the
  senders' channel calls. This module is pickled by value for that (`Rig`), so the owner-side
  functions below must only use what a worker process can import (bench, kvcache, transfer,
  decode_worker).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import queue
import sys
import threading
import time
import uuid
from collections import Counter

import torch

from kvcache.storage import KVLayout
from measure.pools import make_manager
from transfer import errors as E
from transfer import registry
from transfer.faults import Faults
from transfer.transport import TransportConfig

SHAPE = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "dtype": "float16"}  # as zmq_helpers.SHAPE
SECRET = "conformance-cluster-secret"
SENDER = "prefill-0"
NAMESPACE = "pdserve-conformance"
BLOCK_SIZES = (16, 32, 8)
POOL_BLOCKS = 64


def layout(block_size: int) -> KVLayout:
    return KVLayout(block_size=block_size, **SHAPE)


def pool(block_size: int = 16, num_blocks: int = POOL_BLOCKS):
    return make_manager(layout(block_size), num_blocks)


def kv_bytes(manager, seq_id) -> bytes:
    """The computed K/V of a sequence in token order (independent of block size and placement)."""
    table = manager.table(seq_id)
    slots = [table.slot(i, manager.block_size) for i in range(table.num_computed)]
    return manager.storage.read_slots(slots).contiguous().view(torch.uint8).numpy().tobytes()


def snapshot(manager):
    """Allocator state and tables: equal snapshots mean not one block was allocated, cached or freed."""
    a = manager.allocator
    return (a.num_free, a.num_cached, a.num_used, sorted(map(str, manager.tables)),
            [a.ref_count(b) for b in range(a.num_blocks)])


# ---- run on the receiver's owner thread (or inside the Ray actor) -------------------------------------
def ep_snapshot(ep):
    return snapshot(ep.manager)


def ep_kv(ep, seq_id) -> bytes:
    return kv_bytes(ep.manager, seq_id)


def ep_in_flight(ep) -> dict:
    return ep.in_flight()


def ep_abort(ep, request_id: str) -> int:
    return ep.abort_request(request_id)


def ep_free(ep, seq_id, uncache: bool) -> None:
    ep.manager.free(seq_id, uncache=uncache)


def ep_check(ep) -> None:
    ep.manager.check_integrity()


def ep_errors(ep) -> dict:
    return dict(ep.metrics.errors)


def ep_reset(ep) -> dict:
    """Admission open, no transfer in flight, every sequence freed and nothing cached: a clean pool.
    Returns what was still in flight (a test left a stream open: its blocks are returned too)."""
    from transfer.admission import OPEN

    ep.admission = OPEN
    left = ep.in_flight()
    for request_id in {t.rpartition("/")[0] for t in left}:
        ep.abort_request(request_id)
    m = ep.manager
    for seq_id in list(m.tables):
        m.free(seq_id, uncache=True)
    m.allocator.evict_cached()
    m.check_integrity()
    return left


def ep_admit(ep, reservations) -> None:
    """The decode worker's own admission (`decode_worker.credits.Credits`), holding `reservations`:
    (request id, epoch, num_tokens, sender) each; None: everything admitted."""
    from decode_worker.credits import Credits
    from transfer.admission import OPEN

    if reservations is None:
        ep.admission = OPEN
        return
    credits = Credits(ep.manager.block_size, ttl_s=600.0, room_blocks=ep.manager.allocator.num_blocks)
    for request_id, epoch, num_tokens, sender in reservations:
        assert credits.reserve(request_id, epoch, num_tokens, 1, sender)
    ep.admission = credits


# ---- the receiver's owners ------------------------------------------------------------------------
class Polled:
    """A ReceiverEndpoint polled on a background thread, which also runs `call`s between polls.
    Imports it committed and errors its poll raised are kept (`results`, `errors`)."""

    def __init__(self, endpoint):
        self.ep = endpoint
        self.results, self.errors = [], []
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self.crash: BaseException | None = None  # what a poll raised that is not a TransferError
        self.thread = threading.Thread(target=self._run, name="rx-owner", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            while True:
                try:
                    fn, args, future = self._calls.get_nowait()
                except queue.Empty:
                    break
                try:
                    future.set_result(fn(self.ep, *args))
                except BaseException as e:  # noqa: BLE001 - handed to the caller
                    future.set_exception(e)
            try:
                result = self.ep.poll(0.05)
            except E.TransferError as e:
                self.errors.append(e)
                continue
            except BaseException as e:  # noqa: BLE001 - a bug in the endpoint: the calls will say so
                self.crash = e
                raise
            if result is not None:
                self.results.append(result)

    def failures(self) -> Counter:
        """Codes of the typed errors the endpoint's poll raised (failed imports, already released)."""
        return Counter(e.code for e in list(self.errors))

    def call(self, fn, *args, timeout: float = 30.0):
        future: concurrent.futures.Future = concurrent.futures.Future()
        if not self.thread.is_alive():
            raise RuntimeError(f"the receiver's owner thread died: {self.crash!r}")
        self._calls.put((fn, args, future))
        self.ep.wake()
        return future.result(timeout)

    def close(self) -> None:
        self._stop.set()
        self.ep.wake()
        self.thread.join(10)
        self.ep.close()


class InActor:
    """A receiving actor (`measure.ray_receiver.PoolReceiver`): calls run in it, in order."""

    def __init__(self, actor):
        self.actor = actor

    def call(self, fn, *args, timeout: float = 60.0):
        import ray

        return ray.get(self.actor.__ray_call__.remote(fn, *args), timeout=timeout)

    def failures(self) -> Counter:
        """Codes of the errors the endpoint counted (its own TransferMetrics)."""
        return Counter(self.call(ep_errors))

    def close(self) -> None:
        import ray

        ray.kill(self.actor)


class Rx:
    """One receiver of a rig: where senders reach it, and its owner."""

    def __init__(self, name: str, block_size: int, address: str, owner):
        self.name, self.block_size, self.address, self.owner = name, block_size, address, owner

    def call(self, fn, *args):
        return self.owner.call(fn, *args)

    def snapshot(self):
        return self.call(ep_snapshot)

    def kv(self, seq_id) -> bytes:
        return self.call(ep_kv, seq_id)

    def in_flight(self) -> dict:
        return self.call(ep_in_flight)

    def abort_request(self, request_id: str) -> int:
        return self.call(ep_abort, request_id)

    def free(self, seq_id, uncache: bool = False) -> None:
        """The decode side is done with the sequence: its full blocks stay cached unless `uncache`."""
        self.call(ep_free, seq_id, uncache)

    def check(self) -> None:
        self.call(ep_check)

    def admit(self, reservations) -> None:
        self.call(ep_admit, reservations)

    def reset(self) -> None:
        left = self.call(ep_reset)
        assert left == {}, f"a previous test left transfers in flight: {left}"

    def failures(self) -> Counter:
        return self.owner.failures()

    def settle(self, failures_before: Counter, code: str, timeout: float = 10.0) -> tuple[dict, Counter]:
        """Once the receiver has failed one more transfer with `code` and holds nothing in flight
        (bounded): (in flight, failures since `failures_before`). A sender's error can come before
        the receiver even read the transfer (a cancelled stream), so an empty in_flight alone says
        nothing."""
        deadline = time.monotonic() + timeout
        while True:
            new, flight = self.failures() - failures_before, self.in_flight()
            if (new[code] and not flight) or time.monotonic() > deadline:
                return flight, new
            time.sleep(0.02)

    def wait_in_flight(self, want, timeout: float = 10.0) -> dict:
        """The receiver's in-flight transfers once `want(in_flight)` holds (bounded)."""
        deadline = time.monotonic() + timeout
        while True:
            got = self.in_flight()
            if want(got) or time.monotonic() > deadline:
                return got
            time.sleep(0.02)


class Rig:
    """One transport's receivers (made on first use, one per block size) and its senders."""

    def __init__(self, name: str):
        self.name, self.transport = name, registry.get(name)
        self.label = name.rpartition(":")[2].lower()  # a transport loaded by module path: its attribute
        # a sender without the cluster secret is stopped in the socket's CURVE handshake, before a hello
        self.curve = name in ("zmq", "nixl")
        self.receivers: dict[int, Rx] = {}
        self.senders: list = []
        self._ids = itertools.count()
        if name == "ray":
            from ray import cloudpickle

            cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ep_* functions run in actors
            for block_size in BLOCK_SIZES:  # started together: each actor is a process to boot
                self.receiver(block_size)

    def receiver_config(self, rx_name: str) -> TransportConfig:
        return TransportConfig(peer_name=rx_name, secret=SECRET, idle_timeout_s=10.0)

    def receiver(self, block_size: int = 16) -> Rx:
        rx = self.receivers.get(block_size)
        if rx is not None:
            return rx
        rx_name = f"decode-{self.label}-{block_size}-{uuid.uuid4().hex[:6]}"
        config = self.receiver_config(rx_name)
        if self.name == "ray":
            import ray

            from measure.ray_receiver import PoolReceiver

            actor = ray.remote(num_cpus=0.1)(PoolReceiver).options(name=rx_name, namespace=NAMESPACE).remote(
                (SHAPE["num_layers"], SHAPE["num_kv_heads"], SHAPE["head_dim"], block_size, SHAPE["dtype"]),
                POOL_BLOCKS, config)
            rx = Rx(rx_name, block_size, f"ray://{rx_name}", InActor(actor))
        else:
            from transfer.admission import OPEN

            endpoint = self.transport.make_receiver(pool(block_size), config, admission=OPEN)
            rx = Rx(rx_name, block_size, endpoint.address, Polled(endpoint))
        self.receivers[block_size] = rx
        return rx

    def sender(self, src, rx: Rx, *, peer_name: str = SENDER, secret: str = SECRET,
               faults: Faults | None = None, **overrides):
        """A sender session from `src`'s pool to `rx`, configured as a prefill worker's SenderSessions does;
        inline_bytes 0 unless overridden: every payload is queried first and takes the data path."""
        settings = dict(address=rx.address, peer_name=peer_name, receiver=rx.name, secret=secret,
                        checksum_mode=self.transport.checksum_mode, connect_timeout_s=60.0,
                        transfer_timeout_s=30.0, chunk_bytes=4096, inline_bytes=0)
        settings.update(overrides)
        options = self.transport.pick_options({"namespace": NAMESPACE})
        config = TransportConfig(**settings)
        tx = self.transport.make_sender(src.storage.layout.fingerprint(), config, options, receiver=rx.name,
                                        faults=faults or Faults(), pool=src.storage)
        self.senders.append(tx)
        return tx

    def request_id(self, what: str) -> str:
        """A transfer id no earlier test used (receivers remember committed epochs per id)."""
        return f"{what}-{next(self._ids)}/0"

    def close_senders(self) -> None:
        """Close the sessions made so far (a NIXL sender's agent with them)."""
        senders, self.senders = self.senders, []
        for tx in senders:
            try:
                tx.close()
            except Exception:  # noqa: BLE001 - closed already
                pass

    def close(self) -> None:
        self.close_senders()
        for rx in self.receivers.values():
            rx.owner.close()
        if self.name == "ray":
            from ray import cloudpickle

            cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


# ---- feeds of a streamed migration -------------------------------------------------------------------
def feed(table, n_blocks: int, final, step: int = 4, stop_after: int | None = None,
         fail_after: int | None = None, hold=None):
    """Blocks in groups of `step` as prefill chunks complete; the last group goes with the final state.
    stop_after: the feed ends without its final item from that block on (a cancelled stream);
    fail_after: the feed raises there (the prefill failed); hold(): called after the first group."""
    for k in range(0, n_blocks - step, step):
        if stop_after is not None and k >= stop_after:
            return
        if fail_after is not None and k >= fail_after:
            raise RuntimeError("the prefill failed mid-stream")
        yield [(i, table.blocks[i]) for i in range(k, min(n_blocks, k + step))]
        if hold is not None and k == 0:
            hold()
    k = max(0, (n_blocks - 1) // step * step)
    yield [(i, table.blocks[i]) for i in range(k, n_blocks)], final


def in_thread(fn, *args, **kwargs):
    """Run fn on a daemon thread: -> (thread, outcome), outcome filled with 'result' or 'error'."""
    outcome: dict = {}

    def run():
        try:
            outcome["result"] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            outcome["error"] = e

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th, outcome
