"""Each worker owns one core (bench serve's fair comparison): ClusterConfig.pin_cpus gives the
workers their CPUs in spawn order (coordinator.workers.worker_cpu), and runtime.priority.pin_to_cpu
moves every thread of the process onto it (checked in a child process, so the test runner keeps
its own affinity); the startup profile a worker measures after its warm-up (engine.warmup)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from coordinator.config import ClusterConfig
from coordinator.workers import worker_cpu


def test_workers_take_the_listed_cpus_in_spawn_order():
    c = ClusterConfig(prefill=1, decode=1, pin_cpus=(0, 1))
    assert [worker_cpu(c, s) for s in ("prefill-0", "decode-0")] == [0, 1]
    two_to_one = ClusterConfig(prefill=2, decode=1, pin_cpus=(0, 1))  # 3 workers, 2 CPUs: reused in turn
    assert [worker_cpu(two_to_one, s) for s in ("prefill-0", "prefill-1", "decode-0")] == [0, 1, 0]
    colocated = ClusterConfig(colocated=2, pin_cpus=(3, 5))
    assert [worker_cpu(colocated, s) for s in ("colocated-0", "colocated-1")] == [3, 5]
    assert worker_cpu(ClusterConfig(), "decode-0") is None  # unpinned by default


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="the OS cannot pin threads")
def test_pin_to_cpu_moves_every_thread_of_the_process():
    cpu = min(os.sched_getaffinity(0))
    code = f"""
import os, threading
ev = threading.Event()
t = threading.Thread(target=ev.wait, daemon=True); t.start()     # a thread started before pinning
from runtime.priority import pin_to_cpu
assert pin_to_cpu({cpu}) == [{cpu}]
after = threading.Thread(target=ev.wait, daemon=True); after.start()  # and one after
cpus = {{tid: os.sched_getaffinity(int(tid)) for tid in os.listdir('/proc/self/task')}}
ev.set()
assert len(cpus) >= 3 and all(c == {{{cpu}}} for c in cpus.values()), cpus
assert pin_to_cpu(None) == [{cpu}]
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_pin_to_a_cpu_the_process_may_not_use_leaves_it_unpinned(caplog):
    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("the OS cannot pin threads")
    from runtime.priority import pin_to_cpu

    allowed = sorted(os.sched_getaffinity(0))
    assert pin_to_cpu(10_000) == allowed  # no such CPU: a warning, nothing moved
    assert "not among the CPUs" in caplog.text


@pytest.mark.parametrize("role", ["colocated", "prefill", "decode"])
def test_startup_profile_times_the_warm_up_prompts_on_a_warm_engine(role):
    from engine.engine import EngineConfig, LLMEngine
    from engine.warmup import startup_profile, warm_up, warmup_prompts

    e = LLMEngine(EngineConfig(model="tiny", block_size=16, num_blocks=256, role=role))
    free = e.kv.usage()["free_blocks"]
    warm_up(e)
    prof = startup_profile(e)
    assert prof["prefill_tokens"] == sum(len(p) for p in warmup_prompts(e))
    assert prof["prefill_ms_per_token"] > 0 and prof["seconds"] > 0
    # a prefill worker stops at the first token: no decode step to time
    assert (prof["decode_step_ms"] is None) == (role == "prefill")
    assert e.steps == 0 and not e.requests and not e.has_work()  # left as it started
    assert e.kv.usage()["free_blocks"] == free
