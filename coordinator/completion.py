"""One admitted completion request as the HTTP layer runs it: pulls the backend's events, turns
them into per-choice deltas (text produced incrementally by coordinator.detokenize, stop strings
cutting text and token ids at the same token), and keeps its latencies for the response and the
metrics. Every wait on the backend is bounded. `ResponseFormat` says how a route writes its
choices and chunks: `TEXT` for /v1/completions here, `CHAT` in coordinator.chat.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from coordinator.backend import FinalEvent, TokenEvent
from coordinator.bounded import bounded
from coordinator.completion_request import APIError, InternalError, Timeout
from coordinator.detokenize import Detokenizer
from coordinator.logprobs import text_logprobs
from coordinator.metrics import Metrics


@dataclass
class Choice:
    detok: Detokenizer
    ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list = field(default_factory=list)  # TokenLogprobs (or None) per id, when asked
    text_offset: int = 0                           # where the next token's logprobs text starts


@dataclass
class Delta:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: dict | None = None  # this delta's tokens in the route's logprobs shape, when asked


@dataclass(frozen=True)
class ResponseFormat:
    """How one route writes its answer.

    object: the whole response's `object` field; chunk_object: each streamed chunk's.
    choice(index, text, token_ids, finish_reason, logprobs) -> one choice of the whole response.
    chunk_choice(index, text, token_ids, finish_reason, first, logprobs) -> one streamed choice;
        `first` is true on the first chunk of that choice.
    logprobs(tokenizer, token_ids, entries, offset) -> (logprobs object, offset after them)
        (coordinator.logprobs).
    """

    object: str
    chunk_object: str
    choice: Callable[[int, str, list[int], str | None, dict | None], dict]
    chunk_choice: Callable[[int, str, list[int], str | None, bool, dict | None], dict]
    logprobs: Callable[[object, list[int], list, int], tuple[dict, int]] = text_logprobs


def _text_choice(index: int, text: str, token_ids: list[int], finish_reason: str | None,
                 logprobs: dict | None = None) -> dict:
    return {"index": index, "text": text, "token_ids": token_ids, "logprobs": logprobs,
            "finish_reason": finish_reason}


def _text_chunk_choice(index: int, text: str, token_ids: list[int], finish_reason: str | None,
                       first: bool, logprobs: dict | None = None) -> dict:
    return _text_choice(index, text, token_ids, finish_reason, logprobs)


TEXT = ResponseFormat(object="text_completion", chunk_object="text_completion", choice=_text_choice,
                      chunk_choice=_text_chunk_choice)


def system_fingerprint(weights: str) -> str:
    """A response's OpenAI `system_fingerprint`: which weight format computed it ('pdserve-bf16')."""
    return f"pdserve-{weights}"


class CompletionRun:
    """One admitted request: pulls backend events, turns them into per-choice deltas, keeps time."""

    def __init__(self, backend, config, metrics: Metrics, creq, shape: ResponseFormat = TEXT):
        self.backend, self.cfg, self.metrics = backend, config, metrics
        self.creq, self.shape = creq, shape
        self.t0 = time.monotonic()
        self.t_first: float | None = None
        tokenizer = self.backend.tokenizer
        self.choices = [Choice(Detokenizer(tokenizer, creq.stop, creq.min_tokens)) for _ in range(creq.n)]
        self.final: FinalEvent | None = None
        self.error: APIError | None = None  # a failure already reported inside a started stream

    async def deltas(self):
        gen = self.backend.submit(self.creq)
        async with contextlib.aclosing(gen):
            while any(c.finish_reason is None for c in self.choices):
                event = await self._next(gen, self.cfg.stall_timeout_s)
                if event is None:
                    raise InternalError("the backend ended the request before every choice finished")
                if isinstance(event, FinalEvent):
                    self.final = event
                elif isinstance(event, TokenEvent) and 0 <= event.index < len(self.choices):
                    delta = self._apply(event)
                    if delta is not None:
                        yield delta
            if self.final is None:  # normally already queued right behind the last token
                with contextlib.suppress(Timeout, StopAsyncIteration):
                    event = await self._next(gen, self.cfg.final_event_timeout_s)
                    self.final = event if isinstance(event, FinalEvent) else None

    async def _next(self, gen, timeout: float):
        try:
            return await bounded(gen.__anext__(), timeout)
        except StopAsyncIteration:
            return None
        except asyncio.TimeoutError:
            raise Timeout(f"the backend sent nothing for {timeout:g}s") from None

    def _apply(self, event: TokenEvent) -> Delta | None:
        c = self.choices[event.index]
        if c.finish_reason is not None:
            return None  # this choice already ended here (stop string seen before the backend saw it)
        if self.t_first is None:
            self.t_first = time.monotonic()
            self.metrics.first_token(self.t_first - self.t0)
        taken = c.detok.push(event.token_ids)
        new_ids = list(event.token_ids[:taken])
        c.ids += new_ids
        logprobs = None
        if self.creq.logprobs is not None:  # one entry per id, cut where the ids are cut
            entries = list(event.logprobs[:taken]) + [None] * (taken - len(event.logprobs[:taken]))
            c.logprobs += entries
            logprobs, c.text_offset = self.shape.logprobs(self.backend.tokenizer, new_ids, entries,
                                                          c.text_offset)
        if c.detok.stopped:
            c.finish_reason = "stop"
        elif event.finish_reason is not None:
            c.finish_reason = event.finish_reason
            c.detok.finish()
        text = c.detok.take(final=c.finish_reason is not None)
        if not text and not new_ids and c.finish_reason is None:
            return None
        return Delta(event.index, text, new_ids, c.finish_reason, logprobs)

    def choice_logprobs(self, i: int) -> dict | None:
        """Choice i's logprobs object for the whole response (None unless asked)."""
        if self.creq.logprobs is None:
            return None
        c = self.choices[i]
        return self.shape.logprobs(self.backend.tokenizer, c.ids, c.logprobs, 0)[0]

    def system_fingerprint(self) -> str:
        return system_fingerprint(self.backend.weights)

    def usage(self) -> dict:
        completion = sum(len(c.ids) for c in self.choices)
        prompt = len(self.creq.prompt_ids)
        usage = {"prompt_tokens": prompt, "completion_tokens": completion,
                 "total_tokens": prompt + completion}
        if self.final is not None:  # known once the backend is done
            usage["prompt_tokens_details"] = {"cached_tokens": self.final.cached_tokens}
        return usage

    def timing(self) -> dict:
        """Latencies (ms) plus the backend's info, for the response's `pdserve` extension."""
        now = time.monotonic()
        out = {"e2e_ms": round((now - self.t0) * 1000, 3)}
        if self.t_first is not None:
            out["ttft_ms"] = round((self.t_first - self.t0) * 1000, 3)
            longest = max(len(c.ids) for c in self.choices)
            if longest > 1:
                out["tpot_ms"] = round((now - self.t_first) * 1000 / (longest - 1), 3)
        out["backend"] = self.final.info if self.final is not None else {}
        if self.final is not None:  # prompt tokens the prefix cache gave (as usage's cached_tokens)
            out["cached_tokens"] = self.final.cached_tokens
        return out

    def record(self, status: str) -> None:
        t = self.timing()
        tpot = t.get("tpot_ms")
        self.metrics.request_done(status, started=self.t_first is not None, e2e_s=t["e2e_ms"] / 1000,
                                  tpot_s=None if tpot is None else tpot / 1000,
                                  completion_tokens=self.usage()["completion_tokens"])
