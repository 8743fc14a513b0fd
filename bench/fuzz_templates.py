"""Templates of `pdserve bench fuzz`: valid transfers of real exported sequences (several lengths,
frame layouts, checksum modes, chunk sizes and sender block sizes), each kept with the source
pool, sequence, export config and decode state that the dedupe cases re-export with reuse.
"""

from __future__ import annotations

import msgpack

from bench import fuzz_mutators as M
from bench.fuzz_receiver import RX_BLOCK, SHAPE


def make_templates(seed: int):
    """Valid transfers of real exported sequences (several lengths, frames, modes, block sizes)."""
    import torch

    from kvcache.storage import KVLayout
    from measure.pools import fill_random_sequence, kv_digest, make_manager
    from transfer.blocks import prefix_hashes_at
    from transfer.checksum import checksum
    from transfer.export import ExportConfig, export_sequence
    from transfer.wire_codec import encode
    from transfer.wire_messages import DecodeState

    gen = torch.Generator().manual_seed(seed)
    templates, sources = [], {}
    for bs, lengths in ((16, (1, 16, 17, 45, 100, 200)), (8, (9, 64, 130))):
        src = make_manager(KVLayout(block_size=bs, **SHAPE), 256)
        fill_random_sequence(src, "gap0", 2 * bs, gen)
        fill_random_sequence(src, "gap1", 2 * bs, gen)
        src.free("gap0", uncache=True)  # the next sequence starts in the hole: several frames
        for i, n in enumerate(lengths):
            seq = f"s{bs}_{n}"
            tokens = fill_random_sequence(src, seq, n, gen)
            state = DecodeState(tokens + [7], {"max_tokens": 64, "temperature": 0.7, "seed": 5 + i,
                                               "stop": ["</s>"], "stop_token_ids": [2]}, 1) if i % 2 else None
            for mode, cb in (("manifest", 4096), ("inline", 4096 if i % 2 else 8192)):
                ex = export_sequence(src, seq, "template", 1, state,
                                     config=ExportConfig(chunk_bytes=cb, checksum_mode=mode))
                chunks = [(f, c, bytes(v), checksum(v)) for f, c, v, _ in ex.chunks()]
                wire = msgpack.unpackb(encode(ex.manifest), raw=False)
                ex.release()
                t = M.Template(f"{seq}/{mode}/{cb}", wire, chunks, mode == "inline", bs, kv_digest(src, seq),
                               seq, prefix_hashes_at(tokens, RX_BLOCK))
                templates.append(t)
                sources[t.name] = (src, seq, ExportConfig(chunk_bytes=cb, checksum_mode=mode), state)
    return templates, sources
