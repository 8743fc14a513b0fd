"""The prefill worker's Ray actor: the worker runtime with the prefill role handler
(prefill_worker.handler). The coordinator drives it with typed commands through
`WorkerActor.command`; tokens, migrations and failures reach it in `WorkerReport`s.
"""

from __future__ import annotations

from prefill_worker.handler import PrefillHandler, PrefillWorkerConfig
from runtime.actor import WorkerActor
from transfer.registry import get as get_transport


class PrefillWorker(WorkerActor):
    """Actor body: `ray.remote(PrefillWorker).options(name=...).remote(config_dict)`."""

    role = "prefill"
    config_class = PrefillWorkerConfig

    def make_handler(self, config, engine):
        return PrefillHandler(config, engine)

    def engine_options(self) -> dict:
        # e.g. the Ray transport reads a same-node migration straight from a /dev/shm pool (transfer.pull)
        return dict(get_transport(self.config.transport).engine_options)
