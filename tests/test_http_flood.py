"""Issue 14's "done when", tried as a new user would: `pdserve up --api-key K` as a subprocess
(tiny model, 1 prefill + 1 decode, its own local Ray). A completion without the key (or with a
wrong one) gets 401 while /health needs none; 200 requests released together from a barrier each
end with a complete completion (200) or a 429 with Retry-After, none later than a bound, while
/health, probed every 100 ms, answers 200 within 5 s every time; the cluster is at rest afterwards
and a fresh request succeeds. The server runs with `--max-active 64`, so a second burst of 200
goes beyond it and must turn the excess away with 429 + Retry-After at once.

The bounds are correctness properties of bounded admission (nothing waits without limit), not
speed targets: a run here takes a few seconds per burst. The flood code is bench.flood's, the
same `pdserve bench flood` runs."""

from __future__ import annotations

import pytest

from bench.flood import (
    FloodConfig,
    Up,
    call,
    check_auth,
    cluster_at_rest,
    completion_problem,
    rest_summary,
    run_flood,
    summarize,
    wait_healthy,
)

pytest.importorskip("ray")

KEY = "K"


@pytest.fixture(scope="module")
def up():
    server = Up(["--model", "tiny", "--prefill", "1", "--decode", "1", "--api-key", KEY, "--port", "0",
                 "--max-active", "64"])
    try:
        assert wait_healthy(server.url), server.output
        yield server
    finally:
        rc = server.stop()
        assert rc == 0, server.output
        assert "pdserve up: stopped" in server.output


def _at_rest_and_serving(url: str, cfg: FloodConfig) -> None:
    rest, info = cluster_at_rest(url, KEY, cfg.rest_deadline_s)
    assert rest, f"not at rest after the flood: {rest_summary(info)}"
    assert all(w["alive"] for w in info["workers"])
    fresh = call(url, "POST", "/v1/completions", cfg.body(10_000), KEY, timeout=60)
    assert fresh.status == 200 and completion_problem(fresh, cfg.max_tokens) == "", fresh


def test_requests_without_the_key_get_401_and_health_needs_none(up):
    assert check_auth(up.url, KEY) == {"no_key": 401, "wrong_key": 401, "health_no_key": 200}
    assert call(up.url, "GET", "/v1/cluster").status == 401
    assert call(up.url, "GET", "/v1/cluster", key=KEY).status == 200


def test_200_simultaneous_requests_end_200_or_429_within_bounds_and_health_stays_responsive(up):
    cfg = FloodConfig(requests=200, max_tokens=8, bound_s=120.0, health_bound_s=5.0)
    report = run_flood(up.url, KEY, cfg)
    s = summarize(report)
    # every request: 200 with a complete completion, or 429 with Retry-After; no other status, no
    # connection error, none after the bound; every /health probe 200 within its bound
    assert s["violations"] == [], "\n".join(s["violations"][:20])
    assert sum(s["counts"].values()) == 200 and set(s["counts"]) <= {"200", "429"}
    assert s["counts"].get("200", 0) >= 1
    assert s["last_end_s"] <= cfg.bound_s
    assert s["health"]["probes"] >= 1 and s["health"]["ok"] == s["health"]["probes"]
    assert s["health"]["max_ms"] <= 1000 * cfg.health_bound_s
    _at_rest_and_serving(up.url, cfg)


def test_beyond_max_active_the_excess_gets_429_with_retry_after_at_once(up):
    """200 > max_active (64, set with `pdserve up --max-active`): the excess is refused, not queued."""
    cfg = FloodConfig(requests=200, max_tokens=64, bound_s=120.0, health_bound_s=5.0)
    s = summarize(run_flood(up.url, KEY, cfg))
    assert s["violations"] == [], "\n".join(s["violations"][:20])
    assert s["counts"].get("200", 0) >= 1 and s["counts"].get("429", 0) >= 1, s["counts"]
    assert set(s["retry_after"]) == {"1"}, s["retry_after"]
    # refused at once: a 429 comes back before any admitted request could have finished
    assert s["latency_ms"]["429"]["max"] < s["latency_ms"]["200"]["max"], s["latency_ms"]
    _at_rest_and_serving(up.url, cfg)


def test_a_small_decode_pool_answers_200_or_429_not_503():
    """60 requests of 64 tokens into a 16-block pool per worker: each should wait for room (or get
    429), never fail with 503 because the room its credit promised was gone when its KV arrived."""
    server = Up(["--model", "tiny", "--api-key", KEY, "--port", "0", "--num-blocks", "16"])
    try:
        assert wait_healthy(server.url), server.output
        cfg = FloodConfig(requests=60, max_tokens=64)
        s = summarize(run_flood(server.url, KEY, cfg))
        rest, info = cluster_at_rest(server.url, KEY, cfg.rest_deadline_s)
        assert rest, f"not at rest after the flood: {rest_summary(info)}"  # no leak either way
        assert s["violations"] == [], f"{s['counts']}: " + "\n".join(s["violations"][:3])
    finally:
        assert server.stop() == 0, server.output
