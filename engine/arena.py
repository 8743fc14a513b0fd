"""One anonymous memory mapping, advised for transparent huge pages, holding weights a decode step streams.

A decode step reads every weight once, front to back. Spread over ordinary 4 KiB pages (where
Linux gives huge pages only on request: `transparent_hugepage` set to `madvise`, as on this
project's machines), the reads miss the TLB every 4 KiB and the hardware prefetcher stops at
every page boundary: one thread here read 96 MB at 11-12 GB/s from 4 KiB pages and 15 GB/s from
2 MiB ones, and the GGUF block kernels went 5-15% faster. `into_arena` copies tensors into one
mapping advised MADV_HUGEPAGE (each at a 4 KiB boundary) and returns the copies, which keep the
mapping alive; where the advice is not available (other systems) the copies still work, on
ordinary pages.
"""

from __future__ import annotations

import logging
import mmap

import torch

log = logging.getLogger(__name__)

HUGE = 2 << 20  # bytes of a transparent huge page on x86-64 and arm64 (4 KiB base pages)
ALIGN = 4096  # each tensor starts at a page boundary


def into_arena(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Contiguous CPU copies of `tensors` (same dtypes and shapes) in one huge-page-advised mapping."""
    sizes = [t.numel() * t.element_size() for t in tensors]
    total = sum(-(-n // ALIGN) * ALIGN for n in sizes)
    if not total:
        return [t.contiguous() for t in tensors]
    region = mmap.mmap(-1, total + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = torch.frombuffer(region, dtype=torch.uint8)  # (total + HUGE,), holds `region`
    start = -base.data_ptr() % HUGE  # the first huge-page boundary
    try:
        region.madvise(mmap.MADV_HUGEPAGE, start, total)
    except (AttributeError, OSError, ValueError) as e:  # no MADV_HUGEPAGE here: ordinary pages
        log.info("weights arena without huge pages: %s", e)
    out, at = [], start
    for t, n in zip(tensors, sizes):
        view = base[at:at + n].view(t.dtype).view(t.shape)
        view.copy_(t)
        out.append(view)
        at += -(-n // ALIGN) * ALIGN
    return out
