"""The colocated role: one engine runs both phases and no KV moves (the baseline every
disaggregated result is compared with). Its requests run whole on its engine through
runtime.local_requests, as a decode worker's locally prefilled ones do. `ColocatedHandler`
runs on the worker runtime in a Ray actor
(`ColocatedWorker`, `pdserve up --colocated K`) and in process behind `pdserve serve`
(deploy.in_process.LocalEngineBackend).
"""

from __future__ import annotations

from protocol.messages import Abort, Reply, Submit
from runtime.actor import QUEUE, WorkerActor, WorkerConfig, refuse_submit
from runtime.holdings import blocks_by_request
from runtime.local_requests import LocalRequests


class ColocatedHandler:
    def __init__(self, config: WorkerConfig, engine):
        self.config, self.engine = config, engine
        self.local = LocalRequests(engine, suffix="")  # every request runs under its own id

    def accept(self, cmd):
        """Validate a Submit on the calling thread (read-only); aborts go to the loop."""
        if isinstance(cmd, Submit):
            return refuse_submit(self.engine, cmd) or QUEUE
        if isinstance(cmd, Abort):
            return QUEUE
        return Reply(error=f"a colocated worker does not take {type(cmd).__name__}")

    def handle(self, cmd, events: list):
        if isinstance(cmd, Abort):
            self.local.abort(cmd.request_id)
        else:  # an earlier attempt of the same request is superseded
            self.local.submit(cmd, events)

    def on_step(self, outputs, events: list) -> None:
        self.local.on_step(outputs, events)

    def stats(self) -> dict:
        return {"prefix_hit_tokens": self.engine.kv.prefix_hit_tokens}

    def holdings(self) -> dict[str, int]:
        return blocks_by_request(self.engine, self.engine.requests)


class ColocatedWorker(WorkerActor):
    """Actor body: `ray.remote(ColocatedWorker).options(name=...).remote(config_dict)`."""

    role = "colocated"
    config_class = WorkerConfig

    def make_handler(self, config, engine):
        return ColocatedHandler(config, engine)
