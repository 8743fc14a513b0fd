"""What the simulated coordinator and workers say to each other: commands (coordinator -> worker,
as Ray calls: in order, only ever late), events and periodic holdings reports (worker ->
coordinator), the shapes of `protocol.messages`' Submit, Abort, Migrated, Imported, Tokens,
RequestFailed and WorkerReport cut to what the simulation needs."""

from __future__ import annotations

from dataclasses import dataclass

COORDINATOR = "coord"  # the coordinator's node name


# ---- commands (coordinator -> worker) and events (worker -> coordinator) ------------------------------
@dataclass(frozen=True)
class Submit:
    rid: str
    prompt: tuple
    max_tokens: int
    decode: str
    epoch: int


@dataclass(frozen=True)
class Abort:
    rid: str


@dataclass(frozen=True)
class Migrated:
    rid: str
    epoch: int
    worker: str


@dataclass(frozen=True)
class MigrationFailed:
    rid: str
    epoch: int
    worker: str
    why: str


@dataclass(frozen=True)
class Imported:
    rid: str
    epoch: int
    worker: str


@dataclass(frozen=True)
class Tokens:
    rid: str
    epoch: int
    worker: str
    tokens: tuple


@dataclass(frozen=True)
class Report:
    worker: str
    role: str
    incarnation: int
    holdings: dict
    used_blocks: int
