"""model_files.gguf_reader against the `gguf` package it replaces for reading: the same metadata values
and tensor bytes for the shipped SmolLM2 file and for files GGUFWriter writes with every value
type, and the same float32 bits from `dequantize` as gguf.quants for any Q4_1 / Q8_0 blocks
(hypothesis: random bytes, so NaN, inf and subnormal scales too). Truncated or foreign bytes are a
GGUFFormatError, never a crash or a short tensor."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from smollm2_helpers import SKIP, smollm2_path

gguf = pytest.importorskip("gguf")

from model_files.gguf_reader import GGUFContents, GGUFFormatError, dequantize  # noqa: E402


def _same(path: str) -> GGUFContents:
    """Ours and GGUFReader agree on every field and tensor of the file at `path`."""
    ours, theirs = GGUFContents(path), gguf.GGUFReader(path)
    fields = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert ours.fields == fields
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, t in zip(ours.tensors, theirs.tensors):
        assert mine.type_name == t.tensor_type.name and mine.dims == tuple(int(d) for d in t.shape)
        assert mine.data.dtype == t.data.dtype and np.array_equal(mine.data, t.data), mine.name
        ref = np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        got = dequantize(mine)
        assert got.shape == ref.shape and np.array_equal(got.view(np.uint32), ref.view(np.uint32)), mine.name
    return ours


def _finish(writer) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@SKIP
def test_the_shipped_file_reads_as_gguf_reads_it():
    ours = _same(smollm2_path())
    assert len(ours.fields["tokenizer.ggml.tokens"]) == 49152
    assert {t.type_name for t in ours.tensors} == {"Q4_1", "Q8_0", "F32"}


def test_every_value_type_and_tensor_type_round_trips(tmp_path):
    path = str(tmp_path / "all.gguf")
    w = gguf.GGUFWriter(path, "llama")
    values = [("uint8", 200), ("int8", -5), ("uint16", 60000), ("int16", -3), ("uint32", 4_000_000_000),
              ("int32", -7), ("float32", 1.5), ("uint64", 1 << 60), ("int64", -(1 << 40)), ("float64", 0.1),
              ("bool", True), ("string", "Grüße ✓"), ("array", [1, -2, 3]), ("array", [0.5, 2.0]),
              ("array", [True, False]), ("array", ["a", "", "ü"])]  # (the writer drops an empty array)
    for i, (kind, value) in enumerate(values):
        getattr(w, f"add_{kind}")(f"t.{i}", value)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 64)).astype(np.float32)
    w.add_tensor("f32", x)
    w.add_tensor("f16", x.astype(np.float16))
    for kind in (gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0):
        w.add_tensor(kind.name.lower(), gguf.quants.quantize(x, kind), raw_dtype=kind)
    w.add_tensor("vec", rng.standard_normal(32).astype(np.float32))
    _finish(w)
    ours = _same(path)
    assert [ours.fields[f"t.{i}"] for i in range(len(values))] == [v for _, v in values]
    assert [t.dims for t in ours.tensors] == [(64, 6)] * 4 + [(32,)]


BLOCK = {"Q4_1": 20, "Q8_0": 34}


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # random scales: inf * 0 is nan, on both sides
@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from(sorted(BLOCK)), rows=st.integers(1, 4), blocks=st.integers(1, 3), data=st.data())
def test_dequantize_equals_gguf_quants_bit_for_bit(kind, rows, blocks, data):
    raw = data.draw(st.binary(min_size=rows * blocks * BLOCK[kind], max_size=rows * blocks * BLOCK[kind]))
    stored = np.frombuffer(raw, np.uint8).reshape(rows, blocks * BLOCK[kind])
    from model_files.gguf_reader import Tensor

    got = dequantize(Tensor("t", kind, (32 * blocks, rows), stored))
    ref = np.array(gguf.quants.dequantize(stored, gguf.GGMLQuantizationType[kind]), dtype=np.float32)
    assert got.shape == ref.shape == (rows, 32 * blocks)
    assert np.array_equal(got.view(np.uint32), ref.view(np.uint32))


def test_truncated_and_foreign_bytes_are_refused(tmp_path):
    good = tmp_path / "good.gguf"
    w = gguf.GGUFWriter(str(good), "llama")
    w.add_array("t.strs", ["abc"] * 10)
    w.add_tensor("x", np.ones((4, 32), np.float32))
    _finish(w)
    raw = good.read_bytes()
    GGUFContents(str(good))
    bad = tmp_path / "bad.gguf"
    for cut in (0, 3, 10, 30, 60, len(raw) - 1):  # inside the header, the metadata, the tensor data
        bad.write_bytes(raw[:cut])
        with pytest.raises(GGUFFormatError):
            GGUFContents(str(bad))
    bad.write_bytes(b"GGUF" + (1).to_bytes(4, "little") + raw[8:])
    with pytest.raises(GGUFFormatError, match="version 1"):
        GGUFContents(str(bad))
    bad.write_bytes(b"PK\x03\x04" + raw[4:])
    with pytest.raises(GGUFFormatError, match="magic"):
        GGUFContents(str(bad))


@pytest.mark.parametrize("case", ["valid", "alignment 0", "alignment 3", "duplicate key", "duplicate tensor",
                                  "no dims", "5 dims"])
def test_malformed_layouts_are_refused(tmp_path, case):
    """What GGUFReader refused (or crashed on) is a GGUFFormatError here, not a stray exception."""
    import struct

    def string(text: str) -> bytes:
        return struct.pack("<Q", len(text)) + text.encode()

    fields, tensors = [], []
    if case.startswith("alignment"):
        fields.append(string("general.alignment") + struct.pack("<II", 4, int(case.split()[1])))
    if case == "duplicate key":
        fields += [string("k") + struct.pack("<II", 4, 1)] * 2
    dims = {"no dims": [], "5 dims": [1] * 5}.get(case, [32])
    tensors.append(string("t") + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, 0, 0))
    if case == "duplicate tensor":
        tensors.append(tensors[0])
    raw = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(fields)) + b"".join(fields + tensors)
    path = tmp_path / "bad.gguf"
    path.write_bytes(raw + bytes(-len(raw) % 32) + bytes(4 * 32 * len(tensors)))
    if case == "valid":  # the same bytes made well: they read
        assert [(t.name, t.dims) for t in GGUFContents(str(path)).tensors] == [("t", (32,))]
        return
    with pytest.raises(GGUFFormatError):
        GGUFContents(str(path))
