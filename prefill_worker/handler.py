"""The prefill role on the worker runtime: prefill, send first tokens, migrate, hold on failure.

After each engine step the handler migrates every live sequence of each prefilled request to
the decode worker the coordinator named, under the epoch it gave (`transfer/`), and releases
its blocks (full ones stay in the prefix cache). A migration that fails keeps the blocks: the
request is *held* until the coordinator names another decode worker with `Resend` (no
re-prefill), and released on success, `Abort`, `DropHeld`, a newer `Submit` of the request, or
after `hold_s` without a resend (reported as `RequestFailed(kind='hold_expired')`). Exports are
tracked in a LeaseTable: a failed transfer's lease is released at once (the held request still
pins the blocks).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from protocol.messages import Abort, Connect, DropHeld, Migrated, Reply, RequestFailed, Resend, Submit, Tokens
from runtime.actor import CALL, QUEUE, WorkerConfig, refuse_submit
from transfer.errors import TransferError, TransferTimeout
from transfer.lease import LeaseTable
from transfer.messages import DecodeState

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefillWorkerConfig(WorkerConfig):
    transport: str = "zmq"           # how KV travels to decode workers: 'zmq' or 'ray'
    namespace: str = ""              # Ray namespace of the decode actors (ray transport)
    # bound on one migration's ack and on a handshake; the loop waits for it, so keep it below the
    # coordinator's heartbeat timeout
    transfer_timeout_s: float = 30.0
    # how long a request whose migration failed keeps its blocks for a `Resend` (0: release at once)
    hold_s: float = 30.0

    def __post_init__(self) -> None:
        if self.transport not in ("zmq", "ray"):
            raise ValueError(f"transport must be 'zmq' or 'ray', got {self.transport!r}")


@dataclass
class _Target:
    """Where a request's KV goes (the decode worker, its KV address, the migration epoch), and the
    engine's Request (kept: the engine retires a request that finished at its first token)."""

    decode_worker: str
    decode_address: str
    epoch: int
    request: object = None


