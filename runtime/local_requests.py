"""Requests run whole on one engine, no migration: a colocated worker's, and on a decode worker
the requests the coordinator's per-request policy (coordinator.decide) sends here whole, as a
`Submit` without a decode worker, instead of through a prefill worker and a migration. The decode
engine already runs chunked prefill with prefix caching (it is the colocated engine with the
decode role), so such a request only joins its scheduler: its prefill chunks share steps with the
running decodes, the prompt's full blocks stay in this worker's prefix cache (as imported ones
do), and tokens stream exactly as a colocated worker's do (same seed, same sampler: the same
tokens). It runs as engine request "<request id>/local", beside the imports'
"<request id>/<choice>", so the decode handler's holdings map it back to its request like an import.
"""

from __future__ import annotations

from protocol.messages import Reply, RequestFailed, Submit, Tokens
from runtime.actor import QUEUE, refuse_submit

SUFFIX = "/local"


class LocalRequests:
    """suffix: appended to the request id to name its engine request (the colocated worker: none)."""

    def __init__(self, engine, suffix: str = SUFFIX):
        self.engine, self.suffix = engine, suffix
        self.requests: dict[str, tuple[str, object]] = {}  # engine request id -> (request id, engine Request)
        self.submitted = 0

    def accept(self, cmd: Submit):
        """On the calling thread (read-only): a Reply naming the refusal, or QUEUE."""
        if cmd.decode_worker or cmd.generated:
            return Reply(error="a decode worker prefills only whole requests addressed to itself")
        return refuse_submit(self.engine, cmd) or QUEUE

    def submit(self, cmd: Submit, events: list) -> None:
        key = cmd.request_id + self.suffix
        if key in self.engine.requests:
            self.engine.abort(key)  # an earlier attempt of the same request: this one supersedes it
        try:
            self.engine.add_request(list(cmd.prompt_ids), cmd.params, request_id=key,
                                    prefix_key=cmd.prefix_key)
        except Exception as e:  # validated already; a race with the pool
            events.append(RequestFailed(cmd.request_id, cmd.epoch, "refused", str(e)))
            return
        self.requests[key] = (cmd.request_id, self.engine.requests[key])
        self.submitted += 1

    def abort(self, rid: str) -> None:
        key = rid + self.suffix
        if self.requests.pop(key, None) is not None or key in self.engine.requests:
            self.engine.abort(key)

    def on_step(self, outputs, events: list) -> None:
        for o in outputs:
            entry = self.requests.get(o.request_id)
            if entry is None:
                continue
            rid, req = entry
            seq = next(s for s in req.seqs if s.index == o.index)
            finish = (o.finish_reason or "stop") if o.finished else None
            start = len(seq.output_ids) - len(o.new_token_ids)
            events.append(Tokens(rid, o.index, start, list(o.new_token_ids), finish,
                                 req.num_preemptions if finish else 0, [o.logprobs] if o.logprobs else [],
                                 req.cached_tokens if start == 0 else None))
        for key in {o.request_id for o in outputs}:
            if key in self.requests and key not in self.engine.requests:  # retired: every choice finished
                self.requests.pop(key, None)
