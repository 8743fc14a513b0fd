"""Tests for kvcache.storage: the block-major pool layout, slot addressing, block copies, byte views
of adjacent blocks, and the errors raised on bad layouts, slots, blocks and shapes."""

import pytest
import torch

from kvcache import KVLayout, KVStorage
from kvcache.storage import LAYOUT_NAME, dtype_from_name, dtype_name

L, H, D, B = 2, 3, 4, 4


def make(num_blocks: int = 5, dtype: str = "float32") -> KVStorage:
    s = KVStorage(KVLayout(num_layers=L, num_kv_heads=H, head_dim=D, block_size=B, dtype=dtype), num_blocks)
    # Every element distinct, so a wrong index reads a visibly wrong value.
    s.data.copy_(torch.arange(s.data.numel(), dtype=torch.float32).reshape(s.data.shape).to(s.data.dtype))
    return s


def test_layout_shape_and_sizes():
    lay = KVLayout(num_layers=L, num_kv_heads=H, head_dim=D, block_size=B, dtype="float16")
    s = KVStorage(lay, 7)
    assert s.data.shape == (7, L, 2, B, H, D)
    assert s.data.is_contiguous()
    assert lay.token_bytes == L * 2 * H * D * 2
    assert lay.block_bytes == lay.token_bytes * B
    assert s.data[0].numel() * s.data.element_size() == lay.block_bytes
    fp = lay.fingerprint()
    assert fp == {"num_layers": L, "num_kv_heads": H, "head_dim": D, "dtype": "float16", "block_size": B,
                  "layout": LAYOUT_NAME, "model": ""}
    assert s.num_slots == 7 * B


def test_dtype_names_round_trip():
    for name in ("float32", "float16", "bfloat16"):
        assert dtype_name(dtype_from_name(name)) == name
    with pytest.raises(ValueError, match="unknown KV dtype"):
        dtype_from_name("int8")
    with pytest.raises(ValueError, match="unsupported KV dtype"):
        dtype_name(torch.int32)


@pytest.mark.parametrize("field,value", [("num_layers", 0), ("num_kv_heads", -1), ("head_dim", 2.5),
                                         ("block_size", True), ("block_size", "4")])
def test_layout_rejects_bad_fields(field, value):
    kw = dict(num_layers=1, num_kv_heads=1, head_dim=1, block_size=1)
    kw[field] = value
    with pytest.raises(ValueError, match=f"KVLayout.{field}"):
        KVLayout(**kw)


def test_layout_rejects_bad_dtype_and_pool_size():
    with pytest.raises(ValueError, match="unknown KV dtype"):
        KVLayout(1, 1, 1, 1, dtype="fp8")
    with pytest.raises(ValueError, match="num_blocks"):
        KVStorage(KVLayout(1, 1, 1, 1), 0)


def test_write_slot_lands_at_block_and_offset():
    s = make()
    k = torch.full((L, H, D), -1.0)
    v = torch.full((L, H, D), -2.0)
    s.write_slot(13, k, v)  # block 13 // 4 = 3, offset 1
    assert torch.equal(s.data[3, :, 0, 1], k)
    assert torch.equal(s.data[3, :, 1, 1], v)
    assert not (s.data[3, :, :, 0] < 0).any() and not (s.data[3, :, :, 2] < 0).any()
    assert (s.data < 0).sum() == 2 * L * H * D


def test_read_slots_gathers_in_given_order():
    s = make()
    out = s.read_slots([13, 0, 19])
    assert out.shape == (3, L, 2, H, D)
    assert torch.equal(out[0], s.data[3, :, :, 1])
    assert torch.equal(out[1], s.data[0, :, :, 0])
    assert torch.equal(out[2], s.data[4, :, :, 3])
    assert s.read_slots([]).shape == (0, L, 2, H, D)


def test_layer_view_is_a_strided_view():
    s = make()
    k, v = s.layer_view(1)
    assert k.shape == v.shape == (5, B, H, D)
    assert k.data_ptr() != v.data_ptr()
    k[2, 3] = 0.5
    v[2, 3] = 0.25
    assert torch.equal(s.data[2, 1, 0, 3], torch.full((H, D), 0.5))
    assert torch.equal(s.data[2, 1, 1, 3], torch.full((H, D), 0.25))


def test_copy_blocks_copies_whole_blocks_only():
    s = make()
    before = s.data.clone()
    s.copy_blocks([(1, 4), (0, 2)])
    assert torch.equal(s.data[4], before[1])
    assert torch.equal(s.data[2], before[0])
    for b in (0, 1, 3):
        assert torch.equal(s.data[b], before[b])
    s.copy_blocks([])
    assert torch.equal(s.data[4], before[1])


def test_block_bytes_view_is_contiguous_per_block_and_coalesces():
    s = make(dtype="bfloat16")
    raw = s.data.view(torch.uint8).reshape(5, -1)  # (N, block_bytes)
    one = s.block_bytes_view(2)
    assert len(one) == s.layout.block_bytes
    assert bytes(one) == raw[2].numpy().tobytes()
    two = s.block_bytes_view(3, 2)
    assert len(two) == 2 * s.layout.block_bytes
    assert bytes(two) == raw[3].numpy().tobytes() + raw[4].numpy().tobytes()
    # It is a view of pool memory, not a copy.
    s.data[3].zero_()
    assert not any(bytes(two)[:s.layout.block_bytes])


@pytest.mark.parametrize("slot", [-1, 20, 1000])
def test_slot_out_of_range_raises(slot):
    s = make()
    kv = torch.zeros(L, H, D)
    with pytest.raises(ValueError, match="slot"):
        s.write_slot(slot, kv, kv)
    with pytest.raises(ValueError, match="slot"):
        s.read_slots([0, slot])


def test_write_slot_rejects_wrong_shapes_instead_of_broadcasting():
    s = make()
    before = s.data.clone()
    with pytest.raises(ValueError, match=r"\(L, H, D\)"):
        s.write_slot(0, torch.zeros(H, D), torch.zeros(H, D))
    with pytest.raises(ValueError, match=r"\(L, H, D\)"):
        s.write_slot(0, torch.zeros(L, H, D), torch.zeros(L, H, D + 1))
    assert torch.equal(s.data, before)


def test_block_range_errors():
    s = make()
    with pytest.raises(ValueError, match="source block"):
        s.copy_blocks([(-1, 0)])
    with pytest.raises(ValueError, match="destination block"):
        s.copy_blocks([(0, 5)])
    with pytest.raises(ValueError, match="outside"):
        s.block_bytes_view(4, 2)
    with pytest.raises(ValueError, match="outside"):
        s.block_bytes_view(-1)
    with pytest.raises(ValueError, match="outside"):
        s.block_bytes_view(0, 0)
    with pytest.raises(ValueError, match="layer"):
        s.layer_view(L)
    with pytest.raises(ValueError, match="layer"):
        s.layer_view(-1)