class PrefillHandler:
    def __init__(self, config: PrefillWorkerConfig, engine):
        from transfer.senders import SenderPool

        self.config, self.engine = config, engine
        self.targets: dict[str, _Target] = {}                # request id -> migration target
        self.held: dict[str, tuple[int, float]] = {}         # request id -> (failed epoch, deadline)
        self.leases = LeaseTable()
        keys = config.keys
        self.senders = SenderPool(config.name, config.transport, engine.storage.layout.fingerprint(),
                                  config.namespace, config.transfer_timeout_s, keys.secret if keys else "")
        self.faults = self.senders.faults  # what InjectFault arms (the chaos benchmark)
        self.prefills = self.resends = self.hold_expired = 0

    # ---- the calling thread -----------------------------------------------------------------------
    def accept(self, cmd):
        """Validate a Submit here (read-only); everything else runs on the loop."""
        if isinstance(cmd, Submit):
            refusal = refuse_submit(self.engine, cmd)
            if refusal is not None:
                return refusal
            if cmd.generated and cmd.params.n != 1:
                return Reply(error="only single-choice requests can resume after a decode worker is lost")
            return QUEUE
        if isinstance(cmd, (Abort, DropHeld)):
            return QUEUE
        if isinstance(cmd, (Resend, Connect)):
            return CALL
        return Reply(error=f"a prefill worker does not take {type(cmd).__name__}")

    # ---- the loop thread --------------------------------------------------------------------------
    def handle(self, cmd, events: list):
        if isinstance(cmd, Submit):
            self._submit(cmd, events)
        elif isinstance(cmd, Abort):
            self._release(cmd.request_id)
        elif isinstance(cmd, DropHeld):
            if self.held.get(cmd.request_id, (None,))[0] == cmd.epoch:
                self._release(cmd.request_id)
        elif isinstance(cmd, Resend):
            return self._resend(cmd)
        elif isinstance(cmd, Connect):
            return Reply(error=self.senders.connect(cmd.decode_worker, cmd.decode_address) or "")
        return Reply()

    def _release(self, rid: str) -> None:
        self.targets.pop(rid, None)
        self.held.pop(rid, None)
        self.engine.abort(rid)

    def _submit(self, cmd: Submit, events: list) -> None:
        rid = cmd.request_id
        self.held.pop(rid, None)
        if rid in self.engine.requests or rid in self.engine.prefilled:
            self.engine.abort(rid)  # an earlier attempt of the same request: this one supersedes it
        try:
            self.engine.add_request(list(cmd.prompt_ids), cmd.params, request_id=rid)
        except Exception as e:  # validated already; a race with the pool
            events.append(RequestFailed(rid, cmd.epoch, "refused", str(e)))
            return
        self.prefills += 1
        if cmd.generated:  # not scheduled yet: the first prefill computes prompt + generated
            self.engine.requests[rid].seqs[0].output_ids = list(cmd.generated)
        request = self.engine.requests[rid]
        self.targets[rid] = _Target(cmd.decode_worker, cmd.decode_address, cmd.epoch, request)

    def on_step(self, outputs, events: list) -> None:
        for o in outputs:
            target = self.targets.get(o.request_id)
            if target is None:
                continue
            req = target.request
            seq = next(s for s in req.seqs if s.index == o.index)
            events.append(Tokens(o.request_id, o.index, len(seq.output_ids) - len(o.new_token_ids),
                                 list(o.new_token_ids), (o.finish_reason or "stop") if o.finished else None))
            if req.finished and o.request_id not in self.engine.prefilled:
                self.targets.pop(o.request_id, None)  # every choice ended at its first token

    def after_step(self, events: list) -> None:
        # NOTE: migrations run on this loop thread. After one to a decode worker timed out (it died),
        # the others queued for it are held at once instead of each waiting out its own timeout: the
        # loop must report again before heartbeat_timeout_s, or this worker is declared dead too.
        unreachable: set[str] = set()
        for rid in list(self.engine.prefilled):
            if rid not in self.held:
                self._migrate(rid, events, unreachable)
        self._expire_held(events)
        self.leases.expire()

    def _migrate(self, rid: str, events: list, unreachable: set | None = None) -> None:
        """Ship every live sequence of a prefilled request; on the ack free our blocks (full ones stay
        cached). On a failure hold them for a `Resend` (see the module docstring). unreachable: decode
        workers a migration to timed out in this iteration (not tried again until the next one)."""
        unreachable = set() if unreachable is None else unreachable
        target = self.targets.pop(rid, None)
        req = self.engine.prefilled[rid]
        if target is None:  # aborted meanwhile
            self.engine.release_prefilled(rid)
            return
        started = time.perf_counter()
        total = {"payload_bytes": 0, "blocks": 0, "reused_blocks": 0, "sequences": 0}
        phases: dict[str, float] = {}
        try:
            if target.decode_worker in unreachable:
                raise TransferTimeout(f"{target.decode_worker} timed out on a migration moments ago")
            sender = self.senders.get(target.decode_worker, target.decode_address)
            sampling = req.params.to_dict()
            for s in req.live_seqs:
                state = DecodeState(list(s.token_ids), sampling, len(s.output_ids))
                ack = sender.migrate(self.engine.kv, s.seq_id, f"{rid}/{s.index}", target.epoch, state,
                                     leases=self.leases)
                for k, v in sender.last_phases.items():
                    phases[k] = phases.get(k, 0.0) + v
                total["payload_bytes"] += ack.nbytes
                total["blocks"] += ack.new_blocks
                total["reused_blocks"] += ack.reused_blocks
                total["sequences"] += 1
        except (TransferError, OSError, RuntimeError, ValueError) as e:
            log.warning("%s: migration of %s to %s failed: %s", self.config.name, rid,
                        target.decode_worker, e)
            self.senders.forget_if_broken(target.decode_worker, e)
            if isinstance(e, TransferTimeout):
                unreachable.add(target.decode_worker)
            for s in req.seqs:  # the unacked exports' extra references (the table still holds them)
                self.leases.release(f"{rid}/{s.index}", target.epoch)
            held = self.config.hold_s > 0
            if held:
                self.held[rid] = (target.epoch, time.monotonic() + self.config.hold_s)
            else:
                self.engine.release_prefilled(rid)
            why = f"migration to {target.decode_worker} failed: {type(e).__name__}: {e}"
            events.append(RequestFailed(rid, target.epoch, "migration", why, held))
            return
        self.engine.release_prefilled(rid)
        events.append(Migrated(rid, target.decode_worker, target.epoch, (time.perf_counter() - started) * 1e3,
                               transport=self.config.transport, phases=phases, **total))

    def _resend(self, cmd: Resend) -> Reply:
        rid = cmd.request_id
        if self.held.pop(rid, None) is None or rid not in self.engine.prefilled:
            return Reply(error=f"request {rid} is not held on {self.config.name}")
        request = self.engine.prefilled[rid]
        self.targets[rid] = _Target(cmd.decode_worker, cmd.decode_address, cmd.epoch, request)
        self.resends += 1
        return Reply()  # the loop migrates it after this iteration's step

    def _expire_held(self, events: list) -> None:
        now = time.monotonic()
        for rid, (epoch, deadline) in list(self.held.items()):
            if deadline <= now:
                del self.held[rid]
                self.engine.abort(rid)
                self.hold_expired += 1
                events.append(RequestFailed(rid, epoch, "hold_expired", f"no decode worker took the held KV "
                                            f"within {self.config.hold_s:g}s"))

    # ---- reports ----------------------------------------------------------------------------------
    def stats(self) -> dict:
        return {"held_requests": len(self.engine.prefilled), "held_for_resend": len(self.held),
                "prefills": self.prefills, "resends": self.resends, "hold_expired": self.hold_expired,
                "prefix_hit_tokens": self.engine.kv.prefix_hit_tokens, "leases": len(self.leases),
                "faults_injected": sum(self.faults.injected.values()),
                "corruptions_injected": self.faults.corruptions()}

    def holdings(self) -> dict[str, int]:
        from runtime.holdings import blocks_by_request

        return blocks_by_request(self.engine, {**self.engine.requests, **self.engine.prefilled})

    def close(self) -> None:
        self.senders.close()
