"""The worker protocol: typed commands (coordinator -> worker) and events (worker -> coordinator).

Commands travel as `protocol.codec` bytes through one Ray actor method, `WorkerActor.command`,
which answers with a `Reply` (or a typed reply such as `WorkerInfo`). Events travel in one
`WorkerReport` per worker loop iteration over a ZeroMQ PUSH queue: the worker's stats, the
blocks it holds per request (the ledger reconciles against them), and that iteration's events.
Every field has a full-word name; every message is a frozen dataclass.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol.codec import message
from protocol.sampling import MAX_LOGPROBS, SamplingParams

# ---- commands ---------------------------------------------------------------------------------


@message
@dataclass(frozen=True)
class Submit:
    """Run a request. Prefill workers also get the decode worker its KV goes to (name, KV address)
    and the migration epoch; colocated workers leave those empty. generated: output tokens already
    streamed (a resume after a decode worker was lost; n=1): prefilled with the prompt.
    prefix_key: the extra key of the request's prefix-cache hashes (protocol.prefix_hash.salt_key
    of the client's cache_salt; '' none): only requests with the same key share cached blocks."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    decode_worker: str = ""
    decode_address: str = ""
    epoch: int = 0
    generated: list[int] = field(default_factory=list)
    prefix_key: str = ""


@message
@dataclass(frozen=True)
class Abort:
    """Drop a request (its sequences, held blocks, credit); idempotent."""

    request_id: str


@message
@dataclass(frozen=True)
class Reserve:
    """Decode workers: admit a coming migration of n sequences of num_tokens tokens from `sender`
    under `epoch` (credit-based backpressure; also the receiver's admission)."""

    request_id: str
    epoch: int
    num_tokens: int
    n: int = 1
    sender: str = ""

    def __post_init__(self) -> None:
        if self.num_tokens < 1 or self.n < 1:
            raise ValueError(f"reserve needs num_tokens >= 1 and n >= 1, got {self.num_tokens}, {self.n}")


@message
@dataclass(frozen=True)
class Resend:
    """Prefill workers: migrate a held request's blocks to another decode worker under `epoch`."""

    request_id: str
    decode_worker: str
    decode_address: str
    epoch: int


@message
@dataclass(frozen=True)
class DropHeld:
    """Prefill workers: release a request held from the migration of `epoch` (a stale attempt)."""

    request_id: str
    epoch: int


@message
@dataclass(frozen=True)
class Connect:
    """Prefill workers: handshake with a decode worker now (layouts compared)."""

    decode_worker: str
    decode_address: str


@message
@dataclass(frozen=True)
class Describe:
    """Ask a worker for its `WorkerInfo`."""


# Faults a prefill worker's senders can inject into its next transfers (transfer.faults applies them).
TRANSFER_FAULTS = ("drop_control", "dup_control", "delay_control", "drop_data", "dup_data", "delay_data",
                   "reorder_data", "flip_payload", "flip_manifest")


@message
@dataclass(frozen=True)
class InjectFault:
    """Tests and the chaos benchmark. 'hang' wedges the loop thread (no steps, no imports, no
    reports) until shutdown; a kind in TRANSFER_FAULTS (prefill workers only) hits each of the
    worker's next `count` migrations with that fault."""

    kind: str
    count: int = 1

    def __post_init__(self) -> None:
        if self.kind != "hang" and self.kind not in TRANSFER_FAULTS:
            raise ValueError(f"unknown fault {self.kind!r}")
        if not 1 <= self.count <= 10_000:
            raise ValueError(f"fault count {self.count} is outside 1..10000")


# ---- replies ----------------------------------------------------------------------------------


@message
@dataclass(frozen=True)
class Reply:
    """The answer to a command: `error` is '' on success; `granted` answers a `Reserve`."""

    error: str = ""
    granted: bool = False


