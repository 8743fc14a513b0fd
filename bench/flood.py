"""The flood check: a burst of simultaneous completion requests against a coordinator guarded by an
API key, as a new user would try it against `pdserve up --api-key K`.

What it checks (each a correctness property of bounded admission, not a speed target):
  - a completion without the key, or with a wrong one, gets 401; `/health` needs no key;
  - N requests released together from a barrier each end with 200 (a complete, well-formed
    completion) or 429 (with a Retry-After header), never another status or a connection error,
    and all of them within a bound;
  - `/health`, probed every ~100 ms while the burst runs, answers 200 each time within a bound;
  - afterwards the cluster is at rest (no request in the ledger, no owned, used or reserved block
    beyond the prefix cache) and a fresh request still succeeds.

`Up` (bench.flood_server) starts `pdserve up` as a subprocess (the console script beside this
interpreter); `run_flood` drives one burst against a URL; `summarize` / `format_table`
(bench.flood_report) report it. All are importable from here: the command (`pdserve bench flood`)
and tests/test_http_flood.py share these.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.parse
from dataclasses import asdict, dataclass, field

from bench.flood_report import _pct as _pct
from bench.flood_report import format_table, summarize
from bench.flood_server import Up as Up

# ----------------------------------------------------------------------------------------------
# HTTP


@dataclass
class Reply:
    status: int | None            # None: no HTTP answer (connection refused/reset, timeout)
    seconds: float                # from sending to the end of the body (or the failure)
    headers: dict = field(default_factory=dict)
    body: bytes = b""
    error: str = ""               # the exception, when there was no answer


def call(url: str, method: str = "GET", path: str = "/", body: dict | None = None, key: str | None = None,
         timeout: float = 60.0) -> Reply:
    """One request on its own connection; never raises."""
    u = urllib.parse.urlsplit(url)
    headers = {"Content-Type": "application/json", "Connection": "close"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = json.dumps(body).encode() if body is not None else None
    t0 = time.monotonic()
    conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=timeout)
    try:
        conn.request(method, path, data, headers)
        resp = conn.getresponse()
        raw = resp.read()
        return Reply(resp.status, time.monotonic() - t0, {k.lower(): v for k, v in resp.getheaders()}, raw)
    except Exception as e:  # connection refused / reset, socket timeout, a malformed answer
        return Reply(None, time.monotonic() - t0, error=f"{type(e).__name__}: {e}")
    finally:
        conn.close()


def completion_problem(reply: Reply, max_tokens: int) -> str:
    """'' when a 200 carries a complete, well-formed text completion of max_tokens tokens (the
    flood sends ignore_eos), else what is wrong with it."""
    try:
        out = json.loads(reply.body)
    except ValueError:
        return "body is not JSON"
    choices = out.get("choices")
    if out.get("object") != "text_completion" or not isinstance(choices, list) or len(choices) != 1:
        return f"not one text_completion choice: {str(out)[:200]}"
    c = choices[0]
    if not isinstance(c.get("text"), str) or c.get("finish_reason") != "length":
        return f"choice without text or finish_reason 'length': {str(c)[:200]}"
    used = out.get("usage", {}).get("completion_tokens")
    if len(c.get("token_ids") or []) != max_tokens or used != max_tokens:
        return f"expected {max_tokens} tokens: {str(c)[:200]}"
    return ""


# ----------------------------------------------------------------------------------------------
# the checks


@dataclass(frozen=True)
class FloodConfig:
    requests: int = 200             # simultaneous completion requests
    max_tokens: int = 8
    bound_s: float = 120.0          # every request must have ended this long after the release
    health_interval_s: float = 0.1  # /health probe period during the burst
    health_bound_s: float = 5.0     # each probe must answer 200 within this
    rest_deadline_s: float = 30.0   # how long to wait for the cluster to come to rest afterwards

    def body(self, i: int) -> dict:
        return {"prompt": f"flood request {i}: tell me about block {i % 17}", "max_tokens": self.max_tokens,
                "temperature": 0, "ignore_eos": True}


def check_auth(url: str, key: str, cfg: FloodConfig = FloodConfig()) -> dict:
    """Status codes of a completion without the key, with a wrong key, and /health without a key."""
    body = cfg.body(0)
    return {"no_key": call(url, "POST", "/v1/completions", body, None, 30).status,
            "wrong_key": call(url, "POST", "/v1/completions", body, key + "-wrong", 30).status,
            "health_no_key": call(url, "GET", "/health", timeout=30).status}


def run_flood(url: str, key: str | None, cfg: FloodConfig = FloodConfig()) -> dict:
    """Release cfg.requests completions together while /health is probed; every record."""
    n = cfg.requests
    replies: list[Reply | None] = [None] * n
    ends: list[float] = [0.0] * n
    barrier = threading.Barrier(n + 1)
    stop = threading.Event()
    probes: list[tuple[float, int | None, float]] = []  # (offset from release, status, seconds)
    start = [0.0]

    def one(i: int) -> None:
        barrier.wait()
        replies[i] = call(url, "POST", "/v1/completions", cfg.body(i), key, timeout=cfg.bound_s)
        ends[i] = time.monotonic()

    def probe() -> None:
        while not stop.is_set():
            t = time.monotonic()
            r = call(url, "GET", "/health", timeout=cfg.health_bound_s)
            probes.append((t - start[0], r.status, r.seconds))
            stop.wait(max(0.0, cfg.health_interval_s - (time.monotonic() - t)))

    threads = [threading.Thread(target=one, args=(i,), name=f"flood-{i}", daemon=True) for i in range(n)]
    old = threading.stack_size(256 * 1024)
    try:
        for t in threads:
            t.start()
    finally:
        threading.stack_size(old)
    start[0] = time.monotonic()
    prober = threading.Thread(target=probe, name="flood-health", daemon=True)
    prober.start()
    barrier.wait()
    start[0] = time.monotonic()
    for t in threads:  # bounded: each call has its own timeout
        t.join(cfg.bound_s + 30)
    wall = time.monotonic() - start[0]
    stop.set()
    prober.join(cfg.health_bound_s + 5)

    records = []
    for i, r in enumerate(replies):
        if r is None:  # the thread never returned
            records.append({"index": i, "status": None, "seconds": None, "ended_s": None, "error": "hung"})
            continue
        rec = {"index": i, "status": r.status, "seconds": round(r.seconds, 4),
               "ended_s": round(ends[i] - start[0], 4), "error": r.error}
        if r.status == 200:
            rec["problem"] = completion_problem(r, cfg.max_tokens)
        elif r.status == 429:
            rec["retry_after"] = r.headers.get("retry-after")
        elif r.status is not None:
            rec["body"] = r.body[:300].decode(errors="replace")
        records.append(rec)
    return {"url": url, "config": asdict(cfg), "wall_s": round(wall, 3), "records": records,
            "health": [{"at_s": round(a, 3), "status": s, "seconds": round(d, 4)} for a, s, d in probes]}


def cluster_at_rest(url: str, key: str | None, deadline_s: float = 30.0) -> tuple[bool, dict]:
    """Poll /v1/cluster until no request is active, nothing is owned in the ledger and no live
    worker holds a used or reserved block (cached prefix blocks are fine); (at rest, last info)."""
    end = time.monotonic() + deadline_s
    info: dict = {}
    while True:
        r = call(url, "GET", "/v1/cluster", key=key, timeout=10)
        if r.status == 200:
            info = json.loads(r.body)
            live = [w for w in info["workers"] if w["alive"]]
            ledger = info["ledger"]
            if (ledger["active_requests"] == 0 and ledger["owned_blocks"] == 0 and live
                    and all(w["used_blocks"] == 0 and w.get("reserved_blocks", 0) == 0 for w in live)):
                return True, info
        if time.monotonic() > end:
            return False, info
        time.sleep(0.2)


def rest_summary(info: dict) -> dict:
    ledger = info.get("ledger", {})
    return {"active_requests": ledger.get("active_requests"), "owned_blocks": ledger.get("owned_blocks"),
            "workers": {w["name"]: {k: w.get(k) for k in ("alive", "used_blocks", "reserved_blocks",
                                                         "cached_blocks")}
                        for w in info.get("workers", [])}}


def wait_healthy(url: str, timeout_s: float = 60.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if call(url, "GET", "/health", timeout=5).status == 200:
            return True
        time.sleep(0.2)
    return False


def full_check(url: str, key: str, cfg: FloodConfig = FloodConfig(), log=print) -> dict:
    """Everything in the module doc against a running coordinator; the JSON report."""
    t0 = time.monotonic()
    if not wait_healthy(url):
        raise RuntimeError(f"{url}/health did not answer 200")
    auth = check_auth(url, key, cfg)
    log(f"auth: completion without key -> {auth['no_key']}, wrong key -> {auth['wrong_key']}, "
        f"/health without key -> {auth['health_no_key']}")
    report = run_flood(url, key, cfg)
    summary = summarize(report)
    log(format_table(summary))
    rest, info = cluster_at_rest(url, key, cfg.rest_deadline_s)
    after = call(url, "POST", "/v1/completions", cfg.body(cfg.requests), key, timeout=60)
    after_problem = (completion_problem(after, cfg.max_tokens) if after.status == 200
                     else f"status {after.status} {after.error}")
    log(f"after the flood: at rest {rest}; a fresh request -> {after.status}"
        f"{' (' + after_problem + ')' if after_problem else ''}")
    violations = list(summary["violations"])
    if auth != {"no_key": 401, "wrong_key": 401, "health_no_key": 200}:
        violations.append(f"auth statuses {auth}")
    if not rest:
        violations.append(f"not at rest after the flood: {rest_summary(info)}")
    if after_problem:
        violations.append(f"fresh request after the flood: {after_problem}")
    return {**report, "auth": auth, "summary": {**summary, "violations": violations},
            "at_rest": rest, "rest": rest_summary(info), "after_status": after.status,
            "total_s": round(time.monotonic() - t0, 2)}
