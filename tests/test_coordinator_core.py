"""The coordinator's core (coordinator.core) driven directly, without Ray, sockets or clocks: each
test feeds it hand-made events (a request, a decode worker's answer, a worker report, a liveness
check at a given time, a drain's timeout) and asserts the decisions it returns and the state it
leaves."""

from __future__ import annotations

import ast
import pathlib

import pytest

from coordinator.backend import FinalEvent, TokenEvent
from coordinator.config import ClusterConfig
from coordinator.core import ClusterCore
from coordinator.errors import InternalError, InvalidRequest, ServiceUnavailable
from coordinator.guard import Overloaded
from coordinator.ledger import Phase
from coordinator.membership import Conflict, Membership, WorkerNotFound
from coordinator.metrics import Metrics
from coordinator.state import ClusterState, Redispatch, Replace, ResendHeld, RetryPrefill, Tell
from coordinator.workers import WorkerState
from protocol.messages import (
    Abort,
    DropHeld,
    Heartbeat,
    Migrated,
    RequestFailed,
    Resend,
    Submit,
    Tokens,
    WorkerReport,
)

T0 = 1000.0  # the virtual time every test starts at
PROMPT = list(range(1, 21))  # 20 tokens: 2 blocks of 16 with the one being filled


def worker(name: str, role: str, free: int = 100, total: int = 128) -> WorkerState:
    return WorkerState(name, role, handle=None, address=f"tcp://{name}", block_size=16, slot=name,
                       stats={"free_blocks": free, "total_blocks": total, "used_blocks": 0, "queue_depth": 0},
                       last_seen=T0)


def make_core(prefill: int = 2, decode: int = 2, colocated: int = 0, **config) -> ClusterCore:
    cfg = ClusterConfig(prefill=prefill, decode=decode, colocated=colocated, routing="round_robin", **config)
    core = ClusterCore(ClusterState.create(cfg, Metrics(), clock=lambda: T0))  # no wall clock anywhere
    roles = [("colocated", colocated)] if colocated else [("prefill", prefill), ("decode", decode)]
    Membership(core).place({f"{role}-{i}": worker(f"{role}-{i}", role)
                            for role, n in roles for i in range(n)})
    return core


def report(name: str, holdings: dict | None = None, events: list = (), used: int = 0) -> WorkerReport:
    stats = {"free_blocks": 100, "total_blocks": 128, "used_blocks": used, "queue_depth": 0}
    return WorkerReport(name, stats, dict(holdings or {}), list(events))


def outputs(request) -> list:
    out = []
    while not request.q.empty():
        out.append(request.q.get_nowait())
    return out


def aborts(actions) -> list[tuple[str, str]]:
    return sorted((a.worker.name, a.command.request_id) for a in actions
                  if isinstance(a, Tell) and isinstance(a.command, Abort))


def admitted(core: ClusterCore, rid: str = "r1", now: float = T0):
    """A request routed, a decode room reserved on the first candidate, dispatched to its prefill worker."""
    request = core.route(rid, 1, PROMPT, {}, now)
    epoch = core.reservation_epoch(request)
    decode = core.reserve_candidates(request, now)[0]
    taken, _ = core.reserved(request, decode)
    assert taken
    target, cmd = core.submit_command(request)
    return request, epoch, target, cmd


# ---- routing and admission ---------------------------------------------------------------------
def test_a_request_is_routed_admitted_and_submitted_to_its_prefill_worker_under_the_migration_epoch():
    core = make_core()
    request, epoch, target, cmd = admitted(core)
    assert (request.prefill, request.decode) == ("prefill-0", "decode-0")
    entry = core.state.ledger.get("r1")
    # opened at epoch 0; PREFILLING is epoch 1, the reserved MIGRATING move will be epoch 2
    assert epoch == request.epoch == 2 and (entry.phase, entry.owner, entry.epoch) == (Phase.PREFILLING,
                                                                                     "prefill-0", 1)
    assert target.name == "prefill-0"
    assert cmd == Submit("r1", PROMPT, {}, "decode-0", "tcp://decode-0", 2, [])


