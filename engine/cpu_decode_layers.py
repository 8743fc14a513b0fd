"""A decode step's decoder layers in one C call (engine/csrc/decode_layers.c), for GGUF and bf16 weights.

A decode step streams every weight once, which evicts the interpreter's working set from the
caches: each of the ~11 kernel calls a layer makes from Python then costs 20-40 us instead of
about 5 (SmolLM2: ~330 calls, 6-8 ms of a 20 ms step). `DecodeLayers` makes those calls from C,
through pointers to the same kernels (engine.cpu_fused, the projections' own, engine.cpu_attention),
in the same order, on the same buffers' worth of data, so the hidden states are bit for bit the
Python path's. It applies to a float32 CPU model whose every projection offers its C kernel
(`c_gemv`: engine.cpu_gguf.GgufLinear for `--weights gguf` and `gguf-q8`, engine.cpu_lowp's bf16
LowpLinear for `bf16`) with the fused kernels on, and to a step whose rows are all decode rows (one
query each, at most the projections' `max_rows`) served by the compiled attention kernel; anything
else returns False and the model runs its Python path. `build` returns None where the model does
not qualify (f32 or int8 weights, no compiler).
"""

from __future__ import annotations

import ctypes
import threading
import weakref

import torch

from engine import attn_torch, cpu_attention, cpu_fused, cpu_kernels

_I64, _PTR, _F = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float


class _Proj(ctypes.Structure):
    _fields_ = [("fn", _PTR), ("w", _PTR), ("ws", _I64), ("bias", _PTR), ("N", _I64), ("K", _I64)]


class _Layer(ctypes.Structure):
    _fields_ = [("in_norm", _PTR), ("post_norm", _PTR), ("qkv", _Proj), ("o", _Proj), ("gate_up", _Proj),
                ("down", _Proj), ("k_cache", _PTR), ("v_cache", _PTR)]


class _Model(ctypes.Structure):
    _fields_ = [(name, _I64) for name in ("num_layers", "H", "Hq", "Hkv", "D", "I", "num_blocks", "B", "sN",
                                          "sB", "sH")] + \
               [("eps", _F), ("scale", _F)] + \
               [(name, _PTR) for name in ("rms_norm", "rotary", "silu_mul", "store_kv", "decode")] + \
               [("layers", ctypes.POINTER(_Layer))]


class _Step(ctypes.Structure):
    _fields_ = [("T", _I64), ("h", _PTR), ("cos", _PTR), ("sin", _PTR), ("cs_stride", _I64),
                ("blocks", _PTR), ("offsets", _PTR), ("tables", _PTR), ("table_stride", _I64), ("lens", _PTR),
                ("scratch", _PTR), ("threads", ctypes.c_int)]


def _address(fn) -> int:
    return ctypes.cast(fn, _PTR).value


def _proj(linear) -> _Proj:
    return _Proj(*linear.c_gemv())


