"""The cluster's configuration: one frozen dataclass, each field documented where it is declared
(`pdserve up --config` files and `deploy/*.yaml` map onto it)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ClusterConfig:
    prefill: int = 1                  # prefill workers
    decode: int = 1                   # decode workers
    transport: str = "zmq"            # how KV moves: a name in transfer.registry (zmq, ray)
    stream_migration: bool = True     # ship a prompt's KV while it is still being prefilled
    model: str = "tiny"               # 'tiny' or a checkpoint directory
    block_size: int = 16              # KV block size (prefill workers; decode too unless decode_block_size)
    decode_block_size: int = 0        # decode workers' block size (0: block_size); migrations re-block
    num_blocks: int = 512             # KV pool size per worker, in blocks
    engine: dict = field(default_factory=dict)  # extra engine keyword arguments for every role
    # where the report socket and the KV receivers bind: 'auto' (loopback when every Ray node is on this
    # machine's address, else each node's own address as Ray reports it), 'loopback' or 'node'
    bind: str = "auto"
    event_port: int = 0               # the coordinator's report socket port (0: any free port)
    kv_port_min: int = 0              # decode workers' KV receiver ports (0: any free port), for firewalls
    kv_port_max: int = 0
    routing: str = "least_loaded"     # Router policy: round_robin, least_loaded or prefix_aware
    actor_cpus: float = 0.25          # Ray CPUs reserved per worker (fractional fits a cluster on 2 cores)
    # torch (and CPU kernel) threads per worker; 0: as many as the Ray CPUs it reserves (actor_cpus,
    # rounded down, at least 1), so workers never run more threads than the cores Ray gave them
    torch_threads: int = 0
    # the nice value each worker process sets for itself at start (runtime.priority); None: keep the
    # one Ray gave it (15 unless RAY_worker_niceness says otherwise), below the coordinator and every
    # other process on the node, which measured no worse for serving on 2 cores (docs/planner.md)
    worker_niceness: int | None = None
    # CPUs the workers are pinned to, one each in spawn order (prefill then decode, or colocated; reused
    # in turn when there are fewer CPUs than workers); (): unpinned. bench serve pins (runtime.priority)
    pin_cpus: tuple[int, ...] = ()
    start_timeout_s: float = 180.0    # bound on workers loading and handshaking
    call_timeout_s: float = 10.0      # bound on one command to a worker
    event_timeout_s: float = 60.0     # longest silence inside a request before it times out
    # a worker whose heartbeat thread is silent this long is dead (its requests move or fail with 503);
    # also the least time one loop iteration may take before it counts as wedged (coordinator.workers)
    heartbeat_timeout_s: float = 5.0
    # > 0: engines size each step's token budget to take about this long, from the steps they measured
    # (engine.step_pacer), within max_num_batched_tokens; 0: the fixed budget
    step_target_s: float = 0.25
    report_s: float = 0.2             # a worker reports at least this often
    ledger_grace_s: float = 1.0       # a ledger discrepancy older than this is counted and repaired
    monitor_s: float = 0.25           # how often liveness is checked
    name: str | None = None           # served model name (None: model)
    # Ray custom resources each worker of the role requests, to place roles on different nodes,
    # e.g. {"prefill_node": 0.01} with nodes started `--resources '{"prefill_node": 1}'`
    prefill_resources: dict = field(default_factory=dict)
    decode_resources: dict = field(default_factory=dict)
    colocated: int = 0                # > 0: this many colocated workers instead (no KV moves)
    decode_num_blocks: int = 0        # decode workers' pool size (0: num_blocks)
    reserve_wait_s: float = 30.0      # longest wait for decode room before 503 "decode workers full"
    max_waiting: int = 256            # requests waiting for decode room; beyond, 429 with Retry-After
    decode_model: str = ""            # decode workers' model ('': model); another model is refused
    gpus_per_worker: float = 1.0      # GPUs each worker asks Ray for when its engine device is cuda
    secure: bool = True               # cluster keys: CURVE on the report socket, signed KV handshakes
    # how a checkpoint path reaches the workers (runtime.model_store): 'auto' (a node without the files
    # loads the coordinator's copy from Ray's object store, once per node), 'always', or 'never'
    model_distribution: str = "auto"
    restart_backoff_s: float = 1.0    # a dead worker is replaced after this, doubled per recent restart
    # quick replacements per slot within restart_window_s; beyond, one try every restart_max_backoff_s
    # (a slot is never left empty for good); 0: never replace (the dead stay dead, for tests)
    max_restarts: int = 3
    restart_max_backoff_s: float = 30.0
    restart_window_s: float = 300.0
    # a drained worker's requests may finish there this long; then they move (coordinator.drain)
    drain_timeout_s: float = 30.0
    # per request (coordinator.decide): 'always' prefill on a prefill worker and migrate; 'never' prefill
    # on the decode worker itself; 'auto' locally when the prompt's part the decode worker does not cache
    # is at most local_prefill_max_tokens (raised while the prefill worker has a queue)
    disaggregate: str = "always"
    # auto: the crossover where prefilling on the decode worker costs it as long as receiving the KV
    # (`pdserve profile` prints it; three --quick runs here, tiny, block 16, CPU, zmq-tcp: 75, 82, 111)
    local_prefill_max_tokens: int = 80
    local_prefill_max_waiting: int = 4  # auto: a decode worker with this many requests waiting is busy
    # auto, > 0 (pdserve profile's prefill_ms_per_token): once migrations were measured, the limit is at
    # least the tokens the decode worker prefills in the mean migration time; 0: the fixed limit
    prefill_ms_per_token: float = 0.0