def test_decode_room_is_asked_of_the_chosen_worker_first_then_by_free_blocks_and_a_refusal_is_counted():
    core = make_core(decode=3)
    core.state.workers["decode-1"].stats["free_blocks"] = 10
    core.state.workers["decode-2"].stats["free_blocks"] = 50
    request = core.route("r1", 1, PROMPT, {}, T0)
    assert request.decode == "decode-0"
    assert [w.name for w in core.reserve_candidates(request, T0)] == ["decode-0", "decode-2", "decode-1"]
    core.refused(core.state.workers["decode-0"])
    assert b'pdserve_backpressure_refusals_total{worker="decode-0"} 1.0' in core.state.metrics.render()
    taken, actions = core.reserved(request, core.state.workers["decode-2"])
    assert taken and request.decode == "decode-2"
    assert aborts(actions) == [("decode-0", "r1")]  # an earlier attempt's credit there goes back


def test_a_grant_after_the_request_was_dropped_gives_the_credit_back():
    core = make_core()
    request = core.route("r1", 1, PROMPT, {}, T0)
    core.reservation_epoch(request)
    assert aborts(core.drop(request, ok=False)) == [("decode-0", "r1"), ("prefill-0", "r1")]
    taken, actions = core.reserved(request, core.state.workers["decode-1"])
    assert not taken and aborts(actions) == [("decode-1", "r1")]
    assert core.state.ledger.get("r1").phase is Phase.FAILED


def test_admission_refuses_what_fits_no_pool_when_no_decode_worker_lives_and_beyond_the_waiting_line():
    core = make_core(max_waiting=2)
    for w in core.state.role("decode"):
        w.stats["total_blocks"] = 1
    request = core.route("r1", 1, PROMPT, {}, T0)
    with pytest.raises(InvalidRequest, match="exceed every decode worker's KV pool"):
        core.reserve_candidates(request, T0)
    # both decode workers silent for longer than the heartbeat timeout: not alive at this time
    with pytest.raises(ServiceUnavailable, match="no live decode worker"):
        core.reserve_candidates(request, T0 + core.state.config.heartbeat_timeout_s + 1)
    core.may_wait(1)
    with pytest.raises(Overloaded):
        core.may_wait(2)


def test_no_live_prefill_worker_refuses_the_request_with_503():
    core = make_core(prefill=1)
    core.mark_dead("prefill-0", "ActorDiedError")
    with pytest.raises(ServiceUnavailable, match="no live prefill worker"):
        core.route("r1", 1, PROMPT, {}, T0)
    assert core.state.ledger.get("r1") is None and not core.state.requests


# ---- reports, the ledger, the reconciler -------------------------------------------------------
def test_reports_move_the_ledger_reorder_tokens_and_finish_the_request():
    core = make_core()
    request, epoch, *_ = admitted(core)
    # the decode worker's tokens arrive before the prefill worker's first token and its Migrated
    actions = core.on_message(report("decode-0", {"r1": 2}, [Tokens("r1", 0, 1, [8, 9], "length")]), T0 + 1)
    assert actions == [] and outputs(request) == []  # position 0 is missing: held back
    assert core.state.ledger.get("r1").phase is Phase.DECODING  # through MIGRATING
    assert core.state.ledger.owned_blocks() == {"decode-0": 2}
    migrated = Migrated("r1", "decode-0", epoch, 3.0, 4096, 2, 0, 1, "zmq")
    actions = core.on_message(report("prefill-0", {}, [Tokens("r1", 0, 0, [7]), migrated]), T0 + 2)
    *tokens, final = outputs(request)
    assert tokens == [TokenEvent(0, (7,)), TokenEvent(0, (8, 9), "length")]  # in output order
    assert isinstance(final, FinalEvent) and final.info["migration"]["ms"] == 3.0
    assert request.finished and aborts(actions) == [("decode-0", "r1")]  # finished: only the decode side
    history = core.state.ledger.get("r1").history  # (time, phase, owner, epoch) per move
    assert [h[1:] for h in history] == [("queued", None, 0), ("prefilling", "prefill-0", 1),
                                        ("migrating", "decode-0", 2), ("decoding", "decode-0", 3),
                                        ("finished", None, 4)]
    assert {h[0] for h in history} == {T0}
    assert core.state.ledger.get("r1").phase is Phase.FINISHED and "r1" not in core.state.requests


