"""`pdserve up` without --address starts its own Ray, whatever else runs on the machine: another
live local Ray instance (here a separate process) is never joined (issue 13's stale-session
failure began exactly so: `ray.init()` found another session and joined it)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.own_ray  # starts or joins Ray in this process (conftest)

ray = pytest.importorskip("ray")

OTHER = ("import ray, sys, time; ray.init(address='local', num_cpus=1, include_dashboard=False, "
         "log_to_driver=False); print(ray.get_runtime_context().gcs_address, flush=True); "
         "sys.stdin.read(); ray.shutdown()")


def test_local_start_never_joins_another_ray_on_the_machine():
    from deploy.launch import RayConfig, start_ray, stop_ray

    if ray.is_initialized():
        pytest.skip("a Ray instance is already initialised in this process")
    other = subprocess.Popen([sys.executable, "-c", OTHER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    started = False
    try:
        other_address = other.stdout.readline().strip()
        assert other_address, "the other Ray instance did not start"
        started = start_ray(RayConfig(num_cpus=1))
        assert started and ray.get_runtime_context().gcs_address != other_address
    finally:
        stop_ray(started)
        other.communicate("", timeout=60)
