"""The single-process engine: continuous batching over the paged KV cache.

`LLMEngine.step()` asks the scheduler for this step's sequences, runs one packed (varlen)
forward over prefill chunks and decode tokens together, samples, and reports new tokens per
sequence. The same engine serves three roles: `colocated` (both phases, the baseline),
`prefill` (stop after the first token and hold the blocks for export) and `decode` (take
requests whose KV was imported and keep generating). Nothing here knows about transports, Ray
or HTTP.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

import torch

from engine.attention import get_backend
from engine.attn_metadata import AttentionMetadata
from engine.beam import beam_step, best_hypotheses
from engine.identity import model_identity
from engine.sampling import SamplingParams, StopChecker, cut_at_stop, sample_token
from engine.scheduler import Schedule, Scheduler, SchedulerConfig
from engine.sequence import Request, Sequence, Status, StepOutput
from kvcache import BlockAllocator, KVCacheManager, KVStorage

ROLES = ("colocated", "prefill", "decode")


class RequestError(ValueError):
    """A request the engine cannot run (bad prompt, ids outside the vocabulary, too long)."""


@dataclass(frozen=True)
class EngineConfig:
    model: str = "tiny"              # 'tiny' or a Hugging Face checkpoint directory
    device: str = "cpu"              # 'cpu' or 'cuda[:i]'
    dtype: str | None = None         # None picks float32 on CPU, bfloat16 on CUDA
    block_size: int = 16             # token slots per KV block
    num_blocks: int = 512            # device pool size in blocks
    num_host_blocks: int = 256       # host swap pool in blocks (0 disables swap preemption)
    enable_prefix_caching: bool = True  # reuse full blocks of prompts seen before
    attention_backend: str = "auto"  # 'auto', 'torch' or 'triton'
    role: str = "colocated"          # 'colocated', 'prefill' or 'decode'
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)  # batching limits

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")


@dataclass
class Completion:
    """A finished request as `generate` returns it (the HTTP body's `choices`)."""

    request_id: str
    prompt_ids: list[int]
    choices: list[dict]


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded=None):
        """`loaded` = (model, model_config, tokenizer) to share one model between engines."""
        from engine.loader import load_model

        self.config = config
        self.device = torch.device(config.device)
        self.backend = get_backend(config.attention_backend, self.device)
        if loaded is None:
            loaded = load_model(config.model, device=config.device, dtype=config.dtype, backend=self.backend)
        self.model, self.model_config, self.tokenizer = loaded
        self.model_id = model_identity(self.model_config, self.model)
        layout = self.model_config.kv_layout(config.block_size, _dtype_name(self.model), self.model_id)
        self.storage = KVStorage(layout, config.num_blocks, device=self.device)
        host = None
        if config.num_host_blocks > 0:
            host = KVStorage(layout, config.num_host_blocks, device="cpu",
                             pin_memory=self.device.type == "cuda")
        self.kv = KVCacheManager(BlockAllocator(config.num_blocks), config.block_size, self.storage,
                                 config.enable_prefix_caching, host)
        self.scheduler = Scheduler(config.scheduler, self.kv)
        self.requests: dict[str, Request] = {}
        self.prefilled: dict[str, Request] = {}  # prefill role: first token out, blocks held
        self.steps = 0

    # ---- requests -----------------------------------------------------------------------
    def validate_prompt(self, prompt_ids: list[int], params: SamplingParams) -> None:
        vocab = self.model_config.vocab_size
        if not prompt_ids:
            raise RequestError("prompt is empty")
        bad = [t for t in prompt_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise RequestError(f"prompt token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        limit = self.model_config.max_position_embeddings
        if len(prompt_ids) + params.max_tokens > limit:
            raise RequestError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) "
                               f"exceeds the model's context of {limit} tokens")
        width = max(params.n, params.beam_width)
        need = width * (-(-(len(prompt_ids) + params.max_tokens) // self.config.block_size))
        if need > self.config.num_blocks:
            raise RequestError(f"request needs up to {need} KV blocks; the pool has {self.config.num_blocks}")
        if self.config.role != "colocated" and params.beam_width > 1:
            raise RequestError("beam search runs on colocated engines only")

    def add_request(self, prompt_ids: list[int], params: SamplingParams,
                    request_id: str | None = None) -> str:
        self.validate_prompt(prompt_ids, params)
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.requests:
            raise RequestError(f"duplicate request id {request_id!r}")
        params = params.with_seed()
        req = Request(request_id, list(prompt_ids), params, self._stop_checker(params), time.monotonic(),
                      seqs=[Sequence(0, list(prompt_ids))])
        self.requests[request_id] = req
        self.scheduler.add(req)
        return request_id

    def add_imported(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                     seqs: list[Sequence]) -> None:
        """Decode role: sequences whose prompt KV is already adopted by `self.kv` under their seq_id."""
        req = Request(request_id, list(prompt_ids), params, self._stop_checker(params), time.monotonic(),
                      seqs=seqs, forked=True)
        self.requests[request_id] = req
        self.scheduler.add_running(req)

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is; every block it holds goes back. False if unknown."""
        req = self.requests.pop(request_id, None) or self.prefilled.pop(request_id, None)
        if req is None:
            return False
        self.scheduler.remove(req)
        self._free_seqs(req)
        self.prefilled.pop(request_id, None)
        req.status = Status.FINISHED
        return True

    def release_prefilled(self, request_id: str) -> None:
        """Prefill role: the decode side holds the KV now; free ours (full blocks stay cached)."""
        req = self.prefilled.pop(request_id)
        self._free_seqs(req)

    def has_work(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # ---- the step -----------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        plan = self.scheduler.schedule()
        if plan.empty:
            return []
        self.steps += 1
        rows = self._forward(plan)
        outputs: list[StepOutput] = []
        by_req: dict[str, list[Sequence]] = {}
        for req, seq in plan.prefill + plan.decode:
            by_req.setdefault(req.request_id, []).append(seq)
        for rid in by_req:
            req = self.requests[rid]
            if req.first_token_time is None:
                req.first_token_time = time.monotonic()
            if req.is_beam:
                beam_step(req, rows, self.kv)
                if not req.seqs:
                    outputs += self._finish_beam(req)
            else:
                outputs += self._sample_request(req, rows)
        return outputs

    def _forward(self, plan: Schedule) -> dict[int, torch.Tensor]:
        """One packed forward; returns the last-position logits (V,) of each scheduled sequence."""
        tables, seq_lens, q_lens, ids, pos, order = [], [], [], [], [], []
        for _, s in plan.prefill + plan.decode:
            t = self.kv.table(s.seq_id)
            start, end = t.num_computed, t.num_tokens
            tables.append(t.blocks)
            seq_lens.append(end)
            q_lens.append(end - start)
            ids += t.token_ids[start:end]
            pos += range(start, end)
            order.append(s.seq_id)
        meta = AttentionMetadata.build(tables, seq_lens, q_lens, self.config.block_size, self.device)
        with torch.inference_mode():
            hidden = self.model.forward(torch.tensor(ids, device=self.device),  # (T, hidden)
                                        torch.tensor(pos, device=self.device), self.storage, meta)
            last = meta.query_start_loc[1:].long() - 1  # (S,)
            logits = self.model.compute_logits(hidden[last]).float()  # (S, V)
        for sid, n in zip(order, seq_lens):
            self.kv.mark_computed(sid, n)
        return dict(zip(order, logits))

    def _sample_request(self, req: Request, rows: dict[int, torch.Tensor]) -> list[StepOutput]:
        p = req.params
        if not req.forked:
            parent = req.seqs[0]
            row = rows[parent.seq_id]
            for i in range(1, req.width):
                child = Sequence(i, list(parent.prompt_ids), list(parent.output_ids))
                self.kv.fork(parent.seq_id, child.seq_id)
                req.seqs.append(child)
                rows[child.seq_id] = row
            req.forked = True
        outs = []
        for s in req.live_seqs:
            if s.seq_id not in rows:
                continue
            tok = sample_token(rows[s.seq_id], p, s.index, len(s.output_ids))
            s.output_ids.append(tok)
            text = self._text(s) if p.stop else None
            s.finish_reason = req.stop.check(s.output_ids, text)
            if s.finish_reason is not None:
                self.kv.free(s.seq_id)
            outs.append(StepOutput(req.request_id, s.index, [tok], s.finished, s.finish_reason))
        if all(s.finished for s in req.seqs):
            self._retire(req)
        elif self.config.role == "prefill":
            self._retire(req, keep_blocks=True)
        return outs

    def _finish_beam(self, req: Request) -> list[StepOutput]:
        req.seqs = best_hypotheses(req)
        self._retire(req)
        return [StepOutput(req.request_id, s.index, list(s.output_ids), True, s.finish_reason)
                for s in req.seqs]

    def _retire(self, req: Request, keep_blocks: bool = False) -> None:
        self.scheduler.remove(req)
        self.requests.pop(req.request_id, None)
        if keep_blocks:
            req.status = Status.WAITING
            self.prefilled[req.request_id] = req
        else:
            req.status = Status.FINISHED
            self._free_seqs(req)

    def _free_seqs(self, req: Request) -> None:
        for s in req.seqs:
            if s.seq_id in self.kv.tables:
                self.kv.free(s.seq_id)

    # ---- text ---------------------------------------------------------------------------
    def _stop_checker(self, params: SamplingParams) -> StopChecker:
        return StopChecker(params, tuple(getattr(self.tokenizer, "eos_token_ids", ()) or ()))

    def _text(self, s: Sequence) -> str:
        return self.tokenizer.decode(s.output_ids) if self.tokenizer is not None else ""

    def choice(self, s: Sequence, params: SamplingParams) -> dict:
        """One OpenAI-style choice for a finished sequence (text cut at a stop string)."""
        text = self._text(s)
        if params.stop:
            text = cut_at_stop(text, params.stop)
        return {"index": s.index, "text": text, "token_ids": list(s.output_ids),
                "finish_reason": s.finish_reason}

    # ---- convenience --------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 max_steps: int = 1_000_000) -> list[Completion]:
        """Run prompts to completion (colocated role); results in prompt order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        reqs = {self.add_request(p, sp): (p, sp) for p, sp in zip(prompts, plist)}
        live = {rid: self.requests[rid] for rid in reqs}
        for _ in range(max_steps):
            if not self.has_work():
                break
            self.step()
        else:
            raise RuntimeError(f"generate did not finish within {max_steps} steps")
        out = []
        for rid, (p, _) in reqs.items():
            req = live[rid]
            choices = [self.choice(s, req.params) for s in sorted(req.seqs, key=lambda s: s.index)]
            out.append(Completion(rid, p, choices))
        return out


def _dtype_name(model: torch.nn.Module) -> str:
    dt = next(model.parameters()).dtype
    return {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}[dt]