def test_the_final_event_says_where_the_request_ran():
    core = make_core()
    request, epoch, *_ = admitted(core)
    migrated = Migrated("r1", "decode-0", epoch, 3.0, 4096, 2, 0, 1, "zmq")
    core.on_message(report("prefill-0", {}, [Tokens("r1", 0, 0, [7]), migrated]), T0 + 1)
    core.on_message(report("decode-0", {}, [Tokens("r1", 0, 1, [8], "stop")]), T0 + 2)
    *tokens, final = outputs(request)
    assert [t.token_ids for t in tokens] == [(7,), (8,)]
    assert isinstance(final, FinalEvent) and final.prompt_tokens == len(PROMPT)
    assert final.info["prefill_worker"] == "prefill-0" and final.info["decode_worker"] == "decode-0"
    assert final.info["migration"]["bytes"] == 4096 and final.info["path"]["path"] == "disaggregate"


def test_an_event_of_an_earlier_attempt_is_ignored_and_its_held_blocks_dropped():
    core = make_core()
    request, epoch, *_ = admitted(core)
    stale = RequestFailed("r1", epoch - 2, "migration", "old attempt", held=True)
    actions = core.on_message(report("prefill-0", {"r1": 2}, [stale, Tokens("r1", 0, 0, [5])]), T0 + 1)
    assert actions == [Tell(core.state.workers["prefill-0"], DropHeld("r1", epoch - 2))]
    assert outputs(request) == [TokenEvent(0, (5,))] and "r1" in core.state.requests


def test_the_ledger_is_reconciled_orphans_aborted_and_vanished_blocks_fail_the_request():
    core = make_core(ledger_grace_s=1.0)
    request, *_ = admitted(core)
    core.on_message(report("prefill-0", {"r1": 2, "ghost": 1}, used=3), T0)
    assert core.state.ledger.owned_blocks() == {"prefill-0": 2}
    found = []
    for i in range(1, 4):  # the orphan must outlive the grace and MIN_REPORTS reports
        found += core.on_message(report("prefill-0", {"r1": 2, "ghost": 1}, used=3), T0 + i)
    assert aborts(found) == [("prefill-0", "ghost")]
    # r1 was listed under its epoch, and is no more: its blocks vanished
    for i in range(4, 8):
        found = core.on_message(report("prefill-0", {}), T0 + i)
        if "r1" not in core.state.requests:
            break
    assert aborts(found) == [("decode-0", "r1"), ("prefill-0", "r1")]
    (error,) = outputs(request)
    assert isinstance(error, InternalError) and "vanished on prefill-0" in error.message
    assert core.state.ledger.summary()["failed"] == 1 and core.state.ledger.owned_blocks() == {}


def test_heartbeats_keep_a_worker_alive_and_unknown_messages_are_counted():
    core = make_core()
    core.on_message(Heartbeat("decode-1", True, 0.0, 0, 0.0), T0 + 4)
    assert core.state.workers["decode-1"].last_seen == T0 + 4
    assert core.on_message("not a report", T0) == []
    assert b'pdserve_errors_total{kind="bad_event"} 1.0' in core.state.metrics.render()


# ---- failover ----------------------------------------------------------------------------------
def silent_since(core: ClusterCore, name: str) -> float:
    """A time at which only `name` has been silent longer than the heartbeat timeout."""
    later = T0 + core.state.config.heartbeat_timeout_s + 1
    for w in core.state.workers.values():
        if w.name != name:
            w.last_seen = later
    return later


def test_a_prefill_worker_lost_before_migrating_is_rerun_on_another_and_replaced():
    core = make_core()
    request, *_ = admitted(core)
    actions = core.check_liveness(silent_since(core, "prefill-0"))
    assert actions == [RetryPrefill(request, "prefill-0"), Replace(core.state.workers["prefill-0"])]
    assert request.prefill == "prefill-1" and core.state.lost == {"prefill-0"}
    assert core.check_liveness(silent_since(core, "prefill-0")) == []  # acted on once
    target, cmd = core.submit_command(request)  # the driver dispatches again
    assert target.name == "prefill-1" and cmd.decode_worker == "decode-0"


