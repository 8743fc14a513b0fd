"""CPU decode attention through a small compiled C kernel that reads the paged pool in place.

`paged_decode(q, k_cache, v_cache, tables, lens, scale)` attends one query per sequence over its
own blocks only (engine/csrc/paged_decode.c): no padding to the longest sequence, no history copy,
no per-slot mirror. The C file is compiled once per machine at first use with the system C
compiler ($CC, else `cc`; -O3 -march=native -fopenmp) into a cache directory
($PDSERVE_KERNEL_CACHE, else ~/.cache/pdserve/kernels) under a name that hashes the source, the
flags and the CPU's model and flags, so a shared home directory never hands one machine another's
binary; a build goes to a temporary file renamed into place, so concurrent processes never load
half a library. It is called through ctypes with the tensors' data pointers, after every dtype,
shape and stride is checked here. Without a compiler (or with PDSERVE_CPU_KERNEL=0) `load`
returns None, logs why once, and the torch backend keeps its torch paths. float32 on CPU only.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.attn_metadata import int64_tensor

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "paged_decode.c"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC", "-std=c11"]
_ARGS = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
         ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
         ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_float, ctypes.c_int, ctypes.c_void_p]


class KernelError(RuntimeError):
    """The kernel is not available, or ran out of scratch memory."""


def _cpu_signature() -> str:
    """The CPU's model and flag lines: -march=native code is only valid where they match."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() + platform.machine()
    return "\n".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags"))}))


def _cache_dir() -> Path:
    root = os.environ.get("PDSERVE_KERNEL_CACHE") or Path.home() / ".cache" / "pdserve" / "kernels"
    return Path(root)


def _build(compiler: str) -> Path:
    """Compile SOURCE (once per source, flags and CPU) and return the library's path."""
    key = hashlib.sha256(b"\0".join([SOURCE.read_bytes(), " ".join([compiler, *FLAGS]).encode(),
                                     _cpu_signature().encode()])).hexdigest()[:16]
    target = _cache_dir() / f"paged_decode-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", tmp, "-lm"], check=True, capture_output=True,
                       text=True, timeout=120)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled kernel, or None (no compiler, a failed build, or PDSERVE_CPU_KERNEL=0)."""
    if os.environ.get("PDSERVE_CPU_KERNEL", "1") == "0":
        return None
    compiler = os.environ.get("CC", "cc")
    try:
        lib = ctypes.CDLL(str(_build(compiler)))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or e
        log.warning("CPU decode attention kernel unavailable (%s %s): %s; using the torch paths", compiler,
                    SOURCE.name, detail)
        return None
    lib.pd_paged_decode_f32.argtypes = _ARGS
    lib.pd_paged_decode_f32.restype = ctypes.c_int
    return lib


def supports_head_dim(head_dim: int) -> bool:
    """The kernel works in vectors of 16 floats and keeps up to 256 of them per query head."""
    return head_dim % 16 == 0 and 0 < head_dim <= 256


@dataclass(frozen=True)
class DecodeBatch:
    """One step's decode sequences for the kernel, checked once (every layer reuses it)."""

    tables: torch.Tensor  # (n, W) int64 block ids, rows padded with the last real one
    lens: torch.Tensor    # (n,) int64 keys each sequence attends
    block_size: int
    max_block: int        # the largest block id named (the pool must hold it)

    @staticmethod
    def build(tables: list[list[int]], lens: list[int], block_size: int) -> DecodeBatch:
        """From host lists: sequence i attends keys 0..lens[i]-1 through tables[i]."""
        if len(tables) != len(lens):
            raise ValueError("one table per length")
        width = max((len(t) for t in tables), default=1)
        flat: list[int] = []
        for table, n in zip(tables, lens):
            if not 1 <= n <= len(table) * block_size:
                raise ValueError(f"length {n} outside 1..{len(table) * block_size} for {len(table)} blocks")
            if min(table) < 0:
                raise ValueError("negative block id")
            flat += table + [table[-1]] * (width - len(table))
        return DecodeBatch(int64_tensor(flat, torch.device("cpu")).view(len(tables), width),
                           int64_tensor(lens, torch.device("cpu")), block_size,
                           max((max(t) for t in tables), default=0))


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: DecodeBatch,
                 scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """q (n, Hq, D) float32, one query per sequence of `batch`; k_cache/v_cache (N, B, Hkv, D)
    float32 views with equal strides and contiguous (Hkv, D) rows -> out (n, Hq, D) (written into
    `out` when given, which must be contiguous)."""
    lib = load()
    if lib is None:
        raise KernelError("the CPU decode attention kernel is not available")
    n, Hq, D = q.shape
    N, B, Hkv, _ = k_cache.shape
    if q.dtype != torch.float32 or k_cache.dtype != torch.float32 or v_cache.dtype != torch.float32:
        raise TypeError("paged_decode takes float32 q and caches")
    if q.device.type != "cpu" or k_cache.device.type != "cpu" or v_cache.device.type != "cpu":
        raise ValueError("paged_decode runs on CPU tensors")
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1 \
            or k_cache.stride(2) != D or q.shape[2] != k_cache.shape[3]:
        raise ValueError("k_cache and v_cache need one shape, equal strides and contiguous (Hkv, D) rows")
    if Hq % Hkv:
        raise ValueError(f"{Hq} query heads do not group over {Hkv} kv heads")
    if not supports_head_dim(D):
        raise ValueError(f"head size {D} is not a multiple of 16 up to 256")
    if batch.lens.shape != (n,) or batch.block_size != B or batch.max_block >= N:
        raise ValueError(f"the batch ({batch.lens.shape[0]} sequences, blocks of {batch.block_size}, block "
                         f"{batch.max_block}) does not fit q ({n} rows) and the pool ({N} x {B})")
    if q.stride(2) != 1 or q.stride(1) != D:
        q = q.contiguous()
    if out is None:
        out = torch.empty(n, Hq, D, dtype=torch.float32)
    elif out.shape != (n, Hq, D) or not out.is_contiguous() or out.dtype != torch.float32:
        raise ValueError("out must be a contiguous float32 (n, Hq, D) tensor")
    if n == 0:
        return out
    tables = batch.tables
    code = lib.pd_paged_decode_f32(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                                   k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), tables.data_ptr(),
                                   tables.stride(0), batch.lens.data_ptr(), n, Hq, Hkv, D, B, scale,
                                   torch.get_num_threads(), out.data_ptr())
    if code:
        raise KernelError("the kernel could not allocate its scratch memory" if code == 2 else
                          f"the kernel refused head size {D}")
    return out