class DecodeLayers:
    """The C decode path of one model (see the module docstring). Not thread-safe (one scratch)."""

    def __init__(self, model, lib: ctypes.CDLL):
        c = model.config
        self.model, self.lib = model, lib
        self.max_rows = min(p.lowp.max_rows for p in _projections(model))
        fused, attention = cpu_kernels.load("fused"), cpu_kernels.load("paged_decode")
        self.fns = {"rms_norm": _address(fused.pd_rms_norm_f32), "rotary": _address(fused.pd_rotary_f32),
                    "silu_mul": _address(fused.pd_silu_mul_f32), "store_kv": _address(fused.pd_store_kv_f32),
                    "decode": _address(attention.pd_paged_decode_f32)}
        self.shape = dict(num_layers=c.num_layers, H=c.hidden_size, Hq=c.num_heads, Hkv=c.num_kv_heads,
                          D=c.head_dim, I=c.intermediate_size)
        self.eps, self.scale = c.rms_norm_eps, c.head_dim ** -0.5
        self._pool: tuple | None = None  # (weakref to the pool, its _Model, the layer table, data address)
        self._scratch = torch.empty(0)
        self._lock = threading.Lock()  # one scratch: engines sharing this model may step on two threads

    @staticmethod
    def build(model) -> DecodeLayers | None:
        """A DecodeLayers for `model`, or None where it does not apply."""
        lib = cpu_kernels.load("decode_layers")
        weight = model.embed_tokens.weight
        if lib is None or weight.dtype != torch.float32 or weight.device.type != "cpu" \
                or not cpu_fused.available() or cpu_kernels.load("paged_decode") is None:
            return None
        layers = model.layers
        if not all(la.input_layernorm.fused and la.self_attn.fused and la.mlp.fused for la in layers):
            return None
        if not all(callable(getattr(p.lowp, "c_gemv", None)) and p.lowp.c_gemv() is not None
                   for p in _projections(model)):
            return None
        return DecodeLayers(model, lib)

    def _model_for(self, kv) -> _Model:
        """The C model description over pool `kv` (rebuilt when another pool comes)."""
        k0, _ = kv.layer_view(0)
        if self._pool is not None and self._pool[0]() is kv and self._pool[3] == k0.data_ptr():
            return self._pool[1]
        N, B = k0.shape[:2]
        if k0.stride(3) != 1 or k0.stride(2) != self.shape["D"]:  # what store_kv and decode assume
            raise ValueError(f"K/V views must be (N, B, Hkv, D) with contiguous heads; strides {k0.stride()}")
        table = (_Layer * len(self.model.layers))()
        for i, layer in enumerate(self.model.layers):
            k, v = kv.layer_view(i)
            if k.stride() != k0.stride() or v.stride() != k0.stride():
                raise ValueError("every layer's K/V views must share one stride")
            att, mlp = layer.self_attn, layer.mlp
            table[i] = _Layer(layer.input_layernorm.weight.data_ptr(),
                              layer.post_attention_layernorm.weight.data_ptr(), _proj(att.qkv_proj.lowp),
                              _proj(att.o_proj.lowp), _proj(mlp.gate_up_proj.lowp), _proj(mlp.down_proj.lowp),
                              k.data_ptr(), v.data_ptr())
        desc = _Model(**self.shape, num_blocks=N, B=B, sN=k0.stride(0), sB=k0.stride(1), sH=k0.stride(2),
                      eps=self.eps, scale=self.scale, **self.fns, layers=table)
        self._pool = (weakref.ref(kv), desc, table, k0.data_ptr())  # the table lives as long as the desc
        return desc

    def run(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv, meta) -> bool:
        """h (T, hidden) float32 contiguous, updated in place through every decoder layer; cos, sin
        (T, D). False (h untouched) when this step is not for the C path."""
        T = h.shape[0]
        if not 0 < T <= self.max_rows or not h.is_contiguous() or cos.stride(1) != 1 \
                or cos.stride() != sin.stride() or meta.workspace is None:
            return False
        k0, _ = kv.layer_view(0)
        q = torch.empty(1).expand(T, self.shape["Hq"], self.shape["D"])  # (T, Hq, D): the plan reads it
        plan = attn_torch.decode_plan(meta, q, k0)
        step = plan.kernel
        if step is None or not plan.decode_only or plan.prefill or step.rows != slice(0, T):
            return False
        batch: cpu_attention.DecodeBatch = step.batch
        if batch.block_size != k0.shape[1] or batch.max_block >= k0.shape[0] or batch.lens.shape != (T,):
            raise ValueError(f"the decode batch (blocks of {batch.block_size}, block {batch.max_block}) does "
                             f"not fit the pool ({k0.shape[0]} x {k0.shape[1]})")
        with self._lock:
            desc = self._model_for(kv)
            need = self.lib.pd_decode_scratch(ctypes.byref(desc), T)
            if self._scratch.numel() < need:
                self._scratch = torch.empty(need)
            tables = batch.tables
            args = _Step(T, h.data_ptr(), cos.data_ptr(), sin.data_ptr(), cos.stride(0),
                         plan.slot_blocks.data_ptr(), plan.slot_offsets.data_ptr(), tables.data_ptr(),
                         tables.stride(0), batch.lens.data_ptr(), self._scratch.data_ptr(),
                         torch.get_num_threads())
            code = self.lib.pd_decode_layers(ctypes.byref(desc), ctypes.byref(args))
        if code:
            place = {1: "storing K/V (a slot outside the pool)", 2: "the attention kernel", 3: "a projection"}
            raise RuntimeError(f"decode layers failed in {place.get(code // 10, '?')} (code {code})")
        return True


def _projections(model) -> list:
    return [p for layer in model.layers for p in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                   layer.mlp.gate_up_proj, layer.mlp.down_proj)]
