"""Starting, stopping and replacing the cluster's workers, as a mixin of `ClusterBackend`.

`start` checks that the Ray cluster has the GPUs the config asks for, places the workers, waits
(bounded) for each to describe itself and report once, and has every prefill worker handshake
with every decode worker: an incompatible pair (layout, model) refuses to start, naming both.
A worker found dead (coordinator.failover's monitor) is replaced after a backoff that doubles
with each recent replacement of its slot; past `max_restarts` per `restart_window_s` the slot
keeps being retried every `restart_max_backoff_s`, never left empty for good, and `slot_status`
(in /health and /v1/cluster) says why it is empty meanwhile; the
replacement ("decode-0-r1") joins only after the same handshakes as at start, and the dead
one leaves the worker table. One replacement per lost worker at a time; a worker that reports
again during the backoff (slow, not dead) is kept instead. If the coordinator itself dies, Ray
ends the workers it owns (actors share their owner's fate), so no worker outlives it holding
blocks. Draining a worker and scaling a role at run time: coordinator.drain (its mixin is this
one's base); a drained worker's slot is retired and never replaced.
"""

from __future__ import annotations

import asyncio
import logging
import time

from coordinator.bounded import bounded
from coordinator.completion_request import ServiceUnavailable
from coordinator.drain import DrainMixin
from coordinator.workers import actor_error_text, call, command, spawn_worker, spawn_workers
from protocol.curve import ClusterKeys
from protocol.messages import Connect, Describe

log = logging.getLogger(__name__)


