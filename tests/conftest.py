"""Shared test setup: hypothesis profiles (select with HYPOTHESIS_PROFILE), one torch thread,
the `gpu` marker's skip when CUDA is absent, the cluster tests' fixtures (a local Ray shared by
the modules of one pytest process, the in-process reference engine) and the HTTP API tests' ones
(an event loop on a thread, the coordinator's app over a tiny-model backend; see http_harness.py)."""

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile("default", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", deadline=None, suppress_health_check=[HealthCheck.too_slow],
                          derandomize=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

# Every Ray the tests start (here, or in a CLI subprocess, which inherits this environment) runs its
# workers at nice 0, as the pytest workers are, not Ray's 15. At 15 one test's engines got about 1/28
# of the CPU whenever another pytest worker computed: 2026-12-03, two nice-0 CPU hogs beside a SmolLM2
# 1P+1D cluster made a 172-token prompt take 43 s and the next ones time out (504), against 1.6-3.9 s
# with workers at 0; a fresh CI machine saw a cluster take 76 s to start and the demo's streamed
# migration fall back.
os.environ.setdefault("RAY_worker_niceness", "0")

# The test models are tiny: one intra-op thread is faster than two fighting over 2 cores.
torch.set_num_threads(1)


class _SharedRay:
    """One local Ray per pytest process, kept up from one module to the next that asks for the
    same kind (a Ray start costs about 6 CPU-seconds; the suite used to pay it in every module).
    Kinds: "loopback" is deploy.launch.start_ray's embedded Ray (what `pdserve up` runs);
    "routable" is a plain `ray.init` on this host's routable address with a small object store.
    A module marked `own_ray` starts its own Ray in this process, so the shared one is stopped first."""

    kind: str | None = None

    @classmethod
    def ensure(cls, kind: str) -> None:
        if cls.kind == kind and cls._idle():
            return
        cls.stop()
        if kind == "loopback":
            from deploy.launch import RayConfig, start_ray

            start_ray(RayConfig(num_cpus=2))
        else:
            import ray

            ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=80 << 20,
                     log_to_driver=False)
        cls.kind = kind

    @staticmethod
    def _idle() -> bool:
        """No CPU or GPU is held by what a previous module started (a failed test can leave an actor)."""
        import ray

        if not ray.is_initialized():
            return False
        total, free = ray.cluster_resources(), ray.available_resources()
        return all(free.get(k, 0.0) >= total.get(k, 0.0) for k in ("CPU", "GPU"))

    @classmethod
    def stop(cls) -> None:
        if cls.kind == "loopback":
            from deploy.launch import stop_ray

            stop_ray(True)
        elif cls.kind == "routable":
            import ray

            ray.shutdown()
        cls.kind = None


@pytest.fixture(scope="module")
def ray_local():
    """The embedded local Ray (loopback only) for a cluster test module, shared across modules."""
    _SharedRay.ensure("loopback")
    yield


@pytest.fixture(scope="module")
def ray_session():
    """A plain local Ray on the routable address (small object store), shared across modules."""
    pytest.importorskip("ray")
    _SharedRay.ensure("routable")
    yield


@pytest.fixture(scope="module", autouse=True)
def _own_ray_module(request):
    """Before a module that starts Ray itself (marker `own_ray`), stop the shared one."""
    if request.node.get_closest_marker("own_ray") is not None:
        _SharedRay.stop()
    yield


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
    """Stop the shared Ray; remove /dev/shm pool files of worker processes the tests killed
    (kvcache.shm_pool)."""
    from kvcache.shm_pool import shm_available, sweep_dead

    _SharedRay.stop()

    if shm_available():
        sweep_dead()
