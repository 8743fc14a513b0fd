"""The coordinator's view of its worker actors: creating them, and the per-worker and per-request state.

`spawn_workers` places the actors a `ClusterConfig` asks for (prefill + decode workers, or K
colocated workers) with the engine settings of each role. `WorkerState` is what the coordinator
knows of one worker (handle, address, block size, its last report, liveness); `RequestState` is
one request in flight (its workers, its migration epoch, the reorder buffer of token events by
output position). `command` sends a typed command (protocol.messages) and awaits its reply with
a bound; `tell` sends one without waiting. Nothing here runs an engine: the engines live in the
actors (prefill_worker/, decode_worker/).
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass, field

from coordinator.bounded import bounded
from protocol.codec import decode, encode

ROLES_DISAGGREGATED = ("prefill", "decode")
ROLES_COLOCATED = ("colocated",)
WEDGE_FACTOR = 4.0  # a loop iteration may run this many times its step's expected time (WorkerState.wedged)


class CommandEncodeError(ValueError):
    """A command that cannot be encoded for the wire: the request's fault, never the worker's."""


def encode_command(cmd) -> bytes:
    """`cmd` as msgpack bytes, or CommandEncodeError naming why not (an unencodable string, an
    integer beyond 64 bits...). Encoding happens before anything leaves the coordinator, so an
    error here is never mistaken for the death of the worker it was meant for."""
    try:
        return encode(cmd)
    except (TypeError, ValueError, OverflowError, UnicodeError) as e:
        raise CommandEncodeError(f"{type(e).__name__}: {e}") from None


def actor_died(error: BaseException) -> bool:
    """True when Ray says the actor's process is gone; a call that raised, or an actor that is
    only unreachable for now (ActorUnavailableError), is not a death."""
    from ray.exceptions import ActorDiedError

    return isinstance(error, ActorDiedError)


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")        # colour codes Ray puts in a remote task's text
_FRAME = re.compile(r'^\s*File ".*", line \d+')      # a traceback frame's first line


def actor_error_text(error: BaseException) -> str:
    """Why a worker actor failed, in one line without colour codes. For an exception raised in its
    constructor that is the exception's own type and message: Ray hands it back only as text, an
    ActorDiedError that begins "The actor died because of an error raised in its creation task"
    and carries the remote traceback, whose last lines after the last frame are "Type: message".
    Anything else: the error's type and its unindented lines."""
    lines = _ANSI.sub("", str(error)).splitlines()
    frames = [i for i, line in enumerate(lines) if _FRAME.match(line)]
    if frames:
        rest = lines[frames[-1] + 1:]
        while rest and rest[0][:1].isspace():  # the frame's source line and its ^^^ markers
            rest.pop(0)
        if rest:
            return " ".join(line.strip() for line in rest if line.strip())
    said = " ".join(line.strip() for line in lines if line.strip() and not line[:1].isspace())
    return f"{type(error).__name__}: {said}" if said else type(error).__name__


@dataclass
class WorkerState:
    name: str
    role: str
    handle: object
    address: str = ""
    block_size: int = 0
    model: str = ""
    stats: dict = field(default_factory=dict)
    holdings: dict = field(default_factory=dict)   # request id -> blocks, from its last report
    slot: str = ""                                 # the place it fills ("decode-0"); kept by replacements
    generation: int = 0                            # 0: the first worker of the slot; g: its g-th replacement
    info: dict = field(default_factory=dict)       # what it said of itself at start (node, pid, device)
    last_seen: float = field(default_factory=time.monotonic)  # its last report or heartbeat
    dead: str | None = None
    progress: dict = field(default_factory=dict)   # its last Heartbeat's loop progress (runtime.heartbeat)

    def alive(self, timeout: float, now: float | None = None) -> bool:
        """Its process heartbeats (within `timeout`) and its loop progresses (see `wedged`), at
        `now` (time.monotonic() when not given)."""
        return self.why_not_alive(timeout, now) is None

    def why_not_alive(self, timeout: float, now: float | None = None) -> str | None:
        """None when alive, else why not: dead (as Ray or its loop said), silent, or wedged."""
        now = time.monotonic() if now is None else now
        if self.dead is not None:
            return f"dead ({self.dead})"
        if self.stats.get("failed"):
            return f"its loop failed ({self.stats['failed']})"
        if now - self.last_seen >= timeout:
            return f"no heartbeat for {now - self.last_seen:.1f}s"
        return self.wedged(timeout)

    def wedged(self, floor_s: float) -> str | None:
        """Why its loop counts as wedged, or None. A busy loop is not a dead one: one iteration may
        run as long as WEDGE_FACTOR times what its current step should take at the step rate the
        worker measured (a long prefill step on a slow machine), and never less than `floor_s`.
        Judged on what the last heartbeat said, not extrapolated from it: a late heartbeat means a
        starved process (heartbeats stopping altogether are `why_not_alive`'s silence), and a loop
        that is really stuck says so in the next one, one heartbeat period later."""
        p = self.progress
        if not p:
            return None
        busy = p["busy_s"]
        allowed = max(floor_s, WEDGE_FACTOR * p["step_expected_s"])
        if busy <= allowed:
            return None
        step = f"a step of {p['step_tokens']} tokens expected to take {p['step_expected_s']:.2f}s" \
            if p["step_tokens"] else "no engine step"
        return f"wedged: one loop iteration has run {busy:.1f}s ({step}; allowed {allowed:.1f}s)"

    def beat(self, beat, now: float | None = None) -> None:
        """A Heartbeat from its heartbeat thread at `now` (time.monotonic() when not given): the
        process is alive; record its loop's progress."""
        self.last_seen = time.monotonic() if now is None else now
        self.progress = {"busy_s": beat.busy_s, "step_tokens": beat.step_tokens,
                         "step_expected_s": beat.step_expected_s}
        if not beat.loop_alive and self.dead is None:
            self.dead = "its engine loop ended"


