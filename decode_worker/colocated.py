"""The colocated role: one engine runs both phases and no KV moves (the baseline every
disaggregated result is compared with). It lives with the decode worker because it is a decode
worker that also prefills. `ColocatedHandler` runs on the worker runtime in a Ray actor
(`ColocatedWorker`, `pdserve up --colocated K`) and in process behind `pdserve serve`
(coordinator.backend.LocalEngineBackend).
"""

from __future__ import annotations

from protocol.messages import Abort, Reply, RequestFailed, Submit, Tokens
from runtime.actor import QUEUE, WorkerActor, WorkerConfig, refuse_submit
from runtime.holdings import blocks_by_request


class ColocatedHandler:
    def __init__(self, config: WorkerConfig, engine):
        self.config, self.engine = config, engine
        self.requests: dict = {}  # request id -> engine Request (kept until its last tokens are out)

    def accept(self, cmd):
        """Validate a Submit on the calling thread (read-only); aborts go to the loop."""
        if isinstance(cmd, Submit):
            return refuse_submit(self.engine, cmd) or QUEUE
        if isinstance(cmd, Abort):
            return QUEUE
        return Reply(error=f"a colocated worker does not take {type(cmd).__name__}")

    def handle(self, cmd, events: list):
        rid = cmd.request_id
        if isinstance(cmd, Abort):
            self.requests.pop(rid, None)
            self.engine.abort(rid)
            return None
        if rid in self.engine.requests:
            self.engine.abort(rid)  # an earlier attempt of the same request: this one supersedes it
        try:
            self.engine.add_request(list(cmd.prompt_ids), cmd.params, request_id=rid)
        except Exception as e:  # validated already; a race with the pool
            events.append(RequestFailed(rid, cmd.epoch, "refused", str(e)))
            return None
        self.requests[rid] = self.engine.requests[rid]
        return None

    def on_step(self, outputs, events: list) -> None:
        for o in outputs:
            req = self.requests.get(o.request_id)
            if req is None:
                continue
            seq = next(s for s in req.seqs if s.index == o.index)
            finish = (o.finish_reason or "stop") if o.finished else None
            start = len(seq.output_ids) - len(o.new_token_ids)
            events.append(Tokens(o.request_id, o.index, start, list(o.new_token_ids), finish,
                                 req.num_preemptions if finish else 0, [o.logprobs] if o.logprobs else [],
                                 req.cached_tokens if start == 0 else None))
        for rid in {o.request_id for o in outputs}:
            if rid not in self.engine.requests:  # retired: every choice finished
                self.requests.pop(rid, None)

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
