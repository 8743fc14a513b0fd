"""Where a benchmark ran (convention 16), for the JSON of `bench engine`, `bench decode`, `bench
migrate` and `bench weights`. `describe(engine=None)` returns: the CPU (model, vendor, family, the
flags that decide the kernels' code: avx2, fma, f16c, avx512*, amx*); the compiler and the
architecture `-march=native` resolved to; the instruction sets the code was held to (the kernels'
-march, torch's CPU capability, and any variable of ISA_VARIABLES that lowers them); logical and
physical cores and the process's CPU affinity; torch's intra/inter-op threads and the OpenMP
threads the compiled kernels are handed (engine.cpu_attention passes torch.get_num_threads() to
each call); the memory copy bandwidth measured now (median of a few copies of a 256 MiB float32
tensor, read + write bytes counted); the device; and which path each op takes: the compiled
kernels loaded or not, and, given an engine, what its attention, elementwise steps, projections
and logits actually run through. `summary(d)` is the one line the benches print.
"""

from __future__ import annotations

import os
import platform
import re
import statistics
import subprocess
import time
from pathlib import Path

import torch

FLAG_PATTERN = re.compile(r"^(avx2|fma|f16c|avx512\w*|avx_vnni|amx\w*)$")
# variables that hold code below what the CPU has: the kernels' -march, torch's dispatch, oneDNN, MKL
ISA_VARIABLES = ("PDSERVE_KERNEL_MARCH", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA",
                 "MKL_ENABLE_INSTRUCTIONS")
COPY_BYTES = 256 << 20


def _cpuinfo() -> dict:
    """First processor's fields of /proc/cpuinfo (empty off Linux)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.split("\n\n")[0].splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields


def _physical_cores() -> int | None:
    """Distinct (package, core) pairs in sysfs: hyperthread siblings count once."""
    cores = set()
    for topo in Path("/sys/devices/system/cpu").glob("cpu[0-9]*/topology"):
        try:
            cores.add(((topo / "physical_package_id").read_text().strip(),
                       (topo / "core_id").read_text().strip()))
        except OSError:
            continue
    return len(cores) or None


def _compiler() -> dict:
    """The kernels' compiler ($CC, else cc): its version line and what -march=native means here."""
    cc = os.environ.get("CC", "cc")
    out = {"cc": cc, "version": None, "march_native": None}
    try:
        out["version"] = subprocess.run([cc, "--version"], capture_output=True, text=True,
                                        timeout=10).stdout.splitlines()[0]
        target = subprocess.run([cc, "-march=native", "-Q", "--help=target"], capture_output=True, text=True,
                                timeout=10).stdout
        found = re.search(r"^\s*-march=\s*(\S+)", target, re.M)
        out["march_native"] = found.group(1) if found else None
    except (OSError, subprocess.SubprocessError, IndexError):
        pass
    return out