def test_a_decode_worker_lost_mid_decode_resumes_from_the_tokens_streamed_on_another():
    core = make_core()
    request, epoch, *_ = admitted(core)
    migrated = Migrated("r1", "decode-0", epoch, 3.0, 4096, 2, 0, 1, "zmq")
    core.on_message(report("prefill-0", {}, [Tokens("r1", 0, 0, [7]), migrated]), T0)
    core.on_message(report("decode-0", {"r1": 2}, [Tokens("r1", 0, 1, [8, 9])]), T0)
    actions = core.check_liveness(silent_since(core, "decode-0"))
    assert actions == [Tell(core.state.workers["decode-0"], Abort("r1")), Redispatch(request),
                       Replace(core.state.workers["decode-0"])]
    assert request.decode == "decode-1" and request.generated == [7, 8, 9] and request.resumed == 1
    assert request.migration is None and not request.decoded and "decode-0" in request.avoid


def test_a_worker_lost_with_no_other_to_go_to_fails_its_request_cleanly():
    core = make_core(prefill=1, decode=1)
    request, *_ = admitted(core)
    core.state.workers["decode-0"].dead = "ActorDiedError"  # both gone at once
    actions = core.check_liveness(silent_since(core, "prefill-0"))
    assert aborts(actions) == [("decode-0", "r1"), ("prefill-0", "r1")]
    assert sum(isinstance(a, Replace) for a in actions) == 2
    (error,) = outputs(request)
    assert isinstance(error, ServiceUnavailable) and "prefill-0 stopped responding" in error.message
    assert core.state.ledger.summary()["failed"] == 1 and not core.state.requests


def test_a_resume_with_no_prefill_worker_left_returns_the_failed_decode_workers_credit():
    """The decode worker `bad` failed a migration and no prefill worker is live: the request fails,
    and the Abort that returns its credit goes to `bad`, not to the decode worker picked next."""
    core = make_core(prefill=1, decode=2)
    request, *_ = admitted(core)
    assert request.decode == "decode-0"
    core.state.lost.add("prefill-0")
    actions = core.resume(request, "decode-0", "migration to decode-0 failed", T0)
    assert ("decode-0", "r1") in aborts(actions) and ("decode-1", "r1") not in aborts(actions)
    (error,) = outputs(request)
    assert isinstance(error, ServiceUnavailable) and "no other live decode/prefill worker" in error.message


def test_colocated_requests_of_a_lost_worker_fail_with_503():
    core = make_core(colocated=2)
    request = core.route("r1", 1, PROMPT, {}, T0)
    assert core.reservation_epoch(request) is None
    target, cmd = core.submit_command(request)
    assert cmd == Submit("r1", PROMPT, {}) and core.state.ledger.get("r1").phase is Phase.DECODING
    actions = core.check_liveness(silent_since(core, target.name))
    assert aborts(actions) == [(target.name, "r1")]
    (error,) = outputs(request)
    assert isinstance(error, ServiceUnavailable) and "the request was lost" in error.message


def test_a_failed_migration_with_held_blocks_is_resent_under_a_new_epoch_else_reprefilled():
    core = make_core()
    request, epoch, *_ = admitted(core)
    failed = RequestFailed("r1", epoch, "migration", "transfer timed out", held=True)
    (action,) = core.on_message(report("prefill-0", {"r1": 2}, [failed]), T0)
    assert action == ResendHeld(request, "decode-0", "transfer timed out")
    new = core.begin_resend(request, "decode-0")
    assert new == request.epoch == 3 and request.resending  # PREFILLING again at 2, the migration at 3
    assert core.state.ledger.get("r1").epoch == 2
    taken, actions = core.reserved(request, core.reserve_candidates(request, T0)[0])
    assert taken and request.decode == "decode-1" and aborts(actions) == [("decode-0", "r1")]
    target, cmd = core.resend_command(request)
    assert target.name == "prefill-0" and cmd == Resend("r1", "decode-1", "tcp://decode-1", new)
    assert core.resent(request, "decode-0", "transfer timed out", None, T0) == []
    assert request.resent == 1 and not request.resending
    # a second failure whose blocks are no longer held: prefill again instead
    actions = core.resent(request, "decode-1", "timed out", "no longer held", T0)
    assert isinstance(actions[-1], Redispatch) and request.resumed == 3  # each resend, and the resume



