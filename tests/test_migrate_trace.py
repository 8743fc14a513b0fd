"""The migration timeline's Chrome trace (`bench.migrate_trace`): valid Trace Event Format JSON,
every event complete, each migration's spans nested and in order, the receiver's inside the
sender's wire span and ending at the ack, whatever subset of timings the receiver reported."""

import json

import pytest

from bench.migrate_trace import RECEIVER_PID, SENDER_PID, build_trace, write_trace

EPS = 0.01  # µs: ts and dur are rounded to nanoseconds independently


def record(transport, start_ms, export_ms, wire_ms, timings, i=0):
    return {"transport": transport, "request_id": f"{transport}-{i}", "repeat": i, "bytes": 1 << 20,
            "kv_shape": "tiny", "tokens": 256, "block_size": 16, "start_ms": start_ms,
            "export_ms": export_ms, "wire_ms": wire_ms, "verified": True, "receiver_ms": timings}


TIMELINE = [
    record("zmq-tcp", 100.0, 0.2, 3.0, {"prepare_ms": 0.1, "recv_ms": 2.0, "commit_ms": 0.3}),
    record("zmq-tcp", 110.0, 0.2, 3.0, {"prepare_ms": 0.1, "recv_ms": 2.1, "land_ms": 1.2, "verify_ms": 0.6,
                                        "commit_ms": 0.3}, 1),
    record("zmq-ipc", 120.0, 0.1, 2.0, {"prepare_ms": 0.1, "commit_ms": 0.2}),  # no recv: left out
    record("ray", 130.0, 0.3, 5.0, {"prepare_ms": 0.2, "commit_ms": 0.3, "receive_ms": 4.0}),
    record("ray", 140.0, 0.3, 1.0, {"prepare_ms": 0.5, "land_ms": 2.0, "commit_ms": 0.5}, 1),  # > wire
    record("zmq-tcp", 150.0, 0.2, 3.0, {}, 2),  # nothing from the receiver
]


def by_migration(events):
    out = {}
    for e in events:
        if e["ph"] == "X":
            out.setdefault(e["args"]["migration"], []).append(e)
    return out


def test_trace_is_valid_trace_event_json(tmp_path):
    path = tmp_path / "t.json"
    n = write_trace(TIMELINE, str(path))
    trace = json.loads(path.read_text())
    assert trace["displayTimeUnit"] == "ms" and len(trace["traceEvents"]) == n
    for e in trace["traceEvents"]:
        assert {"name", "ph", "ts", "dur", "pid", "tid"} <= set(e), e
        assert e["ph"] in ("X", "M") and e["dur"] >= 0 and e["ts"] >= 0
        assert isinstance(e["name"], str) and isinstance(e["pid"], int) and isinstance(e["tid"], int)
    names = {(e["pid"], e["tid"]): e["args"]["name"]
             for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert sorted(set(names.values())) == ["ray", "zmq-ipc", "zmq-tcp"]
    assert {pid for pid, _ in names} == {SENDER_PID, RECEIVER_PID}
    # one tid per transport, the same on both sides
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            assert names[(e["pid"], e["tid"])] == TIMELINE[e["args"]["migration"]]["transport"]


def test_spans_of_a_migration_nest_in_order():
    spans = by_migration(build_trace(TIMELINE)["traceEvents"])
    assert len(spans) == len(TIMELINE)
    starts = []
    for i, evs in spans.items():
        snd = {e["name"]: e for e in evs if e["pid"] == SENDER_PID}
        rcv = [e for e in evs if e["pid"] == RECEIVER_PID]
        mig, exp, wire = snd["migrate"], snd["export"], snd["wire"]
        starts.append(mig["ts"])
        assert exp["ts"] == pytest.approx(mig["ts"], abs=EPS)
        assert wire["ts"] == pytest.approx(exp["ts"] + exp["dur"], abs=EPS)
        assert wire["ts"] + wire["dur"] == pytest.approx(mig["ts"] + mig["dur"], abs=EPS)
        assert mig["dur"] == pytest.approx((TIMELINE[i]["export_ms"] + TIMELINE[i]["wire_ms"]) * 1e3, abs=EPS)
        timings = TIMELINE[i]["receiver_ms"]
        if not timings:
            assert rcv == []
            continue
        outer, phases = rcv[0], rcv[1:]
        assert outer["name"] == "import"
        ack = wire["ts"] + wire["dur"]
        assert outer["ts"] >= wire["ts"] - EPS and outer["ts"] + outer["dur"] == pytest.approx(ack, abs=EPS)
        order = [p["name"] for p in phases]
        assert order == [k for k in ("prepare", "recv", "land", "verify", "commit")
                         if f"{k}_ms" in timings and not (k == "recv" and "land_ms" in timings)]
        assert phases[0]["ts"] == pytest.approx(outer["ts"], abs=EPS)
        assert phases[-1]["ts"] + phases[-1]["dur"] == pytest.approx(ack, abs=EPS)
        for a, b in zip(phases, phases[1:]):
            assert a["ts"] + a["dur"] <= b["ts"] + EPS  # in order, not overlapping
        for p in phases:
            assert outer["ts"] - EPS <= p["ts"] and p["ts"] + p["dur"] <= outer["ts"] + outer["dur"] + EPS
        if "scaled" not in outer["args"]:
            for p in phases:
                assert p["dur"] == pytest.approx(timings[f"{p['name']}_ms"] * 1e3, abs=EPS)
    assert starts == sorted(starts) and starts[0] == 0
    assert "scaled" in spans[4][3]["args"]  # the ray record whose receiver phases exceed its wire span
