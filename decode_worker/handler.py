"""The decode role on the worker runtime: receive KV, join it to the batch, stream tokens.

The receiver comes from the transport's entry in `transfer.registry`, and every channel takes
one path: the loop waits in the receiver's `poll` (a queued command wakes it: `wake`), which
serves the channel's messages (ZeroMQ sockets, or Ray calls delivered by the actor's `kv`
method) and returns each committed import. An `Abort` ends the request's transfers still
landing. A committed import goes to `_imported`: it joins the continuous batch with `add_imported` only when
its epoch is the one the coordinator reserved for that request; a stale or aborted import is
freed at once, uncached. Each migrated sequence travels under the transfer id
"<request id>/<choice index>" and runs as its own engine request with that id (its seed, index
and output count keep sampling identical to a colocated run). The prefill worker ships an n > 1
request's sequences one after another, so after importing one of them the loop waits (up
to `sibling_wait_s`) for the rest before it steps: a step started in between would hold the next
sequence's transfer for a whole step. Credits and admission: decode_worker.credits. A `Submit`
addressed to no decode worker is a request this worker prefills itself (runtime.local_requests).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from decode_worker.credits import Credits
from protocol.messages import Abort, Imported, ImportRefused, Reply, RequestFailed, Reserve, Submit, Tokens
from protocol.sampling import SamplingParams
from runtime.actor import QUEUE, WorkerConfig
from runtime.holdings import blocks_by_request
from runtime.local_requests import LocalRequests
from transfer.channel import ReceiverEndpoint
from transfer.errors import TransferError
from transfer.metrics import DEFAULT_METRICS
from transfer.registry import get as get_transport
from transfer.registry import validate as validate_transport

log = logging.getLogger(__name__)
MAX_EXPECTED = 100_000  # bound on remembered request registrations (aborts normally remove them)


@dataclass(frozen=True)
class DecodeWorkerConfig(WorkerConfig):
    transport: str = "zmq"       # how KV arrives: a name in transfer.registry
    # interface the ZeroMQ receiver binds (port picked freely; a non-loopback host binds this node's IP)
    kv_host: str = "127.0.0.1"
    reserve_ttl_s: float = 60.0  # a reservation whose imports have not all arrived by then is released
    # the transport's own options, by field name (its `transfer.registry` options dataclass, e.g.
    # ZeroMQ's receiver port range; coordinator.workers picks them for the cluster's transport)
    transport_options: dict = field(default_factory=dict)
    # after one sequence of an n > 1 request lands, how long the loop may wait for the others
    # before its next step (each is shipped once the one before it is acknowledged)
    sibling_wait_s: float = 0.05

    def __post_init__(self) -> None:
        get_transport(validate_transport(self.transport)).options_of(self.transport_options)


class DecodeHandler:
    def __init__(self, config: DecodeWorkerConfig, engine):
        """NOTE: the engine's pool must have been built with `held_back` calling this handler's
        `held_back` (decode_worker.worker does): the running requests' growth must not eat the room
        promised to coming migrations (an import that found the pool full would fail its request)."""
        from transfer.transport import TransportConfig

        self.config, self.engine = config, engine
        self.transport = get_transport(config.transport)
        usage = engine.kv.usage()
        # the scheduler preempts when an admitted import finds the pool short: the promise is kept even
        # if growth raced it
        self.credits = Credits(engine.config.block_size, config.reserve_ttl_s,
                               usage["free_blocks"] + usage["cached_blocks"],
                               make_room=engine.scheduler.make_room)
        self.imported: list[tuple[str, int]] = []  # (request, epoch) since the last settle
        self.expected: dict[str, tuple[int, set[str]]] = {}  # request id -> (epoch, transfer ids running)
        self.sequences: dict[str, tuple[str, object]] = {}    # transfer id -> (request id, Sequence)
        self.due: dict[str, int] = {}  # request id -> its sequences not imported yet (n > 1 requests)
        self.refused_imports = 0
        self.local = LocalRequests(engine)  # requests prefilled here (coordinator.decide's local path)
        keys = config.keys
        endpoint = TransportConfig(address=f"tcp://{_bind_host(config.kv_host)}:0", peer_name=config.name,
                                   secret=keys.secret if keys else "")
        self.receiver: ReceiverEndpoint = self.transport.make_receiver(
            engine.kv, endpoint, config.transport_options, admission=self.credits)
        self.address = self.receiver.address

    def held_back(self) -> int:
        """Credit not yet turned into blocks: granted, minus what imports still landing allocated."""
        landing = self.receiver.in_flight()  # imports (or streams) reserved, not committed yet
        return max(0, self.credits.reserved_blocks() - sum(len(b) for b in landing.values()))

    # ---- the calling thread -----------------------------------------------------------------------
    def accept(self, cmd):
        if isinstance(cmd, Reserve):
            granted = self.credits.reserve(cmd.request_id, cmd.epoch, cmd.num_tokens, cmd.n, cmd.sender)
            if granted:
                self.expected[cmd.request_id] = (cmd.epoch, set())  # NOTE: before any import can arrive
                self.due[cmd.request_id] = cmd.n
                for bounded in (self.expected, self.due):
                    while len(bounded) > MAX_EXPECTED:
                        bounded.pop(next(iter(bounded)))
            return Reply(granted=granted)
        if isinstance(cmd, Abort):
            self.credits.release(cmd.request_id)
            return QUEUE
        if isinstance(cmd, Submit):
            return self.local.accept(cmd)
        return Reply(error=f"a decode worker does not take {type(cmd).__name__}")

    # ---- the loop thread --------------------------------------------------------------------------
    def wake(self) -> None:
        """Any thread: a command was queued, so the loop's wait in the receiver's poll ends now."""
        self.receiver.wake()

    def wait(self, loop, timeout: float, events: list) -> None:
        loop.drain(events)
        if self.engine.has_work():  # a command just drained gave it work (a local prefill): no idle sleep
            timeout = min(timeout, self.config.busy_poll_s)
        try:
            result = self.receiver.poll(timeout)  # ends early for a queued command (`wake`)
            partial: set[str] = set()  # requests with sequences still on their way
            deadline = time.monotonic() + self.config.sibling_wait_s
            while result is not None:
                loop.drain(events)  # an abort queued before this import committed
                rid = self._imported(result, events)
                if rid is not None and self.due.get(rid):
                    partial.add(rid)
                partial = {r for r in partial if self.due.get(r)}
                wait_s = self.config.busy_poll_s
                if partial:  # the next sequence is a moment behind: a step now would make it wait a step
                    wait_s = max(wait_s, deadline - time.monotonic())
                result = self.receiver.poll(wait_s)
        except TransferError as e:  # already nacked, counted and released by the receiver
            usage = self.engine.kv.usage()
            log.warning("%s: import failed: %s (pool: %d free, %d cached; %d held back for %d reservations)",
                        self.config.name, e, usage["free_blocks"], usage["cached_blocks"],
                        self.engine.kv.held_back(), self.credits.reservations())

    def handle(self, cmd, events: list):
        if isinstance(cmd, Abort):
            self._abort(cmd.request_id)
            self.local.abort(cmd.request_id)
        elif isinstance(cmd, Submit):
            self.local.submit(cmd, events)
        return None

    def _abort(self, rid: str) -> None:
        self.receiver.abort_request(rid)  # its reservation is returned now, not at the idle bound
        _, running = self.expected.pop(rid, (0, set()))
        self.due.pop(rid, None)
        for transfer_id in running:
            self.sequences.pop(transfer_id, None)
            self.engine.abort(transfer_id)

    def _imported(self, result, events: list) -> str | None:
        """Join a committed import to the batch (or refuse it); the request id when it joined."""
        from engine.sequence import Sequence

        rid, _, index = str(result.request_id).rpartition("/")
        epoch, running = self.expected.get(rid, (None, None))
        if epoch != result.epoch or not index.isdigit():
            # stale, duplicate or aborted: nothing joins the batch, and no block of it stays cached
            self.engine.kv.free(result.seq_id, uncache=True)
            self.refused_imports += 1
            events.append(ImportRefused(rid, result.epoch, epoch))
            return
        tokens, generated = list(result.state.token_ids), result.state.num_generated
        seq = Sequence(int(index), tokens[:len(tokens) - generated], tokens[len(tokens) - generated:],
                       seq_id=result.seq_id)
        try:  # NOTE: before the sequence joins the batch: a bad field must never reach a step
            params = SamplingParams.from_dict(result.state.sampling)
            self.engine.validate_prompt(seq.prompt_ids, params)
            vocab = self.engine.model_config.vocab_size
            if any(not 0 <= t < vocab for t in seq.output_ids):
                raise ValueError(f"generated token ids outside the vocabulary [0, {vocab})")
        except ValueError as e:  # RequestError is a ValueError
            self.engine.kv.free(result.seq_id, uncache=True)
            self.refused_imports += 1
            events.append(RequestFailed(rid, result.epoch, "refused", f"import refused: {e}"))
            return
        self.engine.add_imported(result.request_id, seq.prompt_ids, params, [seq])
        self.sequences[result.request_id] = (rid, seq)
        running.add(result.request_id)
        left = self.due.pop(rid, 1) - 1
        if left > 0:
            self.due[rid] = left
        self.imported.append((rid, result.epoch))
        self._settle()  # its credit became blocks: the room held back for imports shrinks at once
        events.append(Imported(rid, int(index), result.epoch, len(result.table.blocks), result.nbytes,
                               float(sum(result.timings.values()))))
        return rid

    def on_step(self, outputs, events: list) -> None:
        self.local.on_step(outputs, events)
        for o in outputs:
            entry = self.sequences.get(o.request_id)
            if entry is None:
                continue
            rid, seq = entry
            events.append(Tokens(rid, seq.index, len(seq.output_ids) - len(o.new_token_ids),
                                 list(o.new_token_ids), (o.finish_reason or "stop") if o.finished else None,
                                 logprobs=[o.logprobs] if o.logprobs else []))
            if o.finished:
                self.sequences.pop(o.request_id, None)
                self.expected.get(rid, (0, set()))[1].discard(o.request_id)

    def after_step(self, events: list) -> None:
        self._settle()

    def _settle(self) -> None:
        """The pool's room and the imports since the last settle, to the credits together."""
        usage = self.engine.kv.usage()
        self.credits.settle(usage["free_blocks"] + usage["cached_blocks"], self.imported)
        self.imported = []

    # ---- reports ----------------------------------------------------------------------------------
    def stats(self) -> dict:
        snap = DEFAULT_METRICS.snapshot()  # this process's receiver
        errors, refusals = snap["errors"], snap["refusals"]  # refusals: unauthenticated input, by reason
        return {"refused_imports": self.refused_imports, "local_prefills": self.local.submitted,
                "reserved_blocks": self.credits.reserved_blocks(),
                "refused_reservations": self.credits.refused, "transfer_errors": sum(errors.values()),
                "checksum_errors": errors.get("checksum", 0), "kv_refusals": sum(refusals.values()),
                **{f"kv_refused_{reason}": n for reason, n in sorted(refusals.items())}}

    def holdings(self) -> dict[str, int]:
        landing = self.receiver.in_flight()
        return blocks_by_request(self.engine, self.engine.requests, lambda t: t.rpartition("/")[0], landing)

    def close(self) -> None:
        self.receiver.close()


def _bind_host(kv_host: str) -> str:
    """Loopback stays loopback (one machine); otherwise bind this node's own IP, since a decode
    worker may run on another node than the coordinator whose address `kv_host` names."""
    if kv_host in ("127.0.0.1", "localhost", "::1"):
        return kv_host
    import ray

    return ray.util.get_node_ip_address()
