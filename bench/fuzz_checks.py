"""Bookkeeping of `pdserve bench fuzz` (a mixin of `bench.fuzz.Fuzzer`): reply codes per case
and mutation family, examples of failures, crashes the child reported, verdicts of pending
(abandoned) cases, false positives among valid transfers, the periodic leak check and the final
report. The methods rely on the `Fuzzer`'s state (`cfg`, `rx`, `counts`, `by`, `pending`, ...)
and on its `_close_lanes` and `_restart`.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter

from bench.fuzz_lanes import Hang, Lane, reply_code
from transfer.wire import TOKEN


class FuzzChecks:
    """Recording, leak checks and the report of a fuzz run."""

    # ---- bookkeeping ------------------------------------------------------------------------
    def _example(self, kind: str, index: int, case, detail: str) -> None:
        if len(self.examples) < self.cfg.max_examples:
            self.examples.append({"kind": kind, "case": index, "family": case.family if case else None,
                                  "op": case.op if case else None, "seed": self.cfg.seed,
                                  "template": case.template.name if case else None, "detail": detail[:4000]})

    def _crashes(self, index: int, case) -> None:
        for _, tb in self.rx.messages("crash"):
            self.counts["crashes"] += 1
            self._example("crash", index, case, tb)


    def _codes(self, replies, lane: Lane, opened, case) -> list[str]:
        codes = []
        for header, body in replies:
            code = reply_code(body)
            if header[:1] == b"h":
                lane.note_hello(body)
            if header[:1] == b"A" and len(header) == TOKEN.size:
                t = TOKEN.unpack(header)[1]
                if t not in opened and (case.wait_token is None or t != case.wait_token):
                    fam = lane.owner.get(t)
                    if fam is None:  # a token no case of this connection opened (a damaged header's)
                        self.counts[f"late_unattributed:{code}"] += 1
                    else:
                        self.by[fam]["refused_by_code"][f"late:{code}"] += 1
                    continue
            codes.append(code)
        return codes

    def _poll_pending(self) -> None:
        """Take the verdicts of pending cases that have arrived (their lateness is judged now)."""
        keep = []
        for entry in self.pending:
            case, lane, t0, index = entry
            if case.wait_token is None or not lane.sock.poll(0):
                keep.append(entry)
                continue
            try:
                want = TOKEN.pack(b"A", case.wait_token)
                replies = lane.recv(lambda h: h == want, time.monotonic())  # noqa: B023
            except Hang:
                keep.append(entry)
                continue
            late = time.monotonic() - t0 > 2 * self.cfg.idle_timeout_s + self.cfg.hang_s
            if late:
                self.counts["hangs"] += 1
                self._example("hang", index, case, "the verdict of an abandoned transfer came late")
            self._record(index, case, self._codes(replies, lane, [case.wait_token], case))
            lane.close()
        self.pending = keep

    def _record(self, index: int, case, codes: list[str]) -> None:
        stats = self.by[case.family]
        for code in sorted(set(codes)) or ["silent"]:
            stats["refused_by_code"][code] += 1
        if case.valid:
            bad = [c for c in codes if c not in ("accepted", "held")]
            if bad or codes.count("accepted") != 1:
                self.counts["false_positives"] += 1
                self._example("false_positive", index, case, f"replies {codes}")
            else:
                self.expected[case.request_id] = (case.template.digest, index, case)

    # ---- leak check ---------------------------------------------------------------------------
    def _collect_pending(self) -> None:
        for case, lane, t0, index in self.pending:
            try:
                if case.wait_token is not None:
                    want = TOKEN.pack(b"A", case.wait_token)
                    deadline = t0 + 2 * self.cfg.idle_timeout_s + self.cfg.hang_s
                    replies = lane.recv(lambda h: h == want, deadline)  # noqa: B023
                    self._record(index, case, self._codes(replies, lane, [case.wait_token], case))
                else:
                    self._record(index, case, ["unobserved"])
            except Hang as e:
                self.counts["hangs"] += 1
                self._example("hang", index, case, f"no verdict for an abandoned transfer: {e}")
            finally:
                lane.close()
        self.pending = []

    def leak_check(self, index: int) -> None:
        self._collect_pending()
        self._close_lanes()
        got = None
        with contextlib.suppress(OSError):
            self.rx.conn.send("check")
            got = self.rx.wait("check", 4 * self.cfg.idle_timeout_s + 30)
        self._crashes(index, None)
        if got is None:
            self._restart(index, None, "no answer to a leak check")
            return
        report = got[1]
        self.counts["leak_checks"] += 1
        if report["leaks"]:
            self.counts["leaks"] += 1
            self._example("leak", index, None, "; ".join(report["leaks"]))
        self.rx_errors = Counter(report["metrics"]["errors"])
        self.rx_counters = report["metrics"]["counters"]
        digests = report["digests"]
        for rid, (digest, i, case) in self.expected.items():
            if digests.get(rid) != digest:
                self.counts["false_positives"] += 1
                self._example("false_positive", i, case,
                              f"landed digest {digests.get(rid)} != source {digest}")
        self.expected = {}

    def report(self, seconds: float) -> dict:
        return {
            "cases": self.counts["cases"], "crashes": self.counts["crashes"], "hangs": self.counts["hangs"],
            "leaks": self.counts["leaks"], "false_positives": self.counts["false_positives"],
            "leak_checks": self.counts["leak_checks"], "generator_errors": self.counts["generator_errors"],
            "seed": self.cfg.seed, "seconds": round(seconds, 1),
            "by_mutation": {k: {"cases": v["cases"],
                                "refused_by_code": dict(sorted(v["refused_by_code"].items())),
                                "ops": dict(sorted(v["ops"].items()))} for k, v in sorted(self.by.items())},
            "late_unattributed": {k.split(":", 1)[1]: v for k, v in sorted(self.counts.items())
                                  if k.startswith("late_unattributed:")},
            "receiver_errors": dict(sorted(self.rx_errors.items())),
            "receiver_counters": dict(sorted(getattr(self, "rx_counters", {}).items())),
            "templates": [t.name for t in self.templates],
            "examples": self.examples,
        }
