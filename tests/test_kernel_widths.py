"""The vec16 kernels give the same bits whatever vector width they were compiled for.

engine/csrc/vec16.h writes every sum in one lane order, so the AVX2 build (8-wide registers, sums
kept as two halves) and the AVX-512 build (16-wide) of the decode attention, RMSNorm and SwiGLU
must agree bit for bit. Each build runs in its own process (PDSERVE_KERNEL_MARCH picks the target;
the library cache is keyed by the flags) on the same seeded inputs, and the outputs' digests are
compared. On a machine without AVX-512 both builds are 8-wide and the test still checks that the
named target builds and runs. It needs a C compiler and an x86-64 CPU with AVX2 and FMA.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from engine import cpu_attention

SCRIPT = r"""
import hashlib, random, torch
from engine import cpu_attention, cpu_fused
from kvcache.storage import KVLayout, KVStorage

torch.set_num_threads(1)
digest = hashlib.sha256()
gen = torch.Generator().manual_seed(0)
for head_dim, group, kv_heads, block, lens in [(64, 3, 3, 16, [1, 5, 16, 17, 255, 513]),
                                               (128, 4, 2, 8, [3, 64, 100]), (32, 1, 1, 1, [7, 33])]:
    rng = random.Random(head_dim)
    need = sum(-(-n // block) for n in lens)
    storage = KVStorage(KVLayout(2, kv_heads, head_dim, block), need + 1, null_block=True)
    storage.data.copy_(torch.randn(storage.data.shape, generator=gen) * 4)  # peaky softmax too
    ids = list(range(need + 1))
    rng.shuffle(ids)
    tables = [[ids.pop() for _ in range(-(-n // block))] for n in lens]
    q = torch.randn(len(lens), kv_heads * group, head_dim, generator=gen)
    k, v = storage.layer_view(1)
    out = cpu_attention.paged_decode(q, k, v, cpu_attention.DecodeBatch.build(tables, lens, block),
                                     head_dim ** -0.5)
    digest.update(out.numpy().tobytes())
for dim in (576, 100, 16):
    x = torch.randn(5, dim, generator=gen) * 3
    digest.update(cpu_fused.rms_norm(x, torch.randn(dim, generator=gen), 1e-5).numpy().tobytes())
    gate_up = torch.randn(5, 2 * dim, generator=gen) * 20  # e^x saturates both ways
    digest.update(cpu_fused.silu_mul(gate_up).numpy().tobytes())
print(digest.hexdigest())
"""


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(ln.split(":", 1)[1].split()) for ln in f if ln.startswith("flags")), set())
    except OSError:
        return set()


def _digest(march: str | None, cache: str) -> str:
    env = dict(os.environ, PDSERVE_KERNEL_CACHE=cache)
    env.pop("PDSERVE_KERNEL_MARCH", None)
    if march:
        env["PDSERVE_KERNEL_MARCH"] = march
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1]


X86_V3 = platform.machine() in ("x86_64", "AMD64") and {"avx2", "fma", "f16c"} <= _cpu_flags()


@pytest.mark.skipif(not X86_V3, reason="needs an x86-64 CPU with AVX2, FMA and F16C")
@pytest.mark.skipif(not cpu_attention.available(), reason="no C compiler for the kernels")
def test_avx2_and_native_builds_give_the_same_bits(tmp_path):
    native = _digest(None, str(tmp_path / "native"))
    avx2 = _digest("x86-64-v3", str(tmp_path / "avx2"))
    assert len(native) == 64
    assert avx2 == native, "the AVX2 build of the vec16 kernels differs from the native build"