@message
@dataclass(frozen=True)
class WorkerInfo:
    """What a worker is: its role, KV address (decode workers), layout fingerprint, and the model
    facts the coordinator needs without loading it (context length, vocabulary, special ids)."""

    name: str
    role: str
    address: str
    fingerprint: dict[str, int | str]
    block_size: int
    model: str
    max_context: int
    vocab_size: int
    bos_token_id: int | None
    eos_token_ids: list[int]
    device: str = "cpu"          # the engine's device (a GPU Ray assigned shows as cuda:0 in the actor)
    node_id: str = ""            # the Ray node it runs on ('' outside Ray)
    node_address: str = ""
    pid: int = 0
    model_source: str = "local"  # where its weights came from: local, object_store or node_cache
    threads: int = 1             # the intra-op threads its engine computes on (torch and CPU kernels)
    niceness: int = 0            # its process's nice value (runtime.priority; Ray starts workers at 15)
    cpus: list[int] = field(default_factory=list)  # the CPUs its threads may run on ([]: not known)
    # engine.warmup.startup_profile's timings at start (prefill_ms_per_token, decode_step_ms...; {}: none)
    startup: dict = field(default_factory=dict)
    weights: str = "f32"         # what its engine computes in (engine.weight_format.computed_in)


# ---- events -----------------------------------------------------------------------------------


@message
@dataclass(frozen=True)
class TokenLogprobs:
    """One sampled token's log-probability and its top alternatives (ids and log-probabilities,
    most likely first; at most protocol.sampling.MAX_LOGPROBS)."""

    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]

    def __post_init__(self) -> None:
        if len(self.top_ids) != len(self.top_logprobs) or len(self.top_ids) > MAX_LOGPROBS:
            raise ValueError(f"top logprobs: {len(self.top_ids)} ids, {len(self.top_logprobs)} values, "
                             f"at most {MAX_LOGPROBS}")


@message
@dataclass(frozen=True)
class Tokens:
    """New tokens of choice `index`, starting at output position `start`; finish_reason set on
    the choice's last tokens, with how often the request was preempted on this worker so far.
    logprobs: one per token when the request asked for them (else empty). cached_tokens: prompt
    tokens the prefix cache supplied, on the events of the worker that ran the prefill."""

    request_id: str
    index: int
    start: int
    token_ids: list[int]
    finish_reason: str | None = None
    preemptions: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    cached_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.logprobs and len(self.logprobs) != len(self.token_ids):
            raise ValueError(f"{len(self.logprobs)} logprobs for {len(self.token_ids)} tokens")


@message
@dataclass(frozen=True)
class Migrated:
    """A prefill worker's migration of a request was acknowledged by `decode_worker`."""

    request_id: str
    decode_worker: str
    epoch: int
    milliseconds: float
    payload_bytes: int
    blocks: int
    reused_blocks: int
    sequences: int
    transport: str
    # milliseconds per phase, summed over the request's sequences: query, export, wire (sender) and
    # prepare, land, verify, commit (receiver, from its acks); keys as in transfer.transport
    phases: dict[str, float] = field(default_factory=dict)


@message
@dataclass(frozen=True)
class Imported:
    """A decode worker committed choice `index` of a request and joined it to its batch."""

    request_id: str
    index: int
    epoch: int
    blocks: int
    payload_bytes: int
    milliseconds: float


@message
@dataclass(frozen=True)
class ImportRefused:
    """A decode worker committed an import it no longer expected (aborted or stale) and freed it."""

    request_id: str
    epoch: int
    expected_epoch: int | None


@message
@dataclass(frozen=True)
class RequestFailed:
    """A request failed on this worker. kind: 'refused' (bad request), 'migration' (held: the
    prefill worker keeps the blocks for a resend), 'hold_expired'."""

    request_id: str
    epoch: int
    kind: str
    message: str
    held: bool = False


@message
@dataclass(frozen=True)
class WorkerReport:
    """One loop iteration of one worker: stats, blocks held per request, and events.

    holdings: request id -> device blocks the worker holds for it; each used block is counted
    once, under the first request (in id order) that references it, so the values add up to
    the worker's `used_blocks` unless a block leaked."""

    worker: str
    stats: dict[str, int | float | str | bool | None]
    holdings: dict[str, int]
    events: list[Tokens | Migrated | Imported | ImportRefused | RequestFailed]


@message
@dataclass(frozen=True)
class Heartbeat:
    """From a worker's heartbeat thread, not its engine loop, every heartbeat period: the process
    is alive, and how far its loop is, so a coordinator tells a long step from a wedged loop.

    busy_s: how long the loop's current iteration has been running (a long engine step, or a loop
    stuck somewhere), less the time its thread waited for a CPU (runtime.cpu_wait); step_tokens:
    tokens of the engine step in progress (0: not in a step); step_expected_s: what that step
    should take at the step rate this worker measured (0: unknown); loop_alive: False once the
    loop thread has ended."""

    worker: str
    loop_alive: bool
    busy_s: float
    step_tokens: int
    step_expected_s: float
