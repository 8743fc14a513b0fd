"""Launching the cluster: Ray (a local embedded one, or an existing cluster joined by address), the
worker actors (through `ClusterBackend`) and the HTTP API, and shutting down exactly what was
started.

`start_ray` / `stop_ray` bracket Ray itself (stop only shuts down a Ray we started). The local
embedded Ray listens on loopback only, keeps its files in a private temp folder, and both it and
a joined cluster use Ray's token authentication by default; a joined cluster whose auth mode
differs is refused with what to set (deploy.ray_guard says how, and how the token is provided).
`serve_cluster` is the coroutine `pdserve up` runs until cancelled; `ClusterServer` runs the
same thing on a background thread with its own event loop, for tests and the demo.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RayConfig:
    """address: an existing Ray cluster ('auto' or 'HOST:PORT'); None starts a local embedded one.
    num_cpus: CPUs the local Ray offers (workers reserve fractions of one each).
    log_to_driver: show worker logs in this process.
    auth: Ray's token authentication, 'token' or 'disabled', unless $RAY_AUTH_MODE says otherwise."""

    address: str | None = None
    num_cpus: int = 2
    log_to_driver: bool = False
    auth: str = "token"


_session = contextlib.ExitStack()  # what start_ray set (RAY_AUTH_MODE) until stop_ray undoes it


def start_ray(config: RayConfig = RayConfig()) -> bool:
    """Initialise Ray unless it already is; True when this call started (or joined) it.
    Raises RuntimeError (no token to join with) or ValueError (a bad RAY_AUTH_MODE)."""
    import ray

    from deploy import ray_guard

    if ray.is_initialized():
        return False
    mode = ray_guard.auth_mode(config.auth)
    if config.address and mode == "token":
        ray_guard.require_token(config.address)
    if config.address:
        ray_guard.check_cluster_auth(config.address, mode)
    if mode == "token":
        ray_guard.private_token()
    with contextlib.ExitStack() as stack:
        stack.enter_context(ray_guard.auth_env(mode))
        if config.address:
            ray.init(address=config.address, log_to_driver=config.log_to_driver)
        else:  # NOTE: address="local" starts a new instance, never joins another (or a dead) session
            temp_dir = ray_guard.private_temp_dir()
            with ray_guard.loopback_node():
                ray.init(address="local", num_cpus=config.num_cpus, include_dashboard=False,
                         log_to_driver=config.log_to_driver, _temp_dir=temp_dir)
            ray_guard.check_loopback()
        _session.push(stack.pop_all())
    return True


def stop_ray(started: bool) -> None:
    import ray

    if started and ray.is_initialized():
        ray.shutdown()
    if started:
        _session.close()


async def serve_cluster(backend, host: str = "127.0.0.1", port: int = 8000, ready=None,
                        http_config=None) -> None:
    """Start the workers of `backend` (a ClusterBackend, not started) and the HTTP API; serve until
    cancelled; then stop both (actors killed). Each phase is told to the backend's progress."""
    from coordinator.http import HTTPConfig, make_app, start_server

    await backend.start()
    try:
        app = make_app(backend, http_config or HTTPConfig(host=host, port=port), metrics=backend.metrics)
        backend.progress(f"binding the HTTP API on {host}:{port}")
        runner, bound = await start_server(app, host, port)
        try:
            if ready is not None:
                ready(bound, backend)
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()
    finally:
        await backend.aclose()


class ClusterServer:
    """`serve_cluster` on a background thread: `port = srv.start()`, ..., `srv.stop()`."""

    def __init__(self, cluster_config, host: str = "127.0.0.1", port: int = 0, http_config=None):
        self.args = (cluster_config, host, port)
        self.http_config = http_config
        self.loop = asyncio.new_event_loop()
        self.port: int | None = None
        self.backend = None
        self._ready: concurrent.futures.Future = concurrent.futures.Future()
        self._task = None
        self._thread = threading.Thread(target=self._run, name="pdserve-cluster", daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)

        def ready(port, backend):
            self.port, self.backend = port, backend
            self._ready.set_result(port)

        async def main():
            from coordinator.cluster import ClusterBackend

            self._task = asyncio.current_task()
            config, host, port = self.args
            try:
                await serve_cluster(ClusterBackend(config), host, port, ready=ready,
                                    http_config=self.http_config)
            except asyncio.CancelledError:
                pass
            except BaseException as e:
                if not self._ready.done():
                    self._ready.set_exception(e)
                raise

        try:
            self.loop.run_until_complete(main())
        except Exception:
            log.exception("cluster server stopped with an error")
        finally:
            self.loop.close()

    def start(self, timeout: float = 240.0) -> int:
        self._thread.start()
        return self._ready.result(timeout=timeout)

    def call(self, coro, timeout: float = 30.0):
        """Run a coroutine on the server's loop (e.g. backend.abort) and wait for it, bounded."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self, timeout: float = 60.0) -> None:
        if self._task is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._task.cancel)
        self._thread.join(timeout)