@dataclass
class RequestState:
    rid: str
    n: int
    prompt_tokens: int
    prefill: str
    decode: str                                  # colocated: the one worker (prefill == decode)
    prompt: list = field(default_factory=list)
    params: dict = field(default_factory=dict)
    q: asyncio.Queue = field(default_factory=asyncio.Queue)
    emitted: list = field(default_factory=list)
    stash: list = field(default_factory=list)
    done: list = field(default_factory=list)
    tokens: list = field(default_factory=list)   # per choice: ids streamed so far
    epoch: int = 0                               # the current attempt's migration epoch
    generated: list = field(default_factory=list)  # tokens the current attempt starts after
    resumed: int = 0
    migration: dict | None = None
    decoded: bool = False
    finished: bool = False
    avoid: set = field(default_factory=set)      # decode workers a migration of it failed to
    resent: int = 0                              # held blocks re-sent to another decode worker
    resending: bool = False                      # a resend is being arranged (coordinator.core)
    cached_tokens: int | None = None             # prompt tokens the prefill's prefix cache supplied
    prefix_key: str = ""                         # extra key of its prefix-cache hashes (Submit.prefix_key)

    def __post_init__(self) -> None:
        self.emitted, self.stash, self.done = [0] * self.n, [{} for _ in range(self.n)], [False] * self.n
        self.tokens = [[] for _ in range(self.n)]

    def place(self, i: int, start: int, toks: list[int], finish, logprobs: list = ()) -> None:
        """Tokens of choice i from output position `start`: queue, in order, the ones not yet sent
        (a gap waits for the earlier tokens; positions already sent are dropped). logprobs, when
        given, are one per token and are cut exactly as the tokens are."""
        from coordinator.backend import TokenEvent

        if not 0 <= i < self.n or self.done[i]:
            return
        self.stash[i][start] = (toks, finish, logprobs)
        while self.stash[i]:
            s = min(self.stash[i])
            if s > self.emitted[i]:
                return
            toks, finish, logprobs = self.stash[i].pop(s)
            new, new_logprobs = toks[self.emitted[i] - s:], tuple(logprobs[self.emitted[i] - s:])
            self.emitted[i] += len(new)
            self.tokens[i] += new
            if new or finish:
                self.q.put_nowait(TokenEvent(i, tuple(new), finish, new_logprobs))
            if finish:
                self.done[i] = True
                self.stash[i].clear()


async def call(ref, timeout: float):
    """Await a Ray object ref, at most `timeout` seconds."""
    return await bounded(asyncio.wrap_future(ref.future()), timeout)


async def command(worker: WorkerState, cmd, timeout: float):
    """Send a typed command to a worker and return its typed reply (bounded). Raises
    CommandEncodeError, before sending anything, when the command cannot be encoded."""
    data = encode_command(cmd)
    return decode(await call(worker.handle.command.remote(data), timeout))


def tell(worker: WorkerState, cmd) -> None:
    """Send a typed command without waiting (its reply, or the worker's death, is ignored)."""
    worker.handle.command.remote(encode(cmd))


