"""The torch attention backend's decode and prefill paths against a plain reference.

The reference is written out per sequence in float64: causal softmax attention of each new
token over every key up to its absolute position (lower-right aligned when part of the context
was cached). Cases: ragged batches mixing one-query (decode) and many-query (prefill, with and
without a cached prefix) sequences in any order; decode groups split by length; small and wide
grouped-query shapes (heads as rows, and one matmul pair per kv head); `forward` using the
step's own K/V; prefills longer than one query block; and the decode mirror followed over many
steps while sequences join, leave, outgrow the layout, and fall back to the gather path, and
growing past the pool's size for mixed lengths; the null block stays zero throughout.
"""

import random

import pytest
import torch

from engine import attn_torch, attn_torch_prefill
from engine.attn_metadata import AttentionMetadata
from kvcache.storage import KVLayout, KVStorage

B = 4


def _pool(kv_heads, head_dim, num_blocks, seed=0):
    storage = KVStorage(KVLayout(2, kv_heads, head_dim, B), num_blocks, null_block=True)
    gen = torch.Generator().manual_seed(seed)
    storage.data.copy_(torch.randn(storage.data.shape, generator=gen))  # garbage outside live slots
    return storage


def _reference(q, k_cache, v_cache, tables, seq_lens, query_lens, scale):
    """q (T, Hq, D) -> (T, Hq, D), one sequence and one head at a time, in float64."""
    out, row = torch.empty_like(q), 0
    group = q.shape[1] // k_cache.shape[2]
    for table, n, count in zip(tables, seq_lens, query_lens):
        keys = torch.cat([k_cache[b] for b in table])[:n].double()  # (n, Hkv, D)
        values = torch.cat([v_cache[b] for b in table])[:n].double()
        for i in range(count):
            pos = n - count + i  # lower-right aligned: the last query is the last token
            for h in range(q.shape[1]):
                scores = keys[:pos + 1, h // group] @ q[row + i, h].double() * scale  # (pos + 1,)
                out[row + i, h] = (torch.softmax(scores, 0) @ values[:pos + 1, h // group]).to(q.dtype)
        row += count
    return out


def _tables(seq_lens, num_blocks, rng):
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    tables = []
    for n in seq_lens:
        tables.append([ids.pop() for _ in range(-(-n // B))])
    return tables


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 1), (16, 4), (6, 6)])
@pytest.mark.parametrize("seed", [0, 1])
def test_mixed_batch_matches_reference(heads, kv_heads, seed):
    """Decode rows, fresh prefills and prefix-hit prefills, interleaved, ragged lengths."""
    rng = random.Random(seed)
    seq_lens = [1, 37, 9, 64, 5, 23, 70]
    query_lens = [1, 37, 1, 20, 5, 1, 3]  # 64 with 44 cached, 70 with 67 cached: lower-right aligned
    storage = _pool(kv_heads, 16, 64, seed)
    k_cache, v_cache = storage.layer_view(1)
    tables = _tables(seq_lens, 64, rng)
    meta = AttentionMetadata.build(tables, seq_lens, query_lens, B, null_block=storage.null_block_id)
    q = torch.randn(sum(query_lens), heads, 16, generator=torch.Generator().manual_seed(seed))
    ref = _reference(q, k_cache, v_cache, tables, seq_lens, query_lens, 0.25)
    torch.testing.assert_close(attn_torch.paged_attention(q, k_cache, v_cache, meta, 0.25), ref,
                               atol=1e-5, rtol=1e-5)


def test_forward_uses_the_steps_own_keys_and_stores_them():
    """`forward` writes the new K/V into their slots and attends with them (prefill and decode)."""
    rng = random.Random(5)
    seq_lens, query_lens = [30, 1 + 12, 7], [30, 1, 7]
    storage = _pool(2, 8, 32)
    k_cache, v_cache = storage.layer_view(0)
    tables = _tables(seq_lens, 32, rng)
    meta = AttentionMetadata.build(tables, seq_lens, query_lens, B, null_block=storage.null_block_id)
    gen = torch.Generator().manual_seed(1)
    q, key, value = (torch.randn(sum(query_lens), h, 8, generator=gen) for h in (4, 2, 2))
    out = attn_torch.forward(q, key, value, k_cache, v_cache, meta, 0.3)
    slots = meta.slot_mapping
    assert torch.equal(k_cache[slots // B, slots % B], key)
    assert torch.equal(v_cache[slots // B, slots % B], value)
    torch.testing.assert_close(out, _reference(q, k_cache, v_cache, tables, seq_lens, query_lens, 0.3),
                               atol=1e-5, rtol=1e-5)



def test_long_prefills_attend_in_query_blocks():
    """Prefills longer than one query block, fresh and after a cached prefix long enough that
    the cached causal band grows mid-step; `forward` (own K/V) and `paged_attention` agree with
    the reference."""
    rng = random.Random(4)
    seq_lens, query_lens = [150, 1, 200, 1190], [150, 1, 130, 70]  # 70 queries after 1120 cached
    storage = _pool(2, 8, 2 + sum(-(-n // B) for n in seq_lens))
    k_cache, v_cache = storage.layer_view(0)
    tables = _tables(seq_lens, storage.num_blocks, rng)
    gen = torch.Generator().manual_seed(6)
    q, key, value = (torch.randn(sum(query_lens), h, 8, generator=gen) for h in (4, 2, 2))
    for attend in ("forward", "paged_attention"):
        attn_torch_prefill._bands.clear()  # built for the first block, grown past 1024 keys for the last
        meta = AttentionMetadata.build(tables, seq_lens, query_lens, B, null_block=storage.null_block_id)
        out = attn_torch.forward(q, key, value, k_cache, v_cache, meta, 0.3) if attend == "forward" else \
            attn_torch.paged_attention(q, k_cache, v_cache, meta, 0.3)
        torch.testing.assert_close(out, _reference(q, k_cache, v_cache, tables, seq_lens, query_lens, 0.3),
                                   atol=1e-5, rtol=1e-5)

def test_ragged_decode_splits_into_length_groups():
    rng = random.Random(2)
    seq_lens = [3, 900, 5, 870, 2, 4, 6, 880]  # long and short: padding all to 900 would waste ~4x
    storage = _pool(2, 8, 2 + sum(-(-n // B) for n in seq_lens))
    k_cache, v_cache = storage.layer_view(1)
    tables = _tables(seq_lens, storage.num_blocks, rng)
    meta = AttentionMetadata.build(tables, seq_lens, [1] * len(seq_lens), B, null_block=storage.null_block_id)
    q = torch.randn(len(seq_lens), 4, 8, generator=torch.Generator().manual_seed(3))
    out = attn_torch.paged_attention(q, k_cache, v_cache, meta, 0.3)
    assert len(meta.torch_plan.decode) >= 2
    padded = sum(len(g.blocks) for g in meta.torch_plan.decode) * B
    assert padded < 1.3 * sum(seq_lens)  # cost follows the tokens attended, not batch x longest
    torch.testing.assert_close(out, _reference(q, k_cache, v_cache, tables, seq_lens, [1] * 8, 0.3),
                               atol=1e-5, rtol=1e-5)


def test_padded_table_entries_name_the_null_block():
    meta = AttentionMetadata.build([[3, 4, 5], [7]], [10, 2], [1, 2], B, null_block=99)
    assert meta.block_tables.tolist() == [[3, 4, 5], [7, 99, 99]]
    storage = _pool(1, 8, 5)
    k_cache, _ = storage.layer_view(0)
    assert k_cache.shape[0] == 6 and storage.null_block_id == 5 and storage.data.shape[0] == 5
    assert torch.count_nonzero(k_cache[5]) == 0


def _mirror_step(storage, workspace, live, rng, heads, layer_views):
    """One engine-like decode step over `live` (seq id -> [table, length]); checks every layer."""
    ids = list(live)
    rng.shuffle(ids)  # rows in a different order each step: the mirror permutes them to slots
    for seq_id in ids:
        table, n = live[seq_id]
        if n % B == 0:
            table.append(storage.free_blocks.pop())
        live[seq_id][1] = n + 1
    tables, seq_lens = [live[i][0] for i in ids], [live[i][1] for i in ids]
    meta = AttentionMetadata.build(tables, seq_lens, [1] * len(ids), B, null_block=storage.null_block_id)
    meta.workspace, meta.seq_ids, meta.final_lens = workspace, ids, [n + 8 for n in seq_lens]
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    used_mirror = []
    for layer, (k_cache, v_cache) in enumerate(layer_views):
        q, key, value = (torch.randn(len(ids), h, 8, generator=gen) for h in (heads, 2, 2))
        out = attn_torch.forward(q, key, value, k_cache, v_cache, meta, 0.35, layer)
        ref = _reference(q, k_cache, v_cache, tables, seq_lens, [1] * len(ids), 0.35)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        used_mirror.append(meta.torch_plan.mirror is not None)
    return used_mirror[0]


def _mirror_setup(seed: int, num_blocks: int):
    """(rng, a 2-layer pool with shuffled free blocks, its layer views, a workspace, no live sequences)."""
    rng = random.Random(seed)
    storage = _pool(2, 8, num_blocks)
    storage.free_blocks = list(range(num_blocks))
    rng.shuffle(storage.free_blocks)
    return rng, storage, [storage.layer_view(i) for i in range(2)], attn_torch.Workspace(), {}


@pytest.mark.parametrize("warm", [False, True])
def test_decode_mirror_follows_sequences_across_steps(warm):
    """Sequences decode, join (filled from the pool), leave (holes filled by moves), outgrow the
    layout (re-laid out), and a ragged batch falls back to the gather path and back again; warm:
    the buffers were allocated and zeroed up front, as an engine that decodes does at start, and
    the steps take them as they are."""
    rng, storage, layer_views, workspace, live = _mirror_setup(7, 400)
    if warm:
        workspace.mirror.warm(layer_views)
        pool = layer_views[0][0].shape[0] * B * 2 * 8  # elements of the pool-sized part (Hkv 2, D 8)
        for k, v in workspace.mirror.buffers.values():
            assert torch.count_nonzero(k[:pool]) == 0 and torch.count_nonzero(v[:pool]) == 0
            k[pool:].fill_(float("nan"))  # past the pool-sized part: reserved, never zeroed
            v[pool:].fill_(float("nan"))
        held = {layer: k.data_ptr() for layer, (k, _) in workspace.mirror.buffers.items()}

    def join(seq_id, n):
        live[seq_id] = [[storage.free_blocks.pop() for _ in range(-(-n // B))], n]

    for seq_id, n in enumerate([9, 14, 11, 16]):
        join(seq_id, n)
    paths = [_mirror_step(storage, workspace, live, rng, 4, layer_views) for _ in range(3)]
    del live[1]  # leaves: the highest slot moves into its hole
    join(10, 13)  # joins: one gather
    paths += [_mirror_step(storage, workspace, live, rng, 4, layer_views) for _ in range(3)]
    layout = workspace.mirror.positions
    join(11, 30)  # longer than the layout: re-laid out, everyone refilled
    paths += [_mirror_step(storage, workspace, live, rng, 4, layer_views) for _ in range(2)]
    assert workspace.mirror.positions > layout
    join(12, 700)  # padding all to 700 would be ragged: gather path, mirror emptied
    paths += [_mirror_step(storage, workspace, live, rng, 4, layer_views)]
    del live[12]
    paths += [_mirror_step(storage, workspace, live, rng, 4, layer_views) for _ in range(2)]
    assert paths == [True] * 8 + [False] + [True] * 2
    assert torch.count_nonzero(layer_views[0][0][storage.null_block_id]) == 0
    if warm:  # the steps used the buffers allocated at start
        assert {layer: k.data_ptr() for layer, (k, _) in workspace.mirror.buffers.items()} == held


def test_decode_mirror_grows_past_the_pool_for_mixed_lengths():
    """Slots padded to the longest final length take more tokens than the pool holds: the
    mirror's buffers grow (up to MAX_GROWTH pools), keeping the entries they held, instead of
    falling back to the gather path; what they had not held yet is garbage (NaN) here, which no
    read may see."""
    rng, storage, layer_views, workspace, live = _mirror_setup(3, 70)
    pool_tokens = layer_views[0][0].shape[0] * B
    paths = []
    for joining in ([12, 30, 14, 28, 16, 26], [18, 24]):  # 6, then 8 slots x 44 positions; 284 in the pool
        for n in joining:
            live[len(live)] = [[storage.free_blocks.pop() for _ in range(-(-n // B))], n]
        paths += [_mirror_step(storage, workspace, live, rng, 4, layer_views) for _ in range(5)]
        assert workspace.mirror.tokens == (pool_tokens if len(live) == 6 else 3 * pool_tokens // 2)
        for buffers in workspace.mirror.buffers.values():
            for buffer in buffers:
                buffer[workspace.mirror.tokens * 2 * 8:].fill_(float("nan"))  # past the part in use
    assert paths == [True] * 10
