"""Chunked prefill and the step budget: the same tokens as an unchunked prefill, decodes keep
running while a long prompt is chunked, prefill progress (computed blocks) after every step,
the prefill role holding a chunked prompt's blocks, and preemption by swap of n > 1 requests
(swap-in reserving a block per running sequence) keeping seeded outputs unchanged; padded table
entries name the null block; the decode mirror (allocated at start unless the engine only
prefills) and the block gather give the same tokens; the
last layer computed for the sampled rows only gives their hidden states and every row's K/V."""

import pytest
import torch

from bench.engine_speed import write_random_llama
from engine import cpu_attention
from engine.engine import EngineConfig, LLMEngine
from engine.sampling import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig
from engine.sequence import Request, Sequence, Status
from kvcache import BlockAllocator, KVCacheManager, KVStorage
from kvcache.storage import KVLayout

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    from engine.loader import load_model

    path = write_random_llama(str(tmp_path_factory.mktemp("llama")), seed=5, vocab=300, hidden=64, layers=2,
                              heads=4, kv_heads=2, intermediate=160)
    return load_model(path, device="cpu", backend="torch")


def _engine(loaded, budget=2048, chunked=True, **kw):
    sched = SchedulerConfig(max_num_batched_tokens=budget, enable_chunked_prefill=chunked,
                            preemption_mode=kw.pop("preemption_mode", "recompute"))
    return LLMEngine(EngineConfig(scheduler=sched, **kw), loaded=loaded)


def _prompts(lengths=(5, 40, 77, 130, 33)):
    gen = torch.Generator().manual_seed(11)
    return [[1] + torch.randint(3, 300, (n - 1,), generator=gen).tolist() for n in lengths]


@pytest.mark.parametrize("budget", [7, 16, 64])
def test_chunked_prefill_gives_the_unchunked_tokens(loaded, budget):
    prompts = _prompts()
    whole = _engine(loaded, chunked=False, block_size=4, num_blocks=512).generate(prompts, GREEDY)
    eng = _engine(loaded, budget=budget, block_size=4, num_blocks=512)
    chunked = eng.generate(prompts, GREEDY)
    assert [c.choices for c in chunked] == [c.choices for c in whole]
    assert eng.kv.allocator.num_used == 0
    eng.kv.check_integrity()


