"""Shared test setup: hypothesis profiles (select with HYPOTHESIS_PROFILE), one torch thread,
the `gpu` marker's skip when CUDA is absent, the cluster tests' module-scoped fixtures
(a local Ray, the in-process reference engine) and the HTTP API tests' ones (an event loop on a
thread, the coordinator's app over a tiny-model backend; see http_harness.py)."""

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile("default", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", deadline=None, suppress_health_check=[HealthCheck.too_slow],
                          derandomize=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

# The test models are tiny: one intra-op thread is faster than two fighting over 2 cores.
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def ray_local():
    """A local Ray for one test module (cluster tests), shut down afterwards if we started it."""
    from deploy.launch import RayConfig, start_ray, stop_ray

    started = start_ray(RayConfig(num_cpus=2))
    yield
    stop_ray(started)


@pytest.fixture(scope="module")
def ray_session():
    """A bare local Ray (small object store) for transport tests with their own actors."""
    ray = pytest.importorskip("ray")
    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=80 << 20,
             log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def local_engine():
    """The in-process tiny engine the cluster's tokens are compared with."""
    from engine.engine import EngineConfig, LLMEngine

    return LLMEngine(EngineConfig(model="tiny"))


@pytest.fixture(scope="module")
def http_loop():
    """An asyncio event loop on a daemon thread, for one HTTP API test module."""
    from http_harness import loop_on_thread

    yield from loop_on_thread()


@pytest.fixture(scope="module")
def http_server(http_loop):
    """The coordinator's HTTP app on a loopback port over a LocalEngineBackend (tiny model)."""
    from http_harness import serve_local

    yield from serve_local(http_loop)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_sessionfinish(session, exitstatus):
    """Remove /dev/shm pool files of worker processes the tests killed (kvcache.shm_pool)."""
    from kvcache.shm_pool import shm_available, sweep_dead

    if shm_available():
        sweep_dead()
