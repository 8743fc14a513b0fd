"""Builds and loads the compiled CPU kernels in engine/csrc, once per machine, at first use.

Each library is one C file (plus the shared vec16.h) compiled with the system C compiler ($CC,
else `cc`) and -O3 -march=native ($PDSERVE_KERNEL_MARCH names another target, e.g. x86-64-v3 to
run the AVX2 code on an AVX-512 machine), into a cache directory ($PDSERVE_KERNEL_CACHE, else
~/.cache/pdserve/kernels) under a name that hashes the sources, the flags and the CPU's model and
flags, so a shared home directory never hands one machine another's binary. A build goes to a
temporary file renamed into place, so concurrent processes never load half a library. Callers
use the result through ctypes with tensors' data pointers (engine.cpu_attention,
engine.cpu_fused, engine.cpu_lowp, engine.cpu_gguf), after checking every dtype, shape and
stride themselves. Without a compiler, or with PDSERVE_CPU_KERNEL=0, `load` returns None and
logs why once; the engine then keeps its torch paths.
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
from pathlib import Path

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
MARCH = os.environ.get("PDSERVE_KERNEL_MARCH") or "native"
COMMON = ["-O3", f"-march={MARCH}", "-fno-math-errno", "-shared", "-fPIC", "-std=c11", f"-I{CSRC}"]
# per library: its extra flags and its functions' ctypes signatures (argument types, result type)
_P, _I, _F, _C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
LIBRARIES = {
    "paged_decode": (["-fopenmp"], {
        "pd_paged_decode_f32": ([_P, _I, _P, _P, _I, _I, _I, _P, _I, _P, _I, _I, _I, _I, _I, _F, _C, _P],
                                _C)}),
    # no fused multiply-add where torch rounds the product first (cpu_fused matches its rounding)
    "fused": (["-ffp-contract=off"], {
        "pd_rms_norm_f32": ([_P, _I, _P, _I, _P, _I, _I, _F, _P], None),
        "pd_rotary_f32": ([_P, _I, _I, _I, _I, _P, _P, _I], None),
        "pd_silu_mul_f32": ([_P, _I, _I, _I, _P], None),
        "pd_store_kv_f32": ([_P, _P, _I, _I, _I, _P, _P, _I, _I, _I, _I, _P, _P], _C)}),
    # float32 sums of bf16/int8 weights (engine.cpu_lowp): fused multiply-adds wanted here
    "lowp_gemv": (["-fopenmp", "-ffp-contract=fast"], {
        "pd_gemv_bf16": ([_P, _I, _P, _I, _P, _I, _I, _I, _P, _I, _C], _C),
        "pd_gemv_int8": ([_P, _I, _P, _I, _P, _P, _I, _I, _I, _P, _I, _C], None)}),
    # float32 sums of a GGUF file's own Q4_1/Q8_0 blocks (engine.cpu_gguf)
    "gguf_gemv": (["-fopenmp", "-ffp-contract=fast"], {
        "pd_gemv_q4_1": ([_P, _I, _P, _I, _P, _I, _I, _I, _P, _I, _C], _C),
        "pd_gemv_q8_0": ([_P, _I, _P, _I, _P, _I, _I, _I, _P, _I, _C], _C)}),
    # the same blocks against x rounded to int8 blocks: integer dot products (engine.cpu_gguf, act q8)
    "gguf_q8": (["-fopenmp", "-ffp-contract=fast"], {
        "pd_gemv_q4_1_q8": ([_P, _I, _P, _I, _P, _I, _I, _I, _P, _I, _C], _C),
        "pd_gemv_q8_0_q8": ([_P, _I, _P, _I, _P, _I, _I, _I, _P, _I, _C], _C),
        "pd_quantize_q8": ([_P, _I, _I, _I, _P, _P, _P], None),
        "pd_gguf_q8_simd": ([], _C)}),
    # a decode step's decoder layers, calling the kernels above through pointers (engine.cpu_decode_layers)
    "decode_layers": (["-ffp-contract=off"], {
        "pd_decode_layers": ([_P, _P], _C),
        "pd_decode_scratch": ([_P, _I], _I)}),
}


def _cpu_signature() -> str:
    """The CPU's model and flag lines: -march=native code is only valid where they match."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() + platform.machine()
    return "\n".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags"))}))


def _cache_dir() -> Path:
    return Path(os.environ.get("PDSERVE_KERNEL_CACHE") or Path.home() / ".cache" / "pdserve" / "kernels")


def _build(name: str, compiler: str) -> Path:
    """Compile library `name` (once per sources, flags and CPU) and return its path."""
    source = CSRC / f"{name}.c"
    flags = COMMON + LIBRARIES[name][0]
    digest = hashlib.sha256(source.read_bytes() + (CSRC / "vec16.h").read_bytes())
    digest.update(" ".join([compiler, *flags]).encode() + _cpu_signature().encode())
    target = _cache_dir() / f"{name}-{digest.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *flags, str(source), "-o", tmp, "-lm"], check=True, capture_output=True,
                       text=True, timeout=120)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def require(name: str, what: str) -> ctypes.CDLL:
    """`load(name)`, or RuntimeError naming `what` when it is not available."""
    lib = load(name)
    if lib is None:
        raise RuntimeError(f"the {what} are not available")
    return lib


@functools.cache
def load(name: str) -> ctypes.CDLL | None:
    """Library `name` of LIBRARIES with its signatures set, or None (no compiler, a failed build,
    or PDSERVE_CPU_KERNEL=0)."""
    if os.environ.get("PDSERVE_CPU_KERNEL", "1") == "0":
        return None
    compiler = os.environ.get("CC", "cc")
    try:
        lib = ctypes.CDLL(str(_build(name, compiler)))
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("CPU kernel %s unavailable (%s): %s; using the torch paths", name, compiler,
                    getattr(e, "stderr", "") or e)
        return None
    for function, (args, result) in LIBRARIES[name][1].items():
        getattr(lib, function).argtypes = args
        getattr(lib, function).restype = result
    return lib
