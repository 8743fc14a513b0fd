"""A GGUF file's metadata and tensors, read in one pass (model_files.gguf builds on it). GGUF v2/v3,
little-endian: a header, key-value metadata (numbers, bools, strings, arrays of them), tensor infos
(name, dims with the fastest-varying first, ggml type, offset), then the aligned tensor data, mapped
read-only. The `gguf` package's GGUFReader does the same but parses each of a tokenizer's ~100k
strings through several numpy views: 2.4 s for SmolLM2-135M's file against about 0.1 s here. Its
type table (GGML_QUANT_SIZES) is still the one used. `dequantize` widens Q4_1 and Q8_0 blocks to
float32 with whole-tensor numpy operations, the same values as gguf.quants (d * q is exact in
float32, d * q + m rounds once, at the addition, in both), and hands other types to gguf.quants.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass

import numpy as np

MAGIC = b"GGUF"
MAX_DIMS = 4      # ggml's GGML_MAX_DIMS
MAX_NESTING = 8   # arrays of arrays: deeper is refused, not recursed into
# GGUF metadata value types -> struct format (8: string, 9: array are read apart)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_PLAIN = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
          "I32": np.int32, "I64": np.int64}  # stored element by element, not in blocks


class GGUFFormatError(ValueError):
    """Bytes that are not a GGUF file this reader understands."""


@dataclass(frozen=True)
class Tensor:
    name: str
    type_name: str          # ggml type: "F32", "Q4_1", ...
    dims: tuple[int, ...]   # as stored: fastest-varying first (dims[0] is a row's length)
    data: np.ndarray        # read-only view: plain types (dims reversed); block types uint8 (..., row bytes)


class GGUFContents:
    """The metadata (`fields`: key -> int, float, bool, str or list) and `tensors` of one file."""

    def __init__(self, path: str):
        with open(path, "rb") as f:
            try:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError as e:  # an empty file
                raise GGUFFormatError(f"cannot map the file: {e}") from None
        self._buf, self._pos = memoryview(self._map), 0
        try:
            self._parse()
        except BaseException:
            self.tensors = []
            try:
                self._buf.release()
                self._map.close()
            except BufferError:  # a tensor viewed before the error still holds the map: GC closes it
                pass
            raise

    def _parse(self) -> None:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        buf = self._buf
        if bytes(buf[:4]) != MAGIC:
            raise GGUFFormatError(f"no GGUF magic (starts with {bytes(buf[:4])!r})")
        version, n_tensors, n_fields = self._unpack("<4xIQQ", 24)
        if version not in (2, 3):
            raise GGUFFormatError(f"GGUF version {version} is unsupported (2 and 3 are; a big-endian "
                                  "file reads as a huge version)")
        self.fields: dict[str, object] = {}
        for _ in range(n_fields):
            key = self._string()
            (kind,) = self._unpack("<I", 4)
            if key in self.fields:
                raise GGUFFormatError(f"metadata key {key!r} appears twice")
            self.fields[key] = self._value(kind)
        infos, names = [], set()
        for _ in range(n_tensors):
            name = self._string()
            (n_dims,) = self._unpack("<I", 4)
            if not 1 <= n_dims <= MAX_DIMS:
                raise GGUFFormatError(f"tensor {name!r} has {n_dims} dimensions (1 to {MAX_DIMS} are valid)")
            dims = self._unpack(f"<{n_dims}Q", 8 * n_dims)
            kind, offset = self._unpack("<IQ", 12)
            if name in names:
                raise GGUFFormatError(f"tensor {name!r} appears twice")
            names.add(name)
            infos.append((name, dims, kind, offset))
        align = self.fields.get("general.alignment", 32)
        if type(align) is not int or align <= 0 or align & (align - 1):
            raise GGUFFormatError(f"general.alignment {align!r} is not a power of two")
        start = -(-self._pos // align) * align
        self.tensors: list[Tensor] = []
        for name, dims, kind, offset in infos:
            try:
                qtype = GGMLQuantizationType(kind)
            except ValueError:
                raise GGUFFormatError(f"tensor {name!r} has an unknown ggml type {kind}") from None
            block, nbytes = GGML_QUANT_SIZES[qtype]
            count = math.prod(dims)
            shape = tuple(reversed(dims))
            plain = _PLAIN.get(qtype.name)
            if plain is None:  # rows of blocks, as bytes
                if dims[0] % block:
                    raise GGUFFormatError(f"tensor {name!r}: rows of {dims[0]}: partial {qtype.name} blocks")
                row_bytes = dims[0] // block * nbytes
                shape, dtype, count = (*shape[:-1], row_bytes), np.uint8, count // block * nbytes
            else:
                dtype = plain
            at = start + offset
            if at + count * np.dtype(dtype).itemsize > len(buf):
                raise GGUFFormatError(f"tensor {name!r} runs past the end of the file")
            data = np.frombuffer(buf, dtype=dtype, count=count, offset=at).reshape(shape)
            self.tensors.append(Tensor(name, qtype.name, tuple(dims), data))

    # ---- parsing ------------------------------------------------------------------------------
    def _unpack(self, fmt: str, size: int) -> tuple:
        if self._pos + size > len(self._buf):
            raise GGUFFormatError("the file ends inside its metadata")
        out = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += size
        return out

    def _string(self) -> str:
        (n,) = self._unpack("<Q", 8)
        if self._pos + n > len(self._buf):
            raise GGUFFormatError("the file ends inside a string")
        raw = bytes(self._buf[self._pos:self._pos + n])
        self._pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise GGUFFormatError(f"a metadata string is not UTF-8: {e}") from None

    def _value(self, kind: int, depth: int = 0):
        if kind == 8:
            return self._string()
        if kind == 9:
            if depth >= MAX_NESTING:
                raise GGUFFormatError(f"metadata arrays nested deeper than {MAX_NESTING}")
            item, count = self._unpack("<IQ", 12)
            if item == 8:
                return [self._string() for _ in range(count)]
            if item in _NUMPY:
                size = np.dtype(_NUMPY[item]).itemsize * count
                if self._pos + size > len(self._buf):
                    raise GGUFFormatError("the file ends inside an array")
                out = np.frombuffer(self._buf, _NUMPY[item], count, self._pos).tolist()
                self._pos += size
                return out
            return [self._value(item, depth + 1) for _ in range(count)]  # arrays of arrays
        if kind not in _SCALARS:
            raise GGUFFormatError(f"unknown metadata value type {kind}")
        fmt = "<" + _SCALARS[kind]
        return self._unpack(fmt, struct.calcsize(fmt))[0]


def dequantize(t: Tensor) -> np.ndarray:
    """Tensor t as a new, writable float32 array shaped as its dims reversed (rows, row length)."""
    shape = tuple(reversed(t.dims))
    if t.type_name in _PLAIN:
        return np.array(t.data, dtype=np.float32)
    if t.type_name in ("Q4_1", "Q8_0"):  # in place on one output array: 7x the speed of temporaries
        blocks = t.data.reshape(-1, 20 if t.type_name == "Q4_1" else 34)
        out = np.empty((blocks.shape[0], 32), np.float32)  # (blocks, 32)
        if t.type_name == "Q4_1":  # f16 d, f16 m, 16 bytes; byte b: elements b (low nibble), b + 16 (high)
            qs = blocks[:, 4:]
            np.bitwise_and(qs, 15, out=out[:, :16], casting="unsafe")
            np.right_shift(qs, 4, out=out[:, 16:], casting="unsafe")
            out *= blocks[:, 0:2].view(np.float16).astype(np.float32)  # (blocks, 1)
            out += blocks[:, 2:4].view(np.float16).astype(np.float32)
        else:  # f16 d, 32 int8
            out[:] = blocks[:, 2:].view(np.int8)
            out *= blocks[:, 0:2].view(np.float16).astype(np.float32)
        return out.reshape(shape)
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize as slow

    return np.array(slow(t.data, GGMLQuantizationType[t.type_name]), dtype=np.float32).reshape(shape)