class LifecycleMixin(DrainMixin):
    """Needs from the host class: config, colocated, workers, routers, ledger, reconciler, metrics,
    progress, namespace, tokenizer, _pull, _reader, _monitor_task, _tasks, _lost, _replacing, _restarts,
    _joining, _requests, _read_reports, _monitor, _role (see coordinator.cluster.ClusterBackend)."""

    async def start(self):
        from model_files.tokenizer import load_tokenizer
        from protocol.queues import PullQueue

        c = self.config
        self._check_gpus()
        self.bind_host = self._bind_host()
        self.keys = ClusterKeys.generate() if c.secure else None  # handed to the workers through Ray
        self._pull = PullQueue(f"tcp://{self.bind_host}:{c.event_port}", create=True, keys=self.keys)
        self._reader = asyncio.create_task(self._read_reports())
        self._published = self._publish_models()
        self.workers.update(spawn_workers(c, self._pull.address, self.namespace, self._kv_host(),
                                          self._published, self.keys))
        roles = [f"{c.colocated} colocated"] if self.colocated else [f"{c.prefill} prefill",
                                                                     f"{c.decode} decode"]
        self.progress(f"starting {' + '.join(roles)} worker(s): each loads the model "
                      f"(at most {c.start_timeout_s:g}s)")
        try:
            infos = await bounded(asyncio.gather(
                *(self._describe(worker) for worker in self.workers.values())), c.start_timeout_s)
            if not self.colocated:
                self.progress("handshakes: every prefill worker checks it can hand KV to every decode worker")
                for p in self._role("prefill"):
                    for d in self._role("decode"):
                        await self._handshake(p, d)
            await self._first_report(list(self.workers.values()), time.monotonic() + c.start_timeout_s)
        except asyncio.TimeoutError:
            await self.aclose(graceful=False)
            raise RuntimeError(f"workers did not start within {c.start_timeout_s}s") from None
        except asyncio.CancelledError:  # stopped while starting (Ctrl-C): nothing was served yet
            await self.aclose(graceful=False)
            raise
        except Exception as e:
            await self.aclose(graceful=False)
            raise RuntimeError(f"a worker failed to start: {e}") from None
        first = infos[0]  # every worker serves the same model (the handshakes enforce it)
        self.max_context, self.vocab_size = first.max_context, first.vocab_size
        self.weights = "+".join(sorted({info.weights for info in infos}))  # one format unless configs differ
        self.tokenizer = load_tokenizer(None if c.model == "tiny" else c.model, first)
        self._monitor_task = asyncio.create_task(self._monitor())
        return self

    def _bind_host(self) -> str:
        """The address the report socket binds, and whether workers bind theirs on their nodes:
        loopback while every Ray node shares this machine's address, else this node's address."""
        import ray

        here, mode = ray.util.get_node_ip_address(), self.config.bind
        if mode not in ("auto", "loopback", "node"):
            raise ValueError(f"bind must be 'auto', 'loopback' or 'node', got {mode!r}")
        if mode == "auto":
            nodes = {n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")}
            mode = "loopback" if nodes <= {here} else "node"
        return "127.0.0.1" if mode == "loopback" else here

    def _publish_models(self) -> dict:
        """Model path -> its copy in Ray's object store, for nodes that lack the files."""
        from runtime.model_store import publish

        c = self.config
        if c.model_distribution not in ("auto", "always", "never"):
            raise ValueError(f"model_distribution must be 'auto', 'always' or 'never', "
                             f"got {c.model_distribution!r}")
        one_machine = self.bind_host == "127.0.0.1"  # every node is this machine: the files are here
        if c.model_distribution == "never" or (c.model_distribution == "auto" and one_machine):
            return {}
        models = {c.model, c.decode_model or c.model}
        return {m: published for m in models if (published := publish(m)) is not None}

    def _kv_host(self) -> str:
        return "127.0.0.1" if self.bind_host == "127.0.0.1" else "node"

    def _check_gpus(self) -> None:
        """Refuse at start a config that asks for more GPUs than the Ray cluster has."""
        import ray

        c = self.config
        if not str(c.engine.get("device", "cpu")).startswith("cuda"):
            return
        workers = c.colocated or (c.prefill + c.decode)
        need, have = workers * c.gpus_per_worker, ray.cluster_resources().get("GPU", 0)
        if need > have:
            raise RuntimeError(f"the config asks for {need:g} GPUs ({workers} workers x "
                               f"{c.gpus_per_worker:g}) but the Ray cluster has {have:g}")

    async def _describe(self, worker):
        """Wait for the worker's constructor and take its description; a worker that failed to
        start raises RuntimeError naming it and its constructor's own exception."""
        try:
            info = await command(worker, Describe(), self.config.start_timeout_s)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            raise
        except Exception as e:
            raise RuntimeError(f"{worker.name}: {actor_error_text(e)}") from None
        worker.address, worker.block_size, worker.model = info.address, info.block_size, info.model
        worker.info = {"device": info.device, "node_id": info.node_id, "node_address": info.node_address,
                       "pid": info.pid, "model_source": info.model_source, "threads": info.threads,
                       "niceness": info.niceness, "cpus": list(info.cpus), "startup": dict(info.startup)}
        worker.last_seen = time.monotonic()
        return info

    async def _handshake(self, prefill, decode) -> None:
        """The prefill worker handshakes with the decode worker now: incompatible -> RuntimeError."""
        reply = await command(prefill, Connect(decode.name, decode.address), self.config.start_timeout_s)
        if reply.error:
            raise RuntimeError(f"{prefill.name} (model {prefill.model}, block size {prefill.block_size}) "
                               f"cannot hand KV to {decode.name} (model {decode.model}, block size "
                               f"{decode.block_size}): {reply.error}")

    async def _first_report(self, workers: list, deadline: float) -> None:
        while any(not worker.stats for worker in workers):
            if time.monotonic() > deadline:
                raise asyncio.TimeoutError
            await asyncio.sleep(0.02)

    async def _replace(self, dead) -> None:
        """Replace a dead worker (see the module docstring). Never gives up while the cluster runs
        (unless max_restarts is 0: replacement off): past the quick restarts it keeps trying at
        `restart_max_backoff_s`, and `slot_status` says why the slot is empty meanwhile."""
        if dead.name in self._replacing or self.config.max_restarts <= 0:
            return
        self._replacing.add(dead.name)
        slot = dead.slot or dead.name
        try:
            while not await self._replace_once(dead):
                pass
        finally:
            self._replacing.discard(dead.name)
            self.slot_status.pop(slot, None)

    def _restart_delay(self, slot: str) -> tuple[float, int]:
        """(seconds to wait before the next try for `slot`, tries within the window so far)."""
        c, now = self.config, time.monotonic()
        recent = self._restarts.setdefault(slot, [])
        recent[:] = [t for t in recent if now - t < c.restart_window_s]
        if len(recent) >= c.max_restarts:  # the quick restarts are spent: a bounded, steady pace
            self.metrics.count_error("restart_limit")
            return c.restart_max_backoff_s, len(recent)
        return min(c.restart_backoff_s * 2 ** len(recent), c.restart_max_backoff_s), len(recent)

    async def _replace_once(self, dead) -> bool:
        """One try at replacing `dead`; True when done (replaced, or it came back), False to try again."""
        import ray

        c, slot = self.config, dead.slot or dead.name
        delay, tries = self._restart_delay(slot)
        why = dead.why_not_alive(c.heartbeat_timeout_s) or "lost"
        self.slot_status[slot] = (f"{dead.name} {why}; replacement try {tries + 1} in {delay:g}s "
                                  f"({tries} within the last {c.restart_window_s:g}s)")
        if tries >= c.max_restarts:
            log.error("worker slot %s: %d replacements within %gs; trying again in %gs", slot, tries,
                      c.restart_window_s, delay)
        await asyncio.sleep(delay)
        if slot in self._retired:  # drained away meanwhile (coordinator.drain): the slot is gone
            return True
        if dead.name not in self._lost:  # it reported again during the backoff: slow, not dead
            log.warning("worker %s came back: not replaced", dead.name)
            return True
        self._restarts[slot].append(time.monotonic())
        ray.kill(dead.handle, no_restart=True)  # a wedged one still holds its CPUs, GPU and blocks
        worker = spawn_worker(c, dead.role, slot, self._pull.address, self.namespace, dead.generation + 1,
                              self._kv_host(), self._published, self.keys)
        self._joining[worker.name] = worker  # its reports update its stats; nothing is routed to it yet
        self.slot_status[slot] = f"{dead.name} {why}; replacement {worker.name} is starting"
        try:
            await self._join(worker)
        except Exception as e:  # noqa: BLE001 (any failure: the replacement does not join; try again)
            log.error("replacement %s for %s did not join: %s", worker.name, dead.name, e)
            ray.kill(worker.handle, no_restart=True)
            self.metrics.count_error("restart_failed")
            dead.generation += 1  # the next try gets a fresh name
            return False
        finally:
            self._joining.pop(worker.name, None)
        self.workers[worker.name] = worker
        self.workers.pop(dead.name, None)
        self._lost.discard(dead.name)
        self.metrics.count_restart(dead.role)
        log.warning("worker %s replaced by %s", dead.name, worker.name)
        return True

    async def _join(self, worker) -> None:
        """What a replacement or an added worker goes through before routing sees it: it describes
        itself, handshakes with every live worker of the other role, and reports once (bounded)."""
        await self._describe(worker)
        pairs = [(p, worker) for p in self._live("prefill")] if worker.role == "decode" else \
            [(worker, d) for d in self._live("decode")] if worker.role == "prefill" else []
        for prefill, decode in pairs:
            await self._handshake(prefill, decode)
        await self._first_report([worker], time.monotonic() + self.config.start_timeout_s)

    def _live(self, role: str) -> list:
        timeout = self.config.heartbeat_timeout_s
        return [w for w in self._role(role) if w.alive(timeout) and w.name not in self._lost]

    async def aclose(self, graceful: bool = True) -> None:
        """Stop the workers: each is asked to shut down (bounded), then killed. graceful=False
        kills at once: a start that failed or was stopped, where a worker may still be inside
        its constructor (a shutdown call would wait for that) and holds no request."""
        import ray

        for worker in self.workers.values():
            if graceful:
                try:
                    await call(worker.handle.shutdown.remote(), self.config.call_timeout_s)
                except Exception:  # dead or stuck: killing it below frees it anyway
                    pass
            ray.kill(worker.handle, no_restart=True)
        self.workers.clear()
        for task in (self._reader, self._monitor_task, *self._tasks):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if self._pull is not None:
            self._pull.close()
            self._pull = None
        for request in self._requests.values():
            request.q.put_nowait(ServiceUnavailable("server shutting down"))
