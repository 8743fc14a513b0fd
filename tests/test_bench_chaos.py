"""A small `pdserve bench chaos` run on a local Ray: a bit flip in KV payloads, a SIGKILL of a decode
worker mid-decode, a forged import and a forged event, each under concurrent load. Every answer is
the local engine's or a clean failure, nothing leaks, every injected corruption is detected and
nothing else is; the JSON has the issue's keys and the plot is written. Correctness only: no
timing thresholds."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("ray")

from bench.chaos_client import ChaosRequest, Outcome, classify  # noqa: E402
from bench.chaos_report import KEYS  # noqa: E402
from pdserve_cli.main import main  # noqa: E402

pytestmark = pytest.mark.timeout(300)

FAULTS = ("flip_payload", "kill_decode_mid_decode", "forged_import", "forged_event")


def test_classify_verdicts():
    ref = [[1, 2, 3]]
    assert classify(Outcome("answer", {0: [1, 2, 3]}), ref) == "correct"
    assert classify(Outcome("answer", {0: [1, 2, 4]}), ref) == "wrong"
    assert classify(Outcome("error", {0: [1, 2]}, 200, "gone"), ref) == "failed_clean"
    assert classify(Outcome("error", {0: [9]}, 200, "gone"), ref) == "wrong"  # wrong tokens, then an error
    assert classify(Outcome("disconnected", {0: [1]}), ref) == "correct"
    assert classify(Outcome("unclean", {}, 0, "timed out"), ref) == "wrong"  # no answer, no error
    assert ChaosRequest(0, [5], {"max_tokens": 2}, stream=True).body()["stream"] is True


def test_small_chaos_run(ray_local, tmp_path):
    out, fig = tmp_path / "chaos.json", tmp_path / "chaos.png"
    rc = main(["bench", "chaos", "--faults", ",".join(FAULTS), "--requests-per-fault", "8",
               "--concurrency", "4", "--json", str(out), "--plot", str(fig)])
    report = json.loads(out.read_text())
    assert fig.stat().st_size > 0
    assert [e["fault"] for e in report["faults"]] == list(FAULTS)
    for e in report["faults"]:
        assert set(KEYS) | {"fault"} <= set(e)
        assert e["requests"] >= 8 and e["correct"] + e["failed_clean"] + e["wrong"] == e["requests"]
        assert e["wrong"] == 0, e
        assert e["leaked_blocks"] == 0, e
        assert e["corruptions_injected"] == e["corruptions_detected"], e
        assert e["false_positives"] == 0, e
    by = {e["fault"]: e for e in report["faults"]}
    assert sum(e["detail"]["streamed_migrations"] for e in report["faults"]) > 0  # streams were hit too
    assert by["flip_payload"]["corruptions_injected"] > 0  # not vacuous: flips happened and were caught
    forged = by["forged_import"]["detail"]
    assert forged["breaches"] == 0 and len(forged["refused"]) == 2  # the handshake, the bare manifest
    assert by["forged_event"]["detail"]["breaches"] == 0
    assert by["kill_decode_mid_decode"]["recovery_s"] is not None  # the replacement joined and served
    assert set(report["totals"]) == set(KEYS)
    assert report["totals"]["wrong"] == 0 and report["totals"]["leaked_blocks"] == 0
    assert rc == 0


def test_hostile_input_under_load_costs_no_worker(ray_local, tmp_path):
    """Issue 28's hostile phase: bad HTTP fields and forged KV handshakes under load. Each HTTP kind
    gets 4xx (never 5xx, never silence), every worker keeps its name and pid, no slot is empty."""
    from bench.chaos_hostile import HTTP_KINDS, KV_KINDS

    out = tmp_path / "hostile.json"
    rc = main(["bench", "chaos", "--faults", "hostile_input", "--requests-per-fault", "8",
               "--concurrency", "4", "--json", str(out)])
    report = json.loads(out.read_text())
    hostile = report["hostile"]
    assert set(hostile["http"]) == set(HTTP_KINDS) and set(hostile["kv"]) == set(KV_KINDS)
    assert all(sum(c.values()) > 0 for c in hostile["http"].values())
    assert report["totals"]["wrong"] == 0 and report["totals"]["leaked_blocks"] == 0, report["totals"]
    assert {k: c for k, c in hostile["http"].items() if c["5xx"] or c["no_response"]} == {}
    assert hostile["workers_restarted"] == [] and hostile["empty_slots"] == 0
    assert hostile["health_after"] == 200 and hostile["failures"] == 0
    assert rc == 0