def copy_bandwidth(nbytes: int = COPY_BYTES, repeats: int = 5) -> float:
    """GB/s of a large float32 copy (bytes read + bytes written, over the median time)."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch every page first
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / statistics.median(times) / 1e9


def kernel_march() -> str:
    """The -march the compiled kernels are built for (engine.cpu_kernels.MARCH)."""
    from engine import cpu_kernels

    return cpu_kernels.MARCH


def kernels_loaded() -> dict:
    """Which compiled CPU libraries and packed-GEMM backends are usable in this process."""
    from engine import cpu_attention, cpu_fused, cpu_gemm, cpu_gguf, cpu_kernels, cpu_lowp

    return {"paged_decode": cpu_attention.available(), "fused": cpu_fused.available(),
            "lowp_gemv": cpu_lowp.available(), "gguf_gemv": cpu_gguf.available(),
            "gguf_q8": cpu_gguf.available("q8"), "onednn_packed": cpu_gemm.available(),
            "decode_layers": cpu_kernels.load("decode_layers") is not None}


def engine_paths(engine) -> dict:
    """The path each op of a loaded LLMEngine takes (what its model and workspace were set up with)."""
    from engine.cpu_gemm import Projection

    model = engine.model
    projections = [m for m in model.modules() if isinstance(m, Projection)]
    lowp = sum(getattr(m, "lowp", None) is not None for m in projections)
    packed = sum(m.packed is not None for m in projections)
    fused = bool(getattr(model.norm, "fused", False))
    return {"attention_backend": engine.backend.name,
            "decode_attention": "cpu_kernel (paged_decode, pool in place)" if engine.workspace.kernel else
            "torch mirror" if engine.workspace.mirror is not None else "torch gather",
            "elementwise": "cpu_fused (rms_norm, rotary, silu_mul)" if fused else "torch",
            "weights": getattr(engine.config, "weights", "f32"),
            "decode_layers": "C (engine.cpu_decode_layers, decode steps of at most "
                             f"{model.decode_layers.max_rows} rows)" if getattr(model, "decode_layers", None)
                             is not None else "python",
            "projections": {"total": len(projections), "lowp_gemv_small_rows": lowp, "onednn_packed": packed,
                            "f_linear": len(projections) - packed},
            "logits": "lowp_gemv (small rows)" if getattr(model, "logits_lowp", None) is not None else
            "onednn_packed" if model.logits_packed is not None else "f_linear",
            "weight_dtype": str(model.embed_tokens.weight.dtype).removeprefix("torch.")}


def describe(engine=None, bandwidth: bool = True) -> dict:
    """Everything above as one JSON-able dict; `engine` adds its per-op paths."""
    info = _cpuinfo()
    flags = sorted(f for f in info.get("flags", "").split() if FLAG_PATTERN.match(f))
    threads = torch.get_num_threads()
    out = {"cpu": {"model": info.get("model name") or platform.processor(), "vendor": info.get("vendor_id"),
                   "family": info.get("cpu family"), "model_number": info.get("model"), "flags": flags,
                   "machine": platform.machine()},
           "cores": {"logical": os.cpu_count(), "physical": _physical_cores(),
                     "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None},
           "threads": {"torch": threads, "torch_interop": torch.get_num_interop_threads(),
                       "kernel_openmp": threads, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")},
           "compiler": _compiler(),
           "isa": {"kernel_march": kernel_march(),
                   "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
                   "overrides": {v: os.environ[v] for v in ISA_VARIABLES if os.environ.get(v)}},
           "memory_copy_gb_per_s": copy_bandwidth() if bandwidth else None,
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "torch": torch.__version__,
           "kernels": kernels_loaded()}
    if engine is not None:
        out["paths"] = engine_paths(engine)
    return out


def summary(d: dict) -> str:
    """One line: CPU, flags, cores, threads, bandwidth, kernels."""
    cpu, cores, th = d["cpu"], d["cores"], d["threads"]
    avx512 = any(f.startswith("avx512") for f in cpu["flags"])
    simd = "avx512" if avx512 else "avx2+fma" if {"avx2", "fma"} <= set(cpu["flags"]) else "no avx2"
    bw = d.get("memory_copy_gb_per_s")
    kernels = ",".join(k for k, on in d["kernels"].items() if on) or "none"
    paths = d.get("paths")
    extra = f"; weights {paths['weights']}, attention {paths['decode_attention'].split()[0]}" if paths else ""
    copy = f"copy {bw:.1f} GB/s" if bw else "copy n/a"
    march = d["compiler"]["march_native"]
    held = d.get("isa", {}).get("overrides")
    held = f", held to {' '.join(f'{k}={v}' for k, v in held.items())}" if held else ""
    return (f"machine: {cpu['model']} (family {cpu['family']}, {simd}, march {march}{held}), "
            f"{cores['physical']} cores / {cores['logical']} cpus (affinity {cores['affinity']}), "
            f"torch threads {th['torch']}, kernel OpenMP {th['kernel_openmp']}, {copy}; "
            f"kernels {kernels}{extra}")
