"""Streamed export: one sequence's migration offered before its prompt is fully computed.

The manifest is built from what is known when the first prefill chunk lands: the prompt's token
ids (so the prefix hashes and block layout), the sampling parameters, and the dedupe answer.
Its frames are one per logical block, in order, so any block can be sent as soon as its K/V is
complete, whatever physical block holds it. The decode state in the manifest is provisional (no
generated token yet); the `Final` message that closes the stream carries the real one. Payload
chunks are hashed as they are sent ("inline" checksums). Only for CPU pools; the caller keeps
every block it hands to `chunks` referenced until the transfer returns.
"""

from __future__ import annotations

from kvcache.table import blocks_for
from transfer.blocks import prefix_hashes_at, skipped_blocks
from transfer.checksum import checksum
from transfer.manifest import DecodeState, FrameDesc, Manifest, validate_sampling
from transfer.schema import Limits


class StreamedExport:
    """The manifest of a sequence whose `token_ids` are all being computed, and its chunks."""

    def __init__(self, manager, request_id: str, epoch: int, token_ids: list[int], sampling: dict,
                 extra_key: str | None = None, *, reuse=(), reuse_block_size: int = 0,
                 chunk_bytes: int = 2 << 20, limits: Limits | None = None):
        storage = manager.storage
        if storage is None or storage.device.type != "cpu":
            raise ValueError("streamed export needs a CPU pool")
        n, B = len(token_ids), manager.block_size
        if n < 1:
            raise ValueError("nothing to stream")
        self.storage, self.chunk_bytes, bb = storage, chunk_bytes, storage.layout.block_bytes
        nb = blocks_for(n, B)
        reuse = sorted({int(j) for j in reuse})
        skip = skipped_blocks(n, B, set(reuse), reuse_block_size)
        frames = tuple(FrameDesc(i, 1, bb, None) for i in range(nb) if not skip[i])
        self._frame_of = {f.first_block: k for k, f in enumerate(frames)}
        state = DecodeState(list(token_ids), validate_sampling(dict(sampling), limits or Limits()), 0)
        self.manifest = Manifest(
            request_id=str(request_id), epoch=int(epoch), fingerprint=storage.layout.fingerprint(),
            num_tokens=n, block_tokens=tuple([B] * (nb - 1) + [n - (nb - 1) * B]),
            block_hashes=tuple(prefix_hashes_at(token_ids, B, extra_key)), frames=frames,
            chunk_bytes=chunk_bytes, state=state, checksum_mode="inline", extra_key=extra_key,
            reuse=tuple(reuse), reuse_block_size=reuse_block_size if reuse else 0)
        self.num_blocks = nb

    def nbytes(self, blocks) -> int:
        """Payload bytes of these (logical, physical) blocks (reused ones are not sent)."""
        return sum(self.storage.layout.block_bytes for logical, _ in blocks if logical in self._frame_of)

    def chunks(self, blocks):
        """((frame, chunk, None, xxh3), view) for each (logical block, physical block) given, in
        order; blocks the receiver reuses are skipped."""
        cb, bb = self.chunk_bytes, self.storage.layout.block_bytes
        for logical, physical in blocks:
            k = self._frame_of.get(logical)
            if k is None:
                continue
            view = self.storage.block_bytes_view(physical, 1)
            for c in range(0, bb, cb):
                piece = view[c:c + cb]
                yield (k, c // cb, None, checksum(piece)), piece
