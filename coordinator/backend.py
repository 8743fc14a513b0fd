"""What the HTTP layer needs from whatever runs the model, and the events it yields.

The contract is duck-typed (no base class; both implementations named below have these
methods and attributes):

    tokenizer                     encode(text) -> list[int], decode(ids) -> str
    max_context: int              prompt + max_tokens may not exceed it
    vocab_size: int               prompt ids must be below it
    async def submit(creq)        an async iterator of events for one CompletionRequest (its
                                  prompt_ids filled): TokenEvent(index, token_ids,
                                  finish_reason, logprobs) per choice and batch, finish_reason
                                  set on each choice's last one, then one
                                  FinalEvent(prompt_tokens, info, cached_tokens). It raises
                                  protocol.APIError subclasses (InvalidRequest,
                                  ServiceUnavailable("no live prefill worker"), ...), before
                                  the first event where it can. Closing the iterator early
                                  (client gone, stop string found upstream) must abort the
                                  request and free its blocks everywhere.
    async def abort(request_id)   abort a request by id (idempotent)
    def model_names() -> list[str]    served names; the first is the default
    def info() -> dict            the /v1/cluster body (workers, ledger, ...)
    def health() -> (bool, str)   liveness and a one-line reason
    def metrics_text() -> str     extra Prometheus text (e.g. metrics.worker_metrics_text)

It has two implementations: the Ray cluster (coordinator.cluster.ClusterBackend) and one engine
in process (deploy.in_process.LocalEngineBackend, behind `pdserve serve`), which lives above the
coordinator because it loads the engine.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TokenEvent:
    """New tokens of choice `index`; finish_reason ('stop', 'length') on its last event."""

    index: int
    token_ids: tuple[int, ...]
    finish_reason: str | None = None
    logprobs: tuple = ()  # protocol.messages.TokenLogprobs per token, when the request asked


@dataclass(frozen=True)
class FinalEvent:
    """The request is done on the backend. info: backend facts for the client (worker,
    preemptions, migration...), JSON-safe. cached_tokens: prompt tokens the prefix cache gave."""

    prompt_tokens: int
    info: dict
    cached_tokens: int = 0
