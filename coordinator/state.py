"""What the coordinator knows, in one object, and the actions its core asks the driver to carry out.

`ClusterState` is the one shared state of the cluster's coordinator: the workers, the requests in
flight, the ownership ledger and its reconciler, the routers, and the bookkeeping of lost,
replaced, drained and retired workers. Only the core changes it: coordinator.core (requests,
reports, failover) and coordinator.membership (the worker table). The driver (coordinator.cluster,
lifecycle, drain) reads it, and writes only what a worker says of itself when it starts (its
address, block size, description). The actions are what the core decides and
cannot do itself, because they need I/O: send a command to a worker, or start one of the driver's
asynchronous flows (rerun a prefill, re-send held blocks, dispatch again, replace a worker).
A request's own outputs (tokens, its final event, its error) go to its `RequestState.q`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from coordinator.config import ClusterConfig
from coordinator.decide import Decision
from coordinator.ledger import Ledger
from coordinator.metrics import Metrics
from coordinator.reconcile import Reconciler
from coordinator.router import Router
from coordinator.workers import ROLES_COLOCATED, ROLES_DISAGGREGATED, RequestState, WorkerState


@dataclass
class ClusterState:
    config: ClusterConfig
    metrics: Metrics
    ledger: Ledger
    reconciler: Reconciler
    routers: dict[str, Router]                     # role -> its router (one cycle per role)
    workers: dict[str, WorkerState] = field(default_factory=dict)   # the ones routing may pick
    joining: dict[str, WorkerState] = field(default_factory=dict)   # placed, not yet handshaken
    requests: dict[str, RequestState] = field(default_factory=dict)  # in flight, by id
    paths: dict[str, Decision] = field(default_factory=dict)        # request id -> where it prefills, why
    lost: set[str] = field(default_factory=set)                      # workers found not alive
    replacing: set[str] = field(default_factory=set)                 # lost workers being replaced
    restarts: dict[str, list[float]] = field(default_factory=dict)   # slot -> its recent replacements
    slot_status: dict[str, str] = field(default_factory=dict)        # slot -> why it is empty now
    draining: dict[str, float] = field(default_factory=dict)         # worker -> since when
    retired: set[str] = field(default_factory=set)                   # slots drained away (or reserved)
    scaling: bool = False                                            # a scale is under way

    @classmethod
    def create(cls, config: ClusterConfig, metrics: Metrics,
               clock: Callable[[], float] | None = None) -> ClusterState:
        """clock: what the ledger stamps its history with (wall time when not given)."""
        ledger = Ledger() if clock is None else Ledger(clock=clock)
        roles = ROLES_COLOCATED if config.colocated else ROLES_DISAGGREGATED
        reconciler = Reconciler(ledger, config.ledger_grace_s, metrics.count_discrepancy)
        return cls(config, metrics, ledger, reconciler, {role: Router(config.routing) for role in roles})

    @property
    def colocated(self) -> bool:
        return self.config.colocated > 0

    @property
    def roles(self) -> tuple[str, ...]:
        return ROLES_COLOCATED if self.colocated else ROLES_DISAGGREGATED

    def role(self, role: str) -> list[WorkerState]:
        """The workers of `role` in the table (lost ones included)."""
        return [worker for worker in self.workers.values() if worker.role == role]


# ---- actions: what the core decided and the driver carries out ---------------------------------
@dataclass(frozen=True)
class Tell:
    """Send `command` to `worker` without waiting for its reply."""

    worker: WorkerState
    command: object


@dataclass(frozen=True)
class RetryPrefill:
    """The request's prefill worker `lost` is gone before migrating: rerun it on request.prefill."""

    request: RequestState
    lost: str


@dataclass(frozen=True)
class ResendHeld:
    """A migration to decode worker `bad` failed while the prefill worker holds the blocks: reserve
    on another decode worker and have the prefill worker send them there."""

    request: RequestState
    bad: str
    why: str


@dataclass(frozen=True)
class Redispatch:
    """The request was given new workers (a resume): dispatch it again."""

    request: RequestState


@dataclass(frozen=True)
class Replace:
    """`worker` is lost: replace it after the restart backoff."""

    worker: WorkerState


Action = Tell | RetryPrefill | ResendHeld | Redispatch | Replace