def test_decodes_run_while_a_long_prompt_is_chunked(loaded):
    eng = _engine(loaded, budget=16, block_size=4, num_blocks=256)
    short = eng.add_request(_prompts((6,))[0], SamplingParams(max_tokens=40, ignore_eos=True))
    eng.step()  # the short prompt prefills and samples its first token
    long_id = eng.add_request(_prompts((130,))[0], GREEDY)
    seq = eng.requests[long_id].seqs[0]
    progress = []
    while not seq.output_ids:
        outs = eng.step()
        assert any(o.request_id == short for o in outs)  # the running request gets a token every step
        assert eng.last_step_prefill_tokens <= 16 - 1
        progress.append(seq.num_computed)
        assert eng.computed_blocks(long_id)[0] == eng.kv.table(seq.seq_id).blocks[:seq.num_computed // 4]
    assert progress == sorted(progress) and progress[-1] == 130 and len(progress) == -(-130 // 15)


def test_prefill_role_holds_a_chunked_prompt_after_its_first_token(loaded):
    eng = _engine(loaded, budget=32, block_size=4, num_blocks=128, role="prefill")
    prompt = _prompts((70,))[0]
    rid = eng.add_request(prompt, GREEDY)
    steps = 0
    while eng.has_work():
        eng.step()
        steps += 1
    assert steps == 3 and rid in eng.prefilled
    held = eng.prefilled[rid].seqs[0]
    assert len(held.output_ids) == 1 and held.num_computed == 70
    assert len(eng.computed_blocks(rid)[0]) == 70 // 4
    eng.release_prefilled(rid)
    assert eng.kv.allocator.num_used == 0


def test_swap_preemption_of_parallel_samples_keeps_seeded_outputs(loaded):
    params = SamplingParams(max_tokens=24, n=3, temperature=0.8, top_p=0.9, seed=4, ignore_eos=True)
    prompts = _prompts((30, 45, 20))
    roomy = _engine(loaded, block_size=4, num_blocks=512).generate(prompts, params)
    eng = _engine(loaded, block_size=4, num_blocks=60, num_host_blocks=128, preemption_mode="swap")
    tight = eng.generate(prompts, params)
    assert eng.scheduler.preemptions > 0 and eng.scheduler.swap_fallbacks == 0
    assert [c.choices for c in tight] == [c.choices for c in roomy]
    assert eng.kv.allocator.num_used == 0 and eng.kv.host_allocator.num_used == 0


def test_swap_in_reserves_a_block_per_running_sequence():
    layout = KVLayout(1, 1, 4, 4)
    kv = KVCacheManager(BlockAllocator(12), 4, KVStorage(layout, 12), host_storage=KVStorage(layout, 12))
    sched = Scheduler(SchedulerConfig(), kv)

    def request(name, width, tokens):
        seqs = [Sequence(i, list(range(tokens))) for i in range(width)]
        req = Request(name, list(range(tokens)), SamplingParams(n=width, temperature=1.0), None, 0.0, seqs)
        for s in seqs:
            assert kv.allocate(s.seq_id, s.token_ids) is not None
        return req

    running = request("running", 3, 2)  # 3 blocks in use, 3 sequences that may each need a block
    sched.add_running(running)
    swapped = request("swapped", 1, 16)  # 4 blocks, swapped out
    assert kv.swap_out_group([swapped.seqs[0].seq_id])
    swapped.status = Status.SWAPPED
    sched.swapped.append(swapped)
    filler = kv.allocator.allocate_many(kv.allocator.num_available - 7)
    sched._swap_in()  # 7 free: 4 blocks + 3 running sequences + 1 of its own do not fit
    assert sched.swapped and kv.table(swapped.seqs[0].seq_id).swapped
    kv.allocator.free(filler.pop())
    sched._swap_in()  # 8 free: fits
    assert not sched.swapped and swapped in sched.running


def test_padding_points_at_the_null_block_which_stays_zero(loaded):
    from engine import attn_metadata

    eng = _engine(loaded, budget=16, block_size=4, num_blocks=128)
    built = []
    real = attn_metadata.AttentionMetadata.build

    def spy(*args, **kwargs):
        built.append(real(*args, **kwargs))
        return built[-1]

    attn_metadata.AttentionMetadata.build = staticmethod(spy)
    try:
        eng.generate(_prompts((5, 61, 17)), GREEDY)
    finally:
        attn_metadata.AttentionMetadata.build = staticmethod(real)
    null = eng.storage.null_block_id
    assert null == 128 and eng.storage.data.shape[0] == 128  # outside the allocator's blocks
    padded = [row[len(t):] for m in built for row, t in zip(m.block_tables.tolist(), m.tables_host)]
    assert any(padded) and all(b == null for row in padded for b in row)
    for layer in range(2):
        k_cache, v_cache = eng.storage.layer_view(layer)
        assert torch.count_nonzero(k_cache[null]) == 0 and torch.count_nonzero(v_cache[null]) == 0


def test_decode_paths_give_the_same_tokens(loaded):
    """The compiled CPU kernel (pool read in place), the decode mirror and the block gather."""
    params = SamplingParams(max_tokens=20, n=2, temperature=0.7, seed=3, ignore_eos=True)
    prompts = _prompts((9, 50, 31))
    engines = [_engine(loaded, budget=24, block_size=4, num_blocks=256, decode_mirror=mirror, cpu_kernels=k)
               for k, mirror in ((False, True), (False, False), (True, True))]
    # an engine that decodes has its mirror allocated at start (not in its first request's step)
    assert len(engines[0].workspace.mirror.buffers) == 2 and engines[1].workspace.mirror is None
    assert not _engine(loaded, num_blocks=64, role="prefill", cpu_kernels=False).workspace.mirror.buffers
    if cpu_attention.available():  # the kernel replaces the mirror: no buffers at all
        assert engines[2].workspace.kernel and engines[2].workspace.mirror is None
    runs = [e.generate(prompts, params) for e in engines]
    assert [c.choices for c in runs[0]] == [c.choices for c in runs[1]] == [c.choices for c in runs[2]]


@pytest.mark.parametrize("mirror,kernel", [(True, False), (False, False), (False, True)])
def test_last_layer_runs_past_attention_only_for_the_rows_asked(loaded, mirror, kernel):
    """model.forward(rows=...) gives those rows' hidden states (as computing every row and picking
    them does) and stores every row's K/V all the same: a decode row, a prompt ending in this
    chunk, a later chunk and a first chunk that end nothing."""
    from engine.attn_metadata import AttentionMetadata
    from engine.attn_torch import Workspace

    eng = _engine(loaded, block_size=4, num_blocks=128)
    model, storage = eng.model, eng.storage
    seq_lens, query_lens = [21, 70, 70, 50], [1, 70, 30, 50]
    tables, free = [], list(range(128))
    for n in seq_lens:
        tables.append([free.pop() for _ in range(-(-n // 4))])
    rows = [0, 70]  # the decode row, the last row of the 70-token prompt
    gen = torch.Generator().manual_seed(2)
    storage.data.copy_(torch.randn(storage.data.shape, generator=gen))  # the cached context
    before = storage.data.clone()
    ids = torch.randint(3, 300, (sum(query_lens),), generator=gen)
    outs, kv = [], []
    for keep in (None, rows):
        storage.data.copy_(before)
        meta = AttentionMetadata.build(tables, seq_lens, query_lens, 4, null_block=storage.null_block_id)
        meta.workspace, meta.seq_ids = Workspace(mirror, kernel), [0, 1, 2, 3]
        meta.final_lens = [n + 8 for n in seq_lens]
        with torch.inference_mode():
            outs.append(model.forward(ids, meta.positions, storage, meta, keep))
        kv.append(storage.data.clone())
    assert outs[0].shape[0] == sum(query_lens) and outs[1].shape[0] == len(rows)
    torch.testing.assert_close(outs[1], outs[0][rows], atol=1e-5, rtol=1e-5)
    assert torch.equal(kv[0], kv[1]) and not torch.equal(kv[0], before)
