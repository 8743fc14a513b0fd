"""The Ray actor body every worker role shares: an engine, a role handler on a `WorkerLoop`, and
one typed entry point.

The coordinator talks to a worker through `command(bytes) -> bytes`: a `protocol.messages`
command in, a reply out, both `protocol.codec` msgpack (no pickled objects cross). The role
handler's `accept(command)` runs first, on the calling thread, and either answers at once
(validation errors, credit checks against the last snapshot) or says where the command goes:
`QUEUE` (to the loop, answered with an empty `Reply` now) or `CALL` (to the loop, whose answer
is returned). Reports go to the coordinator over a `PushQueue`. Role actors subclass this with
their config class and handler (prefill_worker, decode_worker).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from protocol.codec import ProtocolError, decode, encode
from protocol.messages import Describe, InjectFault, Reply, WorkerInfo, WorkerReport
from protocol.queues import PushQueue
from runtime.heartbeat import HeartbeatThread
from runtime.loop import LoopConfig, WorkerLoop

QUEUE = "queue"  # accept(): run it on the loop, reply at once
CALL = "call"    # accept(): run it on the loop, reply with its answer


@dataclass(frozen=True)
class WorkerConfig:
    name: str                    # the worker's id (also its Ray actor name)
    events_address: str          # the coordinator's PULL socket its reports go to
    engine: dict = field(default_factory=dict)  # engine keyword arguments (the actor sets the role)
    heartbeat_s: float = 0.2     # the loop settings: see runtime.loop.LoopConfig
    idle_poll_s: float = 0.02
    busy_poll_s: float = 0.001
    call_timeout_s: float = 30.0
    torch_threads: int = 1       # intra-op threads of torch and the CPU kernels (coordinator.workers sets it)
    # the coordinator's published copy of the model's files (runtime.model_store), or None
    model_files: dict | None = None
    fetch_model: bool = False    # load the published copy even when the path exists on this node
    # the cluster's keys (protocol.curve: 'public', 'secret'): reports go over CURVE and KV handshakes
    # are signed; None outside a secured cluster (in-process tests)
    cluster_keys: dict | None = None
    niceness: int | None = None  # the nice value the process sets for itself at start (runtime.priority)
    warmup: bool = True          # two dummy prompts through the engine before any request (engine.warmup)
    # and then once more, timed (engine.warmup.startup_profile): coordinator.decide prices local prefills
    cpu: int | None = None       # the one CPU all the worker's threads run on (runtime.priority); None: any

    @property
    def keys(self):
        from protocol.curve import ClusterKeys

        return ClusterKeys(**self.cluster_keys) if self.cluster_keys else None


def refuse_submit(engine, cmd) -> Reply | None:
    """A Reply naming why the engine cannot run this Submit (checked read-only, on the caller's
    thread), or None when it can."""
    from engine.engine import RequestError

    try:
        engine.validate_prompt(list(cmd.prompt_ids), cmd.params)
    except (RequestError, ValueError, TypeError) as e:
        return Reply(error=str(e))
    return None


class WorkerActor:
    """Subclasses set `role`, `config_class` and implement `make_handler(config, engine)`."""

    role = ""
    config_class = WorkerConfig

    def __init__(self, config: dict):
        import torch

        from engine.engine import EngineConfig, LLMEngine
        from engine.warmup import startup_profile, warm_up
        from runtime.model_store import resolve
        from runtime.priority import pin_to_cpu, set_niceness

        self.config = self.config_class(**config)
        self.niceness = set_niceness(self.config.niceness)  # before any thread of ours starts
        self.cpus = pin_to_cpu(self.config.cpu) or []
        torch.set_num_threads(max(1, self.config.torch_threads))
        engine = dict(self.config.engine or {})
        engine["model"], self.model_source = resolve(engine.get("model", "tiny"), self.config.model_files,
                                                     prefer_local=not self.config.fetch_model)
        self.engine = LLMEngine(EngineConfig(**{**engine, **self.engine_options(), "role": self.role}),
                                **self.engine_hooks())
        self.handler = self.make_handler(self.config, self.engine)
        # NOTE: after the handler (a decode pool's held_back asks it), before its loop takes a command
        self.startup: dict = {}
        if self.config.warmup:
            warm_up(self.engine)
            self.startup = startup_profile(self.engine)
        self._events = PushQueue(self.config.events_address, keys=self.config.keys)  # the loop thread's
        c = self.config
        loop_config = LoopConfig(c.name, c.heartbeat_s, c.idle_poll_s, c.busy_poll_s, c.call_timeout_s)
        self.loop = WorkerLoop(loop_config, self.handler, self._emit)
        if hasattr(self.handler, "attach"):  # a role with threads of its own posts their results here
            self.handler.attach(self.loop.send)
        self._heartbeat = HeartbeatThread(c.name, c.events_address, c.heartbeat_s, self.loop.progress, c.keys)

    def make_handler(self, config, engine):
        raise NotImplementedError

    def engine_options(self) -> dict:
        """EngineConfig fields this role sets over the cluster's engine settings."""
        return {}

    def engine_hooks(self) -> dict:
        """LLMEngine keyword arguments this role passes (callables into its handler, e.g. `held_back`)."""
        return {}

    # ---- actor methods ----------------------------------------------------------------------------
    def command(self, data: bytes) -> bytes:
        """One protocol command in, its reply out (both msgpack bytes)."""
        try:
            cmd = decode(data)
        except ProtocolError as e:
            return encode(Reply(error=f"bad command: {e}"))
        return encode(self._answer(cmd))

    def _answer(self, cmd):
        if isinstance(cmd, Describe):
            return self.describe()
        if isinstance(cmd, InjectFault):
            if cmd.kind == "hang":
                self.loop.hang()
                return Reply()
            faults = getattr(self.handler, "faults", None)
            if faults is None:
                return Reply(error=f"a {self.role} worker cannot inject {cmd.kind!r}")
            faults.arm(cmd.kind, cmd.count)
            return Reply()
        route = self.handler.accept(cmd)
        if route == QUEUE:
            self.loop.send(cmd)
            return Reply()
        if route == CALL:
            return self.loop.call(cmd)
        return route

    def describe(self) -> WorkerInfo:
        import torch

        e = self.engine
        node_id = node_address = ""
        try:
            import ray

            if ray.is_initialized():
                node_id = ray.get_runtime_context().get_node_id()
                node_address = ray.util.get_node_ip_address()
        except ImportError:  # in process without Ray (tests)
            pass
        return WorkerInfo(name=self.config.name, role=self.role, address=getattr(self.handler, "address", ""),
                          fingerprint=e.storage.layout.fingerprint(), block_size=e.config.block_size,
                          model=e.config.model, max_context=e.model_config.max_position_embeddings,
                          vocab_size=e.model_config.vocab_size, bos_token_id=e.model_config.bos_token_id,
                          eos_token_ids=list(e.model_config.eos_token_ids), device=str(e.device),
                          node_id=node_id, node_address=node_address, pid=os.getpid(),
                          model_source=self.model_source, threads=torch.get_num_threads(),
                          niceness=self.niceness, cpus=list(self.cpus), startup=dict(self.startup),
                          weights=e.computes_in)

    def stats(self) -> dict:
        return self.loop.stats()

    def inject_fault(self, kind: str, count: int = 1) -> None:
        """Tests and the chaos benchmark: the same as the `InjectFault` command."""
        self._answer(InjectFault(kind, count))

    def shutdown(self) -> None:
        self._heartbeat.stop()
        self.loop.shutdown()
        self._events.close()

    # ---- the loop thread ----------------------------------------------------------------------------
    def _emit(self, events: list, stats: dict, holdings: dict) -> None:
        self._events.put(WorkerReport(self.config.name, stats, holdings, events))
