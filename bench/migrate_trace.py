"""The migration timeline of `pdserve bench migrate` as a Chrome trace (`--trace F.json`), which
opens in Perfetto (ui.perfetto.dev) or chrome://tracing.

Input: the report's `timeline`, one record per timed migration (`measure.migrate._measure`):
transport, request_id, bytes, start_ms (sender clock, from the benchmark's start), export_ms and
wire_ms (sender), receiver_ms (the Ack's `timings`: prepare_ms, recv_ms, land_ms, verify_ms,
commit_ms, receive_ms, whichever the receiver reported; a missing key is a missing span).

Output (the Trace Event Format): {"traceEvents": [...], "displayTimeUnit": "ms"}, complete
events ("ph": "X", ts and dur in microseconds) plus process/thread name metadata ("ph": "M").
pid 1 is the sender side (the benchmark process), pid 2 the receiver side (the peer process or
the Ray actor); one tid per transport, so each transport is one row on each side, its migrations
laid out in time order at the times they ran. Per migration:

  sender:   migrate [export][wire.......................]
  receiver:                 import [prepare][land][verify][commit]   (ends at the ack time)

The receiver's clock is another process's: only its durations are used. Its spans sit inside the
sender's wire span, ending when the sender got the ack (the ack's return trip is ignored);
`prepare` starts the import, `commit` ends it, and the phases between follow `prepare` in order
(land, verify; or recv, today's name for both together). The outer `import` span is the Ray
actor's whole call (receive_ms) when reported, else the sum of the phases. Were the receiver's
phases to add up to more than the wire span, they are scaled down to fit and marked `scaled`.
"""

from __future__ import annotations

import json

SENDER_PID, RECEIVER_PID = 1, 2
MIDDLE = ("recv", "land", "verify")  # between prepare and commit, in this order


def _receiver_phases(timings: dict) -> tuple[list[tuple[str, float]], float]:
    """([(name, ms)] in order, outer ms) from an Ack's timings; missing keys are left out."""
    def ms(key: str) -> float | None:
        v = timings.get(f"{key}_ms")
        return None if v is None else max(0.0, float(v))

    middle = [k for k in MIDDLE if ms(k) is not None]
    if "land" in middle or "verify" in middle:
        middle = [k for k in middle if k != "recv"]  # recv_ms covers land + verify: do not draw it twice
    phases = [(k, ms(k)) for k in ("prepare", *middle, "commit") if ms(k) is not None]
    total = sum(d for _, d in phases)
    outer = ms("receive")
    return phases, max(total, outer) if outer is not None else total  # type: ignore[return-value]


def _x(name: str, ts: float, dur: float, pid: int, tid: int, args: dict | None = None) -> dict:
    return {"name": name, "ph": "X", "ts": round(ts, 3), "dur": round(max(0.0, dur), 3), "pid": pid,
            "tid": tid, "args": args or {}}


def _meta(name: str, pid: int, tid: int, value) -> dict:
    key = "sort_index" if name.endswith("sort_index") else "name"
    return {"name": name, "ph": "M", "ts": 0, "dur": 0, "pid": pid, "tid": tid, "args": {key: value}}


def build_trace(timeline: list[dict]) -> dict:
    """The Chrome trace of a benchmark's timeline records (see the module docstring)."""
    transports = list(dict.fromkeys(m["transport"] for m in timeline))
    tids = {t: i + 1 for i, t in enumerate(transports)}
    events = [_meta("process_name", SENDER_PID, 0, "sender (benchmark process)"),
              _meta("process_name", RECEIVER_PID, 0, "receiver (peer process / Ray actor)"),
              _meta("process_sort_index", SENDER_PID, 0, 0),
              _meta("process_sort_index", RECEIVER_PID, 0, 1)]
    for t, tid in tids.items():
        for pid in (SENDER_PID, RECEIVER_PID):
            events.append(_meta("thread_name", pid, tid, t))
            events.append(_meta("thread_sort_index", pid, tid, tid))
    origin = min((m["start_ms"] for m in timeline), default=0.0)
    for i, m in enumerate(sorted(timeline, key=lambda m: m["start_ms"])):
        tid = tids[m["transport"]]
        start = (m["start_ms"] - origin) * 1e3
        export, wire = max(0.0, m["export_ms"]) * 1e3, max(0.0, m["wire_ms"]) * 1e3
        total_ms = m["export_ms"] + m["wire_ms"]
        args = {"migration": i, "request_id": m.get("request_id"), "bytes": m.get("bytes"),
                "kv_shape": m.get("kv_shape"), "tokens": m.get("tokens"), "block_size": m.get("block_size"),
                "repeat": m.get("repeat"), "verified": m.get("verified"),
                "gb_per_s": m["bytes"] / (total_ms * 1e6) if m.get("bytes") and total_ms > 0 else None}
        events.append(_x("migrate", start, export + wire, SENDER_PID, tid, args))
        events.append(_x("export", start, export, SENDER_PID, tid, {"migration": i}))
        events.append(_x("wire", start + export, wire, SENDER_PID, tid, {"migration": i}))
        phases, outer_ms = _receiver_phases(m.get("receiver_ms") or {})
        if not phases and outer_ms <= 0:
            continue
        end, outer = start + export + wire, outer_ms * 1e3
        scale = min(1.0, wire / outer) if outer > 0 else 1.0
        rargs = {"migration": i, "receiver_ms": dict(m.get("receiver_ms") or {})}
        if scale < 1.0:
            rargs["scaled"] = scale
        begin = end - outer * scale
        events.append(_x("import", begin, outer * scale, RECEIVER_PID, tid, rargs))
        cursor = begin
        for name, d in phases:
            dur = d * 1e3 * scale
            ts = end - dur if name == "commit" else cursor  # commit ends at the ack
            events.append(_x(name, ts, dur, RECEIVER_PID, tid, {"migration": i, "ms": d}))
            cursor = ts + dur
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"source": "pdserve bench migrate", "migrations": len(timeline)}}


def write_trace(timeline: list[dict], path: str) -> int:
    """Write the trace JSON to `path`; returns the number of events."""
    trace = build_trace(timeline)
    with open(path, "w") as f:
        json.dump(trace, f)
    return len(trace["traceEvents"])
