"""coordinator.decide as a pure function: hand-checkable cases of where a prompt is prefilled (on
the decode worker itself, or on a prefill worker with a migration) and the reason it gives."""

from __future__ import annotations

import pytest

from coordinator.decide import DecideConfig, DecideInputs, decide, limit_tokens

AUTO = DecideConfig(mode="auto", local_prefill_max_tokens=256)


def test_short_uncached_prompt_is_prefilled_on_the_decode_worker():
    d = decide(DecideInputs(prompt_tokens=40), AUTO)
    assert (d.path, d.reason_kind) == ("local_prefill", "short_uncached")
    assert d.to_dict() == {"path": "local_prefill", "reason": "uncached 40 tokens <= 256"}


def test_long_uncached_prompt_is_disaggregated():
    d = decide(DecideInputs(prompt_tokens=1000), AUTO)
    assert (d.path, d.reason_kind, d.reason) == ("disaggregate", "long_uncached",
                                                 "uncached 1000 tokens > 256")


def test_long_prompt_whose_prefix_the_decode_worker_caches_is_local():
    d = decide(DecideInputs(prompt_tokens=1000, decode_cached_tokens=960), AUTO)
    assert d.path == "local_prefill"
    assert d.reason == "uncached 40 tokens <= 256, 960 cached on decode"


def test_a_prefill_queue_raises_the_limit_at_most_four_times():
    x = DecideInputs(prompt_tokens=600, prefill_queue_depth=2)  # 256 * 3 = 768 >= 600
    assert decide(x, AUTO).reason == "uncached 600 tokens <= 768 (2 queued at prefill)"
    assert limit_tokens(DecideInputs(prompt_tokens=1, prefill_queue_depth=50), AUTO) == 4 * 256


def test_a_busy_decode_worker_is_left_alone():
    d = decide(DecideInputs(prompt_tokens=10, decode_queue_depth=4), AUTO)
    assert (d.path, d.reason_kind) == ("disaggregate", "decode_busy")


def test_measured_migrations_raise_the_limit_to_what_prefills_in_one():
    c = DecideConfig(mode="auto", local_prefill_max_tokens=100, prefill_ms_per_token=0.05)
    assert limit_tokens(DecideInputs(prompt_tokens=1), c) == 100          # nothing measured yet
    assert limit_tokens(DecideInputs(prompt_tokens=1, migration_ms=20.0), c) == 400  # 20 / 0.05
    assert limit_tokens(DecideInputs(prompt_tokens=1, migration_ms=2.0), c) == 100   # never below the base


def test_always_and_never_ignore_the_numbers():
    x = DecideInputs(prompt_tokens=5, decode_cached_tokens=5)
    assert decide(x, DecideConfig(mode="always")).path == "disaggregate"
    assert decide(DecideInputs(prompt_tokens=10**6), DecideConfig(mode="never")).path == "local_prefill"


def test_bad_config_is_refused():
    with pytest.raises(ValueError, match="disaggregate must be one of"):
        DecideConfig(mode="sometimes")
    with pytest.raises(ValueError):
        DecideConfig(local_prefill_max_waiting=0)


def test_profile_crossover_is_where_local_prefill_costs_what_a_migration_does():
    from planner.profile import crossover

    assert crossover(0.02, 1.0, 0.0) == 50         # 50 tokens x 0.02 ms = the migration's fixed 1 ms
    assert crossover(0.02, 1.0, 0.01) == 100       # 100 x 0.02 = 1 + 100 x 0.01
    assert crossover(0.01, 1.0, 0.02) is None      # receiving costs more per token than prefilling


def test_the_decode_workers_batch_divides_the_limit():
    # a local prefill stalls every running sequence: with B >= 2 running the limit is base / B
    assert limit_tokens(DecideInputs(prompt_tokens=1, decode_running=1), AUTO) == 256
    assert limit_tokens(DecideInputs(prompt_tokens=1, decode_running=4), AUTO) == 64
    d = decide(DecideInputs(prompt_tokens=100, decode_running=4), AUTO)
    assert (d.path, d.reason) == ("disaggregate", "uncached 100 tokens > 64, 4 running on decode")
    assert decide(DecideInputs(prompt_tokens=100, decode_running=1), AUTO).path == "local_prefill"


def test_the_decode_workers_startup_measurement_stands_in_for_a_configured_rate():
    c = DecideConfig(mode="auto", local_prefill_max_tokens=80)
    measured = DecideInputs(prompt_tokens=1, migration_ms=30.0, decode_prefill_ms_per_token=0.1)
    assert limit_tokens(measured, c) == 300                       # 30 ms / 0.1 ms per token
    assert limit_tokens(DecideInputs(prompt_tokens=1, migration_ms=30.0), c) == 80  # nothing measured
    configured = DecideConfig(mode="auto", local_prefill_max_tokens=80, prefill_ms_per_token=0.2)
    assert limit_tokens(measured, configured) == 150              # a configured rate wins: 30 / 0.2


def test_decide_fields_from_a_profile_file():
    from coordinator.decide import from_profile

    fits = {"fits": {"local_prefill_max_tokens": 120, "prefill_ms_per_token": 0.35}}
    assert from_profile(fits) == {"local_prefill_max_tokens": 120, "prefill_ms_per_token": 0.35}
    assert from_profile({"fits": {"local_prefill_max_tokens": None, "prefill_ms_per_token": 0.0}}) == {}
    c = DecideConfig(mode="auto", **from_profile(fits))
    assert limit_tokens(DecideInputs(prompt_tokens=1, migration_ms=70.0), c) == 200  # 70 / 0.35
    with pytest.raises(ValueError, match="no 'fits'"):
        from_profile({"prefill": []})
