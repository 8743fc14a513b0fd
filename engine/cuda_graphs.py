"""Decode steps as CUDA graphs: on a GPU a small model's decode step is launch-bound (hundreds of
kernels of a few microseconds each, each paid for on the host), so the step is captured once per
batch-size bucket and replayed. A graph replays fixed addresses and fixed shapes, so every input
lives in a static buffer sized for the largest bucket: token ids, positions, KV slots, block
tables (as wide as the longest sequence the model or the pool allows) and context lengths. A step
of S sequences runs the smallest bucket b >= S; rows S..b-1 are padding: slot -1 (the store kernel
skips it), context 0 (decode attends to nothing and writes zeros), token 0 at position 0. The
Triton decode kernel reads the context length from the device, so one graph serves every context
up to the table's width. Steps a graph cannot serve run eagerly: prefill or mixed steps, more
sequences than the largest bucket, the torch backend. `capture=False` runs the same static path
without capturing (the CPU tier tests it under TRITON_INTERPRET=1, where no graph exists); a
failed capture logs why and leaves the engine eager. vLLM and SGLang capture the same way (per
bucket, padded, a shared memory pool, the largest bucket first).
"""

from __future__ import annotations

import logging

import torch

from engine.attn_metadata import AttentionMetadata

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def buckets_up_to(max_batch: int) -> tuple[int, ...]:
    """The capture sizes: powers of two up to `max_batch`, and `max_batch` itself."""
    sizes = [b for b in BUCKETS if b < max_batch]
    return tuple(sizes + [max_batch]) if max_batch > 0 else ()


class DecodeGraphs:
    """Captured decode steps of one model over one KV pool (see the module doc).

    model: engine.model.LlamaModel on the pool's device (the Triton backend); storage: its
    kvcache.KVStorage (with a null block); block_size: B; max_blocks: W, the widest block table a
    step may carry; max_batch: the largest bucket; capture: False runs the static path eagerly.
    """

    def __init__(self, model, storage, block_size: int, max_blocks: int, max_batch: int,
                 capture: bool = True):
        if storage.null_block_id is None:
            raise ValueError("decode graphs pad block tables with the pool's null block: the pool needs one")
        self.model, self.storage, self.B, self.W = model, storage, block_size, max_blocks
        self.buckets = buckets_up_to(max_batch)
        self.capture = capture
        device = storage.data.device
        n = self.buckets[-1]
        self.ids = torch.zeros(n, dtype=torch.int64, device=device)          # (n,)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)    # (n,)
        self.slots = torch.full((n,), -1, dtype=torch.int64, device=device)  # (n,) -1: padding
        self.tables = torch.full((n, max_blocks), storage.null_block_id, dtype=torch.int32,
                                 device=device)                              # (n, W)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)     # (n,)
        self.starts = torch.arange(n + 1, dtype=torch.int32, device=device)  # (n + 1,) one query each
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}  # bucket -> (b, V) float32 written by its graph
        self.replays = 0                           # steps served by a graph (or the static path)
        self._tables: dict = {}                    # the rotary tables the graphs captured

    def _meta(self, b: int) -> AttentionMetadata:
        """Metadata over the static buffers' first b rows. Its host lists only describe the shapes
        (b sequences of one query, the table's full width) the launchers check and size grids by."""
        meta = AttentionMetadata([[self.storage.null_block_id] * self.W] * b, [self.W * self.B] * b, [1] * b,
                                 self.B, self.ids.device, self.storage.null_block_id, [], [])
        meta.positions, meta.slot_mapping = self.positions[:b], self.slots[:b]
        # the cached properties, set to the static buffers (functools.cached_property reads __dict__)
        meta.__dict__.update(block_tables=self.tables[:b], seq_lens=self.seq_lens[:b],
                             query_start_loc=self.starts[:b + 1])
        return meta

    def _forward(self, b: int) -> torch.Tensor:
        """The step on the static buffers: (b, V) float32 logits."""
        hidden = self.model.forward(self.ids[:b], self.positions[:b], self.storage, self._meta(b))
        return self.model.compute_logits(hidden).float()

    def capture_all(self) -> bool:
        """Capture every bucket, the largest first (the others reuse its memory pool). Returns
        False, graphs dropped, where capture fails (the engine then stays eager)."""
        if not self.capture:
            return True
        try:
            with torch.inference_mode():
                # the rotary tables, and every kernel compiled, before any capture
                self.model.rotary.tables(self.positions[:1], self.model.embed_tokens.weight.dtype,
                                         self.W * self.B - 1)
                # the graphs read these tables by address: held here, they outlive a later, longer
                # table the rotary cache may build for another engine sharing the model
                self._tables = dict(self.model.rotary._tables)
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    for b in self.buckets:
                        self._forward(b)
                torch.cuda.current_stream().wait_stream(stream)
                pool = None
                for b in reversed(self.buckets):
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        self.logits[b] = self._forward(b)
                    pool = graph.pool() if pool is None else pool
                    self.graphs[b] = graph
                torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001  (any capture failure leaves the engine eager)
            log.warning("CUDA graph capture failed (%s: %s); decode steps stay eager", type(e).__name__, e)
            self.graphs.clear()
            self.logits.clear()
            return False
        return True

    def bucket(self, meta: AttentionMetadata) -> int | None:
        """The bucket that serves this step, or None (not decode-only, too many sequences, a table
        wider than the static one)."""
        S = meta.num_seqs
        if not meta.is_decode_only or S > self.buckets[-1] or max(len(t) for t in meta.tables_host) > self.W:
            return None
        return next(b for b in self.buckets if b >= S)

    def run(self, ids: torch.Tensor, meta: AttentionMetadata, b: int) -> torch.Tensor:
        """ids (S,) int64 on the device; meta: the step's own metadata; b: `bucket(meta)` ->
        logits (S, V) float32. Fills the static buffers, replays bucket b's graph (or runs the
        static path), returns a view of its first S rows (valid until the next step)."""
        S = meta.num_seqs
        width = max(len(t) for t in meta.tables_host)
        self.ids[:S].copy_(ids)
        self.positions[:S].copy_(meta.positions)
        self.slots[:S].copy_(meta.slot_mapping)
        self.tables[:S, :width].copy_(meta.block_tables)  # (S, width); the rest stays null
        self.seq_lens[:S].copy_(meta.seq_lens)
        self.replays += 1
        try:
            if b in self.graphs:
                self.graphs[b].replay()
                return self.logits[b][:S]
            with torch.inference_mode():
                return self._forward(b)[:S]
        finally:  # the rows this step filled go back to padding: a later, smaller step in the same
            # bucket must not store K/V at this step's slots
            self.ids[:S].zero_()
            self.positions[:S].zero_()
            self.slots[:S].fill_(-1)
            self.tables[:S].fill_(self.storage.null_block_id)
            self.seq_lens[:S].zero_()