def test_a_migration_the_sender_failed_after_the_decode_worker_imported_it_finishes_there():
    """The receiver committed and decoded, but its ack to the sender was lost or late: the prefill
    worker reports a failed migration holding the blocks. The request is not moved (with one
    decode worker it used to fail with 503 after every token had arrived; found by `dst`)."""
    core = make_core(decode=1)
    request, epoch, *_ = admitted(core)
    core.on_message(report("decode-0", {"r1": 2}, [Tokens("r1", 0, 0, [7, 8], "length")]), T0)
    assert outputs(request) == [TokenEvent(0, (7, 8), "length")]  # waits for the Migrated report
    failed = RequestFailed("r1", epoch, "migration", "no ack within the timeout", held=True)
    actions = core.on_message(report("prefill-0", {"r1": 2}, [failed]), T0 + 1)
    (final,) = outputs(request)
    assert isinstance(final, FinalEvent)
    assert final.info["migration"]["sender_error"] == "no ack within the timeout"
    drops = [a.command for a in actions if isinstance(a, Tell) and isinstance(a.command, DropHeld)]
    assert drops == [DropHeld("r1", epoch)] and not any(isinstance(a, ResendHeld) for a in actions)
    assert core.state.ledger.get("r1").phase is Phase.FINISHED


def test_a_prefill_worker_lost_after_the_decode_worker_imported_does_not_leave_the_request_waiting():
    """Its Migrated report died with it: the request finishes with its last token instead of
    waiting for a report that cannot come (it used to end only at the event timeout; `dst`)."""
    core = make_core()
    request, epoch, *_ = admitted(core)
    core.on_message(report("decode-0", {"r1": 2}, [Tokens("r1", 0, 0, [7])]), T0)
    core.mark_dead("prefill-0", "ActorDiedError")
    actions = core.check_liveness(T0 + 1)
    assert not any(isinstance(a, (RetryPrefill, Redispatch)) for a in actions)  # it stays where it is
    assert request.migration["sender_error"].startswith("prefill worker prefill-0 was lost")
    assert outputs(request) == [TokenEvent(0, (7,))]
    core.on_message(report("decode-0", {"r1": 2}, [Tokens("r1", 0, 1, [8], "length")]), T0 + 2)
    *_, final = outputs(request)
    assert isinstance(final, FinalEvent) and core.state.ledger.get("r1").phase is Phase.FINISHED

# ---- draining and scaling ----------------------------------------------------------------------
def test_drain_refuses_an_unknown_worker_the_last_of_its_role_and_a_second_drain():
    core = make_core(prefill=1)
    members = Membership(core)
    with pytest.raises(WorkerNotFound):
        members.check_drain("decode-9")
    with pytest.raises(Conflict, match="last live prefill worker"):
        members.check_drain("prefill-0")
    members.begin_drain(members.check_drain("decode-0"), T0)
    with pytest.raises(Conflict, match="already draining"):
        members.check_drain("decode-0")
    with pytest.raises(Conflict, match="last live decode worker"):
        members.check_drain("decode-1")


def test_a_drain_takes_the_worker_out_of_routing_and_completes_once_it_is_idle():
    core = make_core()
    members = Membership(core)
    request, epoch, *_ = admitted(core)
    drained = core.state.workers["decode-0"]
    members.begin_drain(drained, T0)
    assert [w.worker_id for w in core.loads("decode", T0)] == ["decode-1"]
    assert core.route("r2", 1, PROMPT, {}, T0).decode == "decode-1"
    assert members.needing(drained) == [request] and not members.idle(drained)
    migrated = Migrated("r1", "decode-0", epoch, 3.0, 4096, 2, 0, 1, "zmq")
    core.on_message(report("prefill-0", {}, [Tokens("r1", 0, 0, [7]), migrated]), T0)
    core.on_message(report("decode-0", {}, [Tokens("r1", 0, 1, [8], "stop")]), T0)
    assert members.idle(drained)  # finished in place
    assert members.retire(drained) == []
    members.end_drain(drained)
    assert "decode-0" not in core.state.workers and "decode-0" in core.state.retired
    assert members.fresh_slot("decode") == "decode-2"  # a retired slot is never reused


