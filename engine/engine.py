"""The single-process engine: continuous batching over the paged KV cache.

`LLMEngine.step()` asks the scheduler for this step's tokens (one per decoding sequence, plus
prefill chunks within the token budget), runs one packed (varlen) forward with the decode rows
first, computes logits only for sequences whose every token is now computed (the last layer runs
past its attention for their rows alone), samples all of them at once, and reports new tokens
per sequence. The same engine serves three roles: `colocated` (both phases, the baseline),
`prefill` (stop after the first token and hold the blocks for export; `computed_blocks` tells,
step by step, which blocks a long prompt has finished) and `decode` (take requests whose KV was
imported and keep generating). On CUDA with the Triton backend, decode steps replay CUDA graphs
(engine.cuda_graphs). Nothing here knows about transports, Ray or HTTP.
"""

from __future__ import annotations

import time
import uuid

import torch

from engine import cpu_attention, weight_format
from engine.attention import get_backend
from engine.attn_metadata import AttentionMetadata
from engine.attn_torch import Workspace
from engine.beam import beam_step, best_hypotheses
from engine.cuda_graphs import DecodeGraphs
from engine.engine_config import Completion, EngineConfig
from engine.identity import model_identity
from engine.logprobs import sample_rows
from engine.requests import RequestError, validate_prompt
from engine.sampling import SamplingParams, StopChecker, cut_at_stop
from engine.scheduler import Schedule, Scheduler
from engine.sequence import Request, Sequence, Status, StepOutput
from kvcache import BlockAllocator, KVCacheManager, KVStorage
from kvcache.storage import dtype_name


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded=None, held_back=None):
        """`loaded` = (model, model_config, tokenizer) to share one model between engines; `held_back`:
        the pool's blocks promised to coming imports (kvcache.manager; a decode worker's handler)."""
        from engine.loader import load_model

        self.config = config
        self.device = torch.device(config.device)
        self.backend = get_backend(config.attention_backend, self.device)
        if loaded is None:
            loaded = load_model(config.model, device=config.device, dtype=config.dtype, backend=self.backend,
                                cpu_gemm=config.cpu_gemm, cpu_fused=config.cpu_kernels,
                                weights=config.weights)
        self.model, self.model_config, self.tokenizer = loaded
        self.model_id = model_identity(self.model_config, self.model)
        self.computes_in = weight_format.computed_in(config.weights, self.model_config.dtype)  # 'bf16'...
        kv_dtype = dtype_name(next(self.model.parameters()).dtype)
        layout = self.model_config.kv_layout(config.block_size, kv_dtype, self.model_id)
        self.storage = KVStorage(layout, config.num_blocks, self.device, null_block=True, shm=config.kv_shm)
        host = None if config.num_host_blocks <= 0 else \
            KVStorage(layout, config.num_host_blocks, device="cpu", pin_memory=self.device.type == "cuda")
        self.kv = KVCacheManager(BlockAllocator(config.num_blocks), config.block_size, self.storage,
                                 config.enable_prefix_caching, host, held_back=held_back)
        self.scheduler = Scheduler(config.scheduler, self.kv)
        kernel = config.cpu_kernels and self.backend.name == "torch" and \
            cpu_attention.applies(self.device, self.storage.data.dtype, self.model_config.head_dim)
        self.workspace = Workspace(config.decode_mirror and not kernel, kernel)  # kernel or mirror
        if self.workspace.mirror is not None and self.backend.name == "torch" and config.role != "prefill":
            # now, not in the first request's first decode step
            layers = range(self.model_config.num_layers)
            self.workspace.mirror.warm([self.storage.layer_view(i) for i in layers])
        self.graphs = self._capture_graphs()  # engine.cuda_graphs.DecodeGraphs, or None: eager
        self.requests: dict[str, Request] = {}
        self.prefilled: dict[str, Request] = {}  # prefill role: first token out, blocks held
        self.steps = 0
        self.last_step_prefill_tokens = 0  # prefill tokens the last step computed (0: decode only)
        self.current_step: tuple[float, int] | None = None  # (start, tokens) of the forward in progress

    def _capture_graphs(self):
        """Decode steps as CUDA graphs where they apply (CUDA, the Triton backend, cuda_graphs > 0);
        None where they do not or capture failed (logged)."""
        if self.config.cuda_graphs <= 0 or self.device.type != "cuda" or self.backend.name != "triton" \
                or self.config.role == "prefill":  # a prefill engine runs no decode steps
            return None
        B = self.config.block_size
        width = min(self.config.num_blocks, -(-self.model_config.max_position_embeddings // B))
        graphs = DecodeGraphs(self.model, self.storage, B, width, self.config.cuda_graphs)
        return graphs if graphs.capture_all() else None

    # ---- requests -----------------------------------------------------------------------
    def validate_prompt(self, prompt_ids: list[int], params: SamplingParams) -> None:
        c, m = self.config, self.model_config
        validate_prompt(prompt_ids, params, vocab=m.vocab_size, context=m.max_position_embeddings,
                        block_size=c.block_size, num_blocks=c.num_blocks, role=c.role)

    def add_request(self, prompt_ids: list[int], params: SamplingParams,
                    request_id: str | None = None, prefix_key: str | None = None) -> str:
        self.validate_prompt(prompt_ids, params)
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.requests:
            raise RequestError(f"duplicate request id {request_id!r}")
        params = params.with_seed()
        req = Request(request_id, list(prompt_ids), params, self._stop_checker(params), time.monotonic(),
                      seqs=[Sequence(0, list(prompt_ids))], prefix_key=prefix_key or None)
        self.requests[request_id] = req
        self.scheduler.add(req)
        return request_id

    def add_imported(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                     seqs: list[Sequence]) -> None:
        """Decode role: sequences whose prompt KV is already adopted by `self.kv` under their seq_id."""
        for s in seqs:
            s.num_computed = self.kv.table(s.seq_id).num_computed
        # NOTE: the key the sender hashed with (a client's cache_salt): a recompute after preemption
        # must find and register its prefix under the same key
        key = self.kv.table(seqs[0].seq_id).extra_key if seqs else None
        req = Request(request_id, list(prompt_ids), params, self._stop_checker(params), time.monotonic(),
                      seqs=seqs, forked=True, prefix_key=key)
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
        self._free_seqs(self.prefilled.pop(request_id))

    def free_request(self, req: Request) -> None:
        """Prefill role: free a request taken out of `prefilled` (its migration is over)."""
        self._free_seqs(req)

    def has_work(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def computed_blocks(self, request_id: str) -> dict[int, list[int]]:
        """Per sequence index, its blocks whose K/V are complete (what a streamed migration could ship)."""
        req = self.requests.get(request_id) or self.prefilled[request_id]
        return {s.index: self.kv.table(s.seq_id).blocks[:s.num_computed // self.config.block_size]
                for s in req.seqs if s.seq_id in self.kv.tables}

    # ---- the step -----------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        plan = self.scheduler.schedule()
        if plan.empty:
            return []
        self.steps += 1
        self.last_step_prefill_tokens = sum(n for _, _, n in plan.prefill)
        for req, s, _ in plan.prefill:  # its first chunk starts where the prefix cache left off
            if req.cached_tokens is None:
                req.cached_tokens = self.kv.table(s.seq_id).num_computed
        self.current_step = (time.monotonic(), plan.num_tokens)  # read by the worker's heartbeat thread
        ready, logits = self._forward(plan)
        self.scheduler.pacer.observe(plan.num_tokens, time.monotonic() - self.current_step[0])
        self.current_step = None
        by_req: dict[str, tuple[Request, dict[int, int]]] = {}  # request id -> (request, seq_id -> row)
        for i, (req, s) in enumerate(ready):
            by_req.setdefault(req.request_id, (req, {}))[1][s.seq_id] = i
        outputs, batch = [], []  # StepOutputs; (request, sequence, logits row) to sample
        for req, row_of in by_req.values():
            if req.first_token_time is None:
                req.first_token_time = time.monotonic()
            if req.is_beam:
                beam_step(req, {seq_id: logits[i] for seq_id, i in row_of.items()}, self.kv)
                if not req.seqs:
                    outputs += self._finish_beam(req)
                continue
            if not req.forked:
                self._fork(req, row_of)
            batch += [(req, s, row_of[s.seq_id]) for s in req.live_seqs if s.seq_id in row_of]
        if batch:
            outputs += self._sample(batch, logits)
        return outputs

    def _forward(self, plan: Schedule) -> tuple[list[tuple[Request, Sequence]], torch.Tensor]:
        """One packed forward (decode rows first). Returns the sequences now fully computed and
        their last-position logits (R, V) float32, row r for sequence r."""
        entries = [(req, s, 1) for req, s in plan.decode] + plan.prefill
        tables, seq_lens, q_lens, ids, ready, rows = [], [], [], [], [], []
        for req, s, n in entries:
            t = self.kv.table(s.seq_id)
            start = t.num_computed
            tables.append(t.blocks)
            seq_lens.append(start + n)
            q_lens.append(n)
            ids += t.token_ids[start:start + n]
            if start + n == s.num_tokens:  # its last token is in: its logits pick the next one
                ready.append((req, s))
                rows.append(len(ids) - 1)
        meta = AttentionMetadata.build(tables, seq_lens, q_lens, self.config.block_size, self.device,
                                       null_block=self.storage.null_block_id)
        meta.workspace, meta.seq_ids = self.workspace, [s.seq_id for _, s, _ in entries]
        if self.workspace.mirror is not None:  # sizes the mirror's slots
            meta.final_lens = [len(s.prompt_ids) + req.params.max_tokens for req, s, _ in entries]
        bucket = None if self.graphs is None or len(rows) < len(ids) else self.graphs.bucket(meta)
        with torch.inference_mode():
            if bucket is not None:  # a decode step: every row is ready, replayed from its graph
                logits = self.graphs.run(torch.tensor(ids, device=self.device), meta, bucket)  # (R, V)
            else:
                hidden = self.model.forward(torch.tensor(ids, device=self.device), meta.positions,
                                            self.storage, meta, rows if len(rows) < len(ids) else None)
                logits = self.model.compute_logits(hidden).float()  # (R, V); hidden (R, hidden)
        for (_, s, _), n in zip(entries, seq_lens):
            self.kv.mark_computed(s.seq_id, n)
            s.num_computed = n
        return ready, logits

    def _fork(self, req: Request, row_of: dict[int, int]) -> None:
        """n > 1: after the prompt's first logits, the children share its blocks and its row."""
        parent = req.seqs[0]
        for i in range(1, req.width):
            child = Sequence(i, list(parent.prompt_ids), list(parent.output_ids),
                             num_computed=parent.num_computed)
            self.kv.fork(parent.seq_id, child.seq_id)
            req.seqs.append(child)
            row_of[child.seq_id] = row_of[parent.seq_id]
        req.forked = True

    def _sample(self, batch: list[tuple[Request, Sequence, int]], logits: torch.Tensor) -> list[StepOutput]:
        rows = [r for _, _, r in batch]
        if rows != list(range(len(logits))):
            logits = logits[torch.tensor(rows, device=logits.device)]  # (len(batch), V)
        tokens, logprobs = sample_rows(logits, batch)  # min_tokens masks; logprobs where asked
        outs: list[StepOutput] = []
        done: dict[str, Request] = {}
        for (req, s, _), tok, lp in zip(batch, tokens, logprobs):
            s.output_ids.append(tok)
            s.finish_reason = req.stop.check_sequence(s.output_ids, s.decoded, self.tokenizer)
            if s.finish_reason is not None:
                self.kv.free(s.seq_id)
            outs.append(StepOutput(req.request_id, s.index, [tok], s.finished, s.finish_reason, logprobs=lp))
            done[req.request_id] = req
        for req in done.values():
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

    def choice(self, s: Sequence, params: SamplingParams) -> dict:
        """One OpenAI-style choice for a finished sequence (text cut at a stop string)."""
        text = self.tokenizer.decode(s.output_ids) if self.tokenizer is not None else ""
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
        return [Completion(rid, p, [self.choice(s, live[rid].params) for s in sorted(live[rid].seqs,
                                                                                  key=lambda s: s.index)])
                for rid, (p, _) in reqs.items()]

