"""Starting, stopping and replacing the cluster's worker actors: `Fleet`, the I/O half of the
workers' lifecycle (the decisions are coordinator.membership's).

`open` checks that the Ray cluster has the GPUs the config asks for and binds the report socket;
`start` places the workers, waits (bounded) for each to describe itself and report once, and has
every prefill worker handshake with every decode worker: an incompatible pair (layout, model)
refuses to start, naming both. A worker found lost (coordinator.core's liveness check) is replaced
(`replace`) after a backoff that doubles with each recent replacement of its slot; past
`max_restarts` per `restart_window_s` the slot keeps being retried every `restart_max_backoff_s`,
never left empty for good, and `slot_status` (in /health and /v1/cluster) says why it is empty
meanwhile. The replacement ("decode-0-r1") joins only after the same handshakes as at start, and
the dead one leaves the worker table. One replacement per lost worker at a time; a worker that
reports again during the backoff (slow, not dead) is kept instead. If the coordinator itself
dies, Ray ends the workers it owns (actors share their owner's fate), so no worker outlives it
holding blocks. Adding a worker (`add`) and ending a drained one (`leave`) serve coordinator.drain.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from coordinator.bounded import bounded
from coordinator.membership import Membership
from coordinator.workers import WorkerState, actor_error_text, call, command, spawn_worker, spawn_workers
from protocol.curve import ClusterKeys
from protocol.messages import Connect, Describe

log = logging.getLogger(__name__)


class Fleet:
    """The worker actors and the report socket they push to (see the module docstring)."""

    def __init__(self, members: Membership, namespace: str, progress: Callable[[str], None]):
        self.members, self.state = members, members.state
        self.namespace, self.progress = namespace, progress
        self.bind_host = "127.0.0.1"   # where the report socket binds (found at `open`)
        self.keys: ClusterKeys | None = None  # the cluster's keys (secure clusters), handed to the workers
        self.reports = None            # the report socket, a protocol.queues.PullQueue (`open`)
        self.published: dict = {}     # model path -> its copy in the object store

    def open(self):
        """Check the GPUs, find the bind address, bind the report socket (returned), publish the
        model files when the nodes need them."""
        from protocol.queues import PullQueue

        c = self.state.config
        self._check_gpus()
        self.bind_host = self._bind_host()
        self.keys = ClusterKeys.generate() if c.secure else None  # handed to the workers through Ray
        self.reports = PullQueue(f"tcp://{self.bind_host}:{c.event_port}", create=True, keys=self.keys)
        self.published = self._publish_models()
        return self.reports

    async def start(self) -> list:
        """Place every worker and bring it up (see the module docstring); returns their descriptions.
        Raises asyncio.TimeoutError past `start_timeout_s`, RuntimeError naming a worker that failed."""
        c, s = self.state.config, self.state
        self.members.place(spawn_workers(c, self.reports.address, self.namespace, self._kv_host(),
                                      self.published, self.keys))
        roles = [f"{c.colocated} colocated"] if s.colocated else \
            [f"{c.prefill} prefill", f"{c.decode} decode"]
        self.progress(f"starting {' + '.join(roles)} worker(s): each loads the model "
                      f"(at most {c.start_timeout_s:g}s)")
        infos = await bounded(asyncio.gather(*(self._describe(w) for w in s.workers.values())),
                              c.start_timeout_s)
        if not s.colocated:
            self.progress("handshakes: every prefill worker checks it can hand KV to every decode worker")
            for p in s.role("prefill"):
                for d in s.role("decode"):
                    await self._handshake(p, d)
        await self._first_report(list(s.workers.values()), time.monotonic() + c.start_timeout_s)
        return infos

    def _bind_host(self) -> str:
        """The address the report socket binds, and whether workers bind theirs on their nodes:
        loopback while every Ray node shares this machine's address, else this node's address."""
        import ray

        here, mode = ray.util.get_node_ip_address(), self.state.config.bind
        if mode not in ("auto", "loopback", "node"):
            raise ValueError(f"bind must be 'auto', 'loopback' or 'node', got {mode!r}")
        if mode == "auto":
            nodes = {n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")}
            mode = "loopback" if nodes <= {here} else "node"
        return "127.0.0.1" if mode == "loopback" else here

    def _publish_models(self) -> dict:
        """Model path -> its copy in Ray's object store, for nodes that lack the files."""
        from runtime.model_store import publish

        c = self.state.config
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

        c = self.state.config
        if not str(c.engine.get("device", "cpu")).startswith("cuda"):
            return
        workers = c.colocated or (c.prefill + c.decode)
        need, have = workers * c.gpus_per_worker, ray.cluster_resources().get("GPU", 0)
        if need > have:
            raise RuntimeError(f"the config asks for {need:g} GPUs ({workers} workers x "
                               f"{c.gpus_per_worker:g}) but the Ray cluster has {have:g}")

    async def _describe(self, worker: WorkerState):
        """Wait for the worker's constructor and take its description; a worker that failed to
        start raises RuntimeError naming it and its constructor's own exception."""
        try:
            info = await command(worker, Describe(), self.state.config.start_timeout_s)
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

    async def _handshake(self, prefill: WorkerState, decode: WorkerState) -> None:
        """The prefill worker handshakes with the decode worker now: incompatible -> RuntimeError."""
        timeout = self.state.config.start_timeout_s
        reply = await command(prefill, Connect(decode.name, decode.address), timeout)
        if reply.error:
            raise RuntimeError(f"{prefill.name} (model {prefill.model}, block size {prefill.block_size}) "
                               f"cannot hand KV to {decode.name} (model {decode.model}, block size "
                               f"{decode.block_size}): {reply.error}")

    async def _first_report(self, workers: list, deadline: float) -> None:
        while any(not worker.stats for worker in workers):
            if time.monotonic() > deadline:
                raise asyncio.TimeoutError
            await asyncio.sleep(0.02)

    async def replace(self, dead: WorkerState) -> None:
        """Replace a lost worker (see the module docstring). Never gives up while the cluster runs
        (unless max_restarts is 0: replacement off): past the quick restarts it keeps trying at
        `restart_max_backoff_s`, and `slot_status` says why the slot is empty meanwhile."""
        if not self.members.begin_replace(dead):
            return
        try:
            while not await self._replace_once(dead):
                pass
        finally:
            self.members.end_replace(dead)

    async def _replace_once(self, dead: WorkerState) -> bool:
        """One try at replacing `dead`; True when done (replaced, or it came back), False to try again."""
        import ray

        delay, why = self.members.replace_backoff(dead, time.monotonic())
        await asyncio.sleep(delay)
        if not self.members.still_lost(dead):
            return True
        ray.kill(dead.handle, no_restart=True)  # a wedged one still holds its CPUs, GPU and blocks
        worker = spawn_worker(self.state.config, dead.role, dead.slot or dead.name, self.reports.address,
                              self.namespace, dead.generation + 1, self._kv_host(), self.published,
                              self.keys)
        self.members.replacing_with(dead, worker, why, time.monotonic())
        try:
            await self._join(worker)
        except Exception as e:  # noqa: BLE001 (any failure: the replacement does not join; try again)
            log.error("replacement %s for %s did not join: %s", worker.name, dead.name, e)
            ray.kill(worker.handle, no_restart=True)
            self.members.replace_failed(dead)
            return False
        finally:
            self.members.end_join(worker)
        self.members.joined(worker, replaces=dead)
        log.warning("worker %s replaced by %s", dead.name, worker.name)
        return True

    async def add(self, role: str) -> str:
        """A new worker of `role` in a fresh slot; it joins routing after the same handshakes as a
        replacement. Returns its name; raises (and ends the actor) when it does not join."""
        import ray

        slot = self.members.fresh_slot(role)
        worker = spawn_worker(self.state.config, role, slot, self.reports.address, self.namespace, 0,
                              self._kv_host(), self.published, self.keys)
        self.members.begin_join(worker)
        try:
            await self._join(worker)
        except BaseException:
            ray.kill(worker.handle, no_restart=True)
            raise
        finally:
            self.members.end_join(worker)
        self.members.joined(worker)
        log.warning("worker %s added", worker.name)
        return worker.name

    async def _join(self, worker: WorkerState) -> None:
        """What a replacement or an added worker goes through before routing sees it: it describes
        itself, handshakes with every live worker of the other role, and reports once (bounded)."""
        await self._describe(worker)
        now = time.monotonic()
        pairs = [(p, worker) for p in self.members.live("prefill", now)] if worker.role == "decode" else \
            [(worker, d) for d in self.members.live("decode", now)] if worker.role == "prefill" else []
        for prefill, decode in pairs:
            await self._handshake(prefill, decode)
        await self._first_report([worker], time.monotonic() + self.state.config.start_timeout_s)

    async def leave(self, worker: WorkerState) -> None:
        """End a worker that left the tables: asked to shut down (bounded), then killed."""
        import ray

        try:
            await call(worker.handle.shutdown.remote(), self.state.config.call_timeout_s)
        except Exception:  # noqa: BLE001 (dead or stuck: the kill below ends it anyway)
            pass
        ray.kill(worker.handle, no_restart=True)

    async def end_workers(self, graceful: bool) -> None:
        """End every worker (graceful: each is asked to shut down first, bounded)."""
        import ray

        for worker in list(self.state.workers.values()):
            if graceful:
                try:
                    await call(worker.handle.shutdown.remote(), self.state.config.call_timeout_s)
                except Exception:  # dead or stuck: killing it below frees it anyway
                    pass
            ray.kill(worker.handle, no_restart=True)
        self.members.clear_workers()

    def close_reports(self) -> None:
        if self.reports is not None:
            self.reports.close()
            self.reports = None