def test_a_drain_past_its_timeout_moves_the_requests_off_and_returns_what_is_still_held():
    core = make_core()
    members = Membership(core)
    request, epoch, *_ = admitted(core)
    migrated = Migrated("r1", "decode-0", epoch, 3.0, 4096, 2, 0, 1, "zmq")
    core.on_message(report("prefill-0", {}, [Tokens("r1", 0, 0, [7]), migrated]), T0)
    core.on_message(report("decode-0", {"r1": 2}, [Tokens("r1", 0, 1, [8])]), T0)
    drained = core.state.workers["decode-0"]
    members.begin_drain(drained, T0)
    actions, moved, failed = members.move_off(drained, "worker decode-0 drained (timeout 1s)", T0 + 1)
    assert (moved, failed) == (1, 0) and isinstance(actions[-1], Redispatch)
    assert request.decode == "decode-1" and request.generated == [7, 8]
    assert members.idle(drained) is False  # its last report still lists r1's blocks
    assert aborts(members.retire(drained)) == [("decode-0", "r1")]


def test_one_scale_at_a_time_within_bounds():
    core = make_core()
    members = Membership(core)
    with pytest.raises(InvalidRequest, match="roles are prefill, decode"):
        members.begin_scale({"colocated": 2})
    with pytest.raises(InvalidRequest, match="1..64"):
        members.begin_scale({"decode": 0})
    members.begin_scale({"decode": 3})
    with pytest.raises(Conflict, match="already under way"):
        members.begin_scale({"decode": 1})
    members.end_scale()
    core.state.workers["decode-1"].holdings = {}
    assert [w.name for w in members.surplus("decode", 1)] == ["decode-0"]


# ---- replacing lost workers --------------------------------------------------------------------
def test_replacement_backoff_doubles_then_holds_steady_and_a_worker_that_came_back_is_kept():
    core = make_core(restart_backoff_s=1.0, max_restarts=2, restart_max_backoff_s=30.0)
    members = Membership(core)
    dead = core.state.workers["decode-0"]
    core.check_liveness(silent_since(core, "decode-0"))
    assert members.begin_replace(dead) and not members.begin_replace(dead)  # one replacement at a time
    assert members.replace_backoff(dead, T0 + 10)[0] == 1.0
    assert "replacement try 1 in 1s" in core.state.slot_status["decode-0"]
    assert members.still_lost(dead)
    new = worker("decode-0-r1", "decode")
    members.replacing_with(dead, new, "lost", T0 + 11)
    assert members.restart_delay("decode-0", T0 + 12) == (2.0, 1)
    core.state.restarts["decode-0"].append(T0 + 13)
    assert members.restart_delay("decode-0", T0 + 14) == (30.0, 2)
    members.end_join(new)
    members.joined(new, replaces=dead)
    assert "decode-0" not in core.state.workers and "decode-0" not in core.state.lost
    members.end_replace(dead)
    assert "decode-0" not in core.state.slot_status
    slow = core.state.workers["decode-1"]
    core.state.lost.add("decode-1")
    core.check_liveness(T0)  # decode-1 is alive at T0 again: lost no more
    assert not members.still_lost(slow)


# ---- the shape ---------------------------------------------------------------------------------
ROOT = pathlib.Path(__file__).resolve().parents[1]
CORE = ("coordinator/core.py", "coordinator/membership.py", "coordinator/state.py")
IO_MODULES = {"asyncio", "ray", "time", "socket", "zmq", "threading", "protocol.queues",
              "coordinator.cluster", "coordinator.lifecycle", "coordinator.drain", "coordinator.tasks"}


def imported_modules(tree: ast.AST) -> set[str]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


@pytest.mark.parametrize("path", CORE)
def test_the_core_awaits_nothing_and_imports_no_io(path):
    """The deciding half imports neither Ray, sockets, threads nor a clock, nor the driver, and
    has no coroutine: what it needs of time is passed in."""
    tree = ast.parse((ROOT / path).read_text())
    assert not [n for n in ast.walk(tree) if isinstance(n, (ast.AsyncFunctionDef, ast.Await))]
    assert imported_modules(tree) & IO_MODULES == set()


def test_no_mixin_in_the_coordinator():
    """No class named *Mixin, nor built from one, anywhere in coordinator/."""
    found = []
    for path in sorted((ROOT / "coordinator").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = [ast.unparse(b) for b in node.bases]
                if node.name.endswith("Mixin") or any(b.endswith("Mixin") for b in bases):
                    found.append(f"{path.name}: {node.name}({', '.join(bases)})")
    assert found == []