def spawn_workers(c, events_address: str, namespace: str, kv_host: str = "127.0.0.1",
                  published: dict | None = None, keys=None) -> dict[str, WorkerState]:
    """Create the worker actors of ClusterConfig `c` (not yet started: `Describe` waits for that).
    kv_host: '127.0.0.1', or 'node' for decode workers to bind their node's own address.
    published: model path -> its copy in the object store (runtime.model_store.publish).
    keys: the cluster's protocol.curve.ClusterKeys (None: an unsecured cluster)."""
    roles = [("colocated", c.colocated)] if c.colocated else [("prefill", c.prefill), ("decode", c.decode)]
    out: dict[str, WorkerState] = {}
    for role, count in roles:
        for i in range(count):
            worker = spawn_worker(c, role, f"{role}-{i}", events_address, namespace, kv_host=kv_host,
                                  published=published, keys=keys)
            out[worker.name] = worker
    return out


def worker_threads(c) -> int:
    """Threads a worker computes on: ClusterConfig.torch_threads, or (0) the whole Ray CPUs it
    reserves, at least 1."""
    return c.torch_threads if c.torch_threads > 0 else max(1, int(c.actor_cpus))


def worker_cpu(c, slot: str) -> int | None:
    """The CPU ClusterConfig.pin_cpus gives the worker of `slot` ("decode-0"): the slots in spawn
    order (prefill then decode, or colocated) take the listed CPUs in turn; None when unpinned."""
    if not c.pin_cpus:
        return None
    roles = [("colocated", c.colocated)] if c.colocated else [("prefill", c.prefill), ("decode", c.decode)]
    slots = [f"{role}-{i}" for role, n in roles for i in range(n)]
    return c.pin_cpus[slots.index(slot) % len(c.pin_cpus)] if slot in slots else None


def transport_options(c, namespace: str) -> dict:
    """The cluster's settings its transport takes (`transfer.registry`: each transport's options
    dataclass names its own; ZeroMQ's receiver ports, Ray's namespace), as the workers' configs carry
    them."""
    from transfer.registry import get as get_transport

    offered = {"kv_port_min": c.kv_port_min, "kv_port_max": c.kv_port_max, "namespace": namespace}
    return get_transport(c.transport).pick_options(offered)


def spawn_worker(c, role: str, slot: str, events_address: str, namespace: str, generation: int = 0,
                 kv_host: str = "127.0.0.1", published: dict | None = None, keys=None) -> WorkerState:
    """One worker actor of `role` for slot `slot` ("decode-0"); a replacement (generation g > 0)
    is named "<slot>-r<g>" so nothing of the dead one can be mistaken for it."""
    import ray

    from colocated_worker.worker import ColocatedWorker
    from decode_worker.worker import DecodeWorker
    from prefill_worker.worker import PrefillWorker

    name = slot if generation == 0 else f"{slot}-r{generation}"
    engine = {"model": c.model, "num_blocks": c.num_blocks, **c.engine, "block_size": c.block_size}
    engine["scheduler"] = {"step_target_s": c.step_target_s, **engine.get("scheduler", {})}
    config = {"name": name, "events_address": events_address, "heartbeat_s": c.report_s,
              "torch_threads": worker_threads(c), "niceness": c.worker_niceness, "cpu": worker_cpu(c, slot)}
    resources = {}
    if role == "prefill":
        config.update(transport=c.transport, transport_options=transport_options(c, namespace),
                      stream_migration=c.stream_migration,
                      transfer_timeout_s=max(1.0, 0.6 * c.heartbeat_timeout_s),
                      hold_s=c.reserve_wait_s + 2 * c.call_timeout_s)  # outlives a resend's reserve
        resources = c.prefill_resources
    elif role == "decode":
        engine.update(model=c.decode_model or c.model, block_size=c.decode_block_size or c.block_size,
                      num_blocks=c.decode_num_blocks or c.num_blocks)
        config.update(transport=c.transport, kv_host=kv_host, reserve_ttl_s=c.event_timeout_s,
                      transport_options=transport_options(c, namespace))
        resources = c.decode_resources
    config["engine"] = engine
    config.update(model_files=(published or {}).get(engine["model"]),
                  fetch_model=c.model_distribution == "always", cluster_keys=keys.to_dict() if keys else None)
    actor = {"colocated": ColocatedWorker, "prefill": PrefillWorker, "decode": DecodeWorker}[role]
    gpus = c.gpus_per_worker if str(engine.get("device", "cpu")).startswith("cuda") else 0
    handle = ray.remote(actor).options(name=name, namespace=namespace, num_cpus=c.actor_cpus, num_gpus=gpus,
                                       resources=dict(resources), max_restarts=0).remote(config)
    return WorkerState(name, role, handle, slot=slot, generation=generation)
