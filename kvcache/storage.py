"""KV storage: one block-major tensor per worker holding every layer's keys and values.

Layout `[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]` (2 = key, value) keeps
one block's payload, across all layers, in one contiguous byte range. Migration can therefore
send a block straight from pool memory, and physically adjacent blocks coalesce into one frame.
Attention kernels read a layer through `layer_view`, a strided view, so they do not care. An
engine pool also keeps one zeroed null block after the last real one (`null_block=True`): padded
block-table entries point there, never at a live block, and it is outside `data`, so no
allocator, swap or transfer ever sees it. This module holds tensors only: it knows nothing of
ids, ref counts or requests.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import numpy as np
import torch

LAYOUT_NAME = "block-major/NL2BHD"

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def dtype_from_name(name: str) -> torch.dtype:
    """Map a dtype name ('float32', 'float16', 'bfloat16') to the torch dtype."""
    if name not in _DTYPES:
        raise ValueError(f"unknown KV dtype {name!r}; expected one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    for k, v in _DTYPES.items():
        if v == dtype:
            return k
    raise ValueError(f"unsupported KV dtype {dtype}")


@dataclass(frozen=True)
class KVLayout:
    """Shape of one worker's KV pool.

    num_layers: transformer layers whose K and V live in each block.
    num_kv_heads: key/value heads per layer (GQA: fewer than query heads).
    head_dim: channels per head.
    block_size: token slots per block.
    dtype: element type name: 'float32', 'float16' or 'bfloat16'.
    model: opaque identity of the model whose KV this pool holds (a hash the engine computes
      at load; '' for synthetic pools). Pools of different models never exchange blocks.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str = "float32"
    model: str = ""

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
                raise ValueError(f"KVLayout.{name} must be an integer >= 1, got {v!r}")
        dtype_from_name(self.dtype)
        if not isinstance(self.model, str) or len(self.model) > 64:
            raise ValueError(f"KVLayout.model must be a string of at most 64 characters, got {self.model!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)

    @property
    def element_size(self) -> int:
        return self.torch_dtype.itemsize

    @property
    def token_bytes(self) -> int:
        """Bytes of K and V for one token across all layers."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.element_size

    @property
    def block_bytes(self) -> int:
        return self.token_bytes * self.block_size

    def block_shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    def fingerprint(self) -> dict:
        """What two workers must agree on (block size aside, which can be re-blocked)."""
        return {
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype,
            "block_size": self.block_size,
            "layout": LAYOUT_NAME,
            "model": self.model,
        }


class KVStorage:
    """The pool tensor plus helpers to read and write it by block or by slot."""

    def __init__(self, layout: KVLayout, num_blocks: int, device: str | torch.device = "cpu",
                 pin_memory: bool = False, null_block: bool = False, shm: bool = False):
        """null_block: keep one extra zeroed block at id `num_blocks` (see `null_block_id`).
        shm: a CPU pool in a /dev/shm file (`shm_path`) that same-node peers can read."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.layout = layout
        self.num_blocks = num_blocks
        self.device = torch.device(device)
        self.shm_path: str | None = None
        # (N + 1, L, 2, B, H, D) with a null block, else (N, L, 2, B, H, D)
        shape = (num_blocks + int(null_block), *layout.block_shape())
        if shm and self.device.type == "cpu":
            from kvcache.shm_pool import shm_tensor

            self._blocks, self.shm_path = shm_tensor(shape, layout.torch_dtype)
        else:
            self._blocks = torch.zeros(shape, dtype=layout.torch_dtype, device=self.device,
                                       pin_memory=pin_memory and self.device.type == "cpu")
        self.data = self._blocks[:num_blocks]  # (N, L, 2, B, H, D): the real blocks only
        # each layer's (keys, values) views, made once (slicing them again cost 3.8 us a layer,
        # 0.1 ms of a 17 ms one-sequence SmolLM2 decode step; a cached pair costs 0.07 us)
        self._layer_views = [(self._blocks[:, i, 0], self._blocks[:, i, 1]) for i in range(layout.num_layers)]
        self.null_block_id: int | None = num_blocks if null_block else None
        # the real blocks' bytes as one flat view, made once (a transfer slices it per run of
        # blocks: 0.3 us, where slicing the tensor and viewing it again cost about 10 us)
        self._bytes = (memoryview(self.data.view(torch.uint8).numpy()).cast("B")
                       if self.device.type == "cpu" else None)

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.layout.block_size

    def _check_block(self, block: int, what: str = "block") -> None:
        # Negative ids would wrap around in torch indexing and touch another block silently.
        if not 0 <= block < self.num_blocks:
            raise ValueError(f"{what} {block} outside 0..{self.num_blocks - 1}")

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} outside 0..{self.num_slots - 1}")

    def layer_view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Strided (N, B, H, D) views of one layer's keys and values ((N + 1, B, H, D) with the
        null block, which attention may read as padding; it stays zero because no slot is in it)."""
        if not 0 <= layer < self.layout.num_layers:
            raise ValueError(f"layer {layer} outside 0..{self.layout.num_layers - 1}")
        return self._layer_views[layer]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks src -> dst inside this pool (copy-on-write)."""
        if not pairs:
            return
        for s, d in pairs:
            self._check_block(s, "source block")
            self._check_block(d, "destination block")
        src = torch.tensor([p[0] for p in pairs], device=self.device)
        dst = torch.tensor([p[1] for p in pairs], device=self.device)
        self.data[dst] = self.data[src]

    def write_slot(self, slot: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write one token's K and V, each (L, H, D), at physical slot block*B + offset."""
        self._check_slot(slot)
        want = (self.layout.num_layers, self.layout.num_kv_heads, self.layout.head_dim)
        if tuple(k.shape) != want or tuple(v.shape) != want:  # no silent broadcast over layers
            raise ValueError(f"k and v must be (L, H, D) = {want}, got {tuple(k.shape)} and {tuple(v.shape)}")
        b, off = divmod(slot, self.layout.block_size)
        self.data[b, :, 0, off] = k
        self.data[b, :, 1, off] = v

    def read_slots(self, slots: list[int]) -> torch.Tensor:
        """Gather tokens at physical slots: returns (T, L, 2, H, D)."""
        if len(slots) and not 0 <= min(slots) <= max(slots) < self.num_slots:
            raise ValueError(f"slots must lie in 0..{self.num_slots - 1}, "
                             f"got min {min(slots)} max {max(slots)}")
        idx = torch.tensor(slots, dtype=torch.long, device=self.device)
        blocks, offs = idx // self.layout.block_size, idx % self.layout.block_size
        return self.data[blocks, :, :, offs]  # (T, L, 2, H, D)

    def shm_offset(self, buf) -> int | None:
        """Byte offset of host buffer `buf` inside this pool's /dev/shm file (None: not in it)."""
        if self.shm_path is None:
            return None
        arr = np.frombuffer(buf, dtype=np.uint8)
        start = arr.ctypes.data - self._blocks.data_ptr()
        size = self._blocks.numel() * self._blocks.element_size()
        return start if arr.nbytes and 0 <= start and start + arr.nbytes <= size else None

    def block_bytes_view(self, block: int, count: int = 1) -> memoryview:
        """Raw bytes of `count` physically adjacent blocks starting at `block` (CPU pools only)."""
        if self.device.type != "cpu":
            raise ValueError("byte views exist only for CPU pools; stage device blocks first")
        if count < 1 or not 0 <= block <= self.num_blocks - count:
            raise ValueError(f"blocks {block}..{block + count - 1} outside 0..{self.num_blocks - 1}")
        n = self.layout.block_bytes
        return self._bytes[block * n:(block + count) * n]
