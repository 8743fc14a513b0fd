"""Server harness of the HTTP API tests (test_http_api.py, test_http_api_routes.py): a `Server`
wrapper holding the real `openai` client plus raw-HTTP and /metrics helpers, `serve` to put the
coordinator's aiohttp app on a loopback port, and a wait for the server to settle (no active
request, no used block) after a disconnect. The generators behind the module-scoped `http_loop`
and `http_server` fixtures of conftest.py (an event loop on a thread; the app over a
LocalEngineBackend with the tiny model) are here too.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request

import openai
import torch
from prometheus_client.parser import text_string_to_metric_families

from coordinator.http import HTTPConfig, make_app, start_server
from deploy.in_process import LocalEngineBackend
from engine.engine import EngineConfig

CONFIG = EngineConfig(model="tiny", num_blocks=256)
POLL_S = 20.0  # bound on waiting for the server to settle after a disconnect


class Server:
    def __init__(self, loop, backend, runner, port):
        self.loop, self.backend, self.runner, self.port = loop, backend, runner, port
        self.url = f"http://127.0.0.1:{port}"
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=60)

    def get(self, path: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=30) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def post(self, body: bytes | dict, path: str = "/v1/completions") -> tuple[int, bytes]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def metric(self, name: str, **labels) -> float:
        _, body = self.get("/metrics")
        for family in text_string_to_metric_families(body.decode()):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    return sample.value
        return 0.0


def loop_on_thread():
    """Generator behind the `http_loop` fixture (conftest.py): an asyncio loop run on a daemon
    thread, with one torch intra-op thread while it lives."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model on a shared CPU: thread spin-waiting costs more than it gives
    event_loop = asyncio.new_event_loop()
    thread = threading.Thread(target=event_loop.run_forever, daemon=True)
    thread.start()
    yield event_loop
    event_loop.call_soon_threadsafe(event_loop.stop)
    thread.join(10)
    event_loop.close()
    torch.set_num_threads(threads)


def serve(loop, backend, config: HTTPConfig | None = None) -> Server:
    """Start the HTTP app for `backend` on a free loopback port, on `loop`."""
    app = make_app(backend, config or HTTPConfig(stall_timeout_s=30))
    runner, port = asyncio.run_coroutine_threadsafe(start_server(app, "127.0.0.1", 0), loop).result(30)
    return Server(loop, backend, runner, port)


def serving(loop, backend):
    """Generator for module fixtures: the HTTP app over `backend` (started here), cleaned up and
    the backend closed afterwards."""
    served = serve(loop, backend.start())
    try:
        yield served
    finally:
        asyncio.run_coroutine_threadsafe(served.runner.cleanup(), loop).result(30)
        backend.close()


def serving_smollm2(loop):
    """`serving` over an in-process SmolLM2 engine (weights shared with the other SmolLM2 tests)."""
    from smollm2_helpers import engine_model

    from engine.engine import LLMEngine

    engine = LLMEngine(EngineConfig(model="smollm2", num_blocks=128), loaded=engine_model())
    yield from serving(loop, LocalEngineBackend(engine=engine))


def serve_local(loop):
    """Generator behind the `http_server` fixture (conftest.py): the app over a started
    LocalEngineBackend, cleaned up and closed afterwards."""
    yield from serving(loop, LocalEngineBackend(CONFIG))


def settled(server: Server) -> bool:
    info = server.backend.info()
    return info["ledger"]["active_requests"] == 0 and server.backend.engine.kv.allocator.num_used == 0


def wait_settled(server: Server) -> None:
    deadline = time.monotonic() + POLL_S
    while not settled(server) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert settled(server), server.backend.info()
