"""transfer.channels.nixl_segments (no nixl needed): the Region wire form a peer's handshake carries,
strictly checked, and the planning of a READ's segments: checked against both regions before
anything is issued, neighbours coalesced, the segment count bounded."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from transfer.channels import nixl_segments
from transfer.channels.nixl_segments import Region, plan_segments
from transfer.errors import LimitExceeded, MalformedMessage


def test_region_wire_roundtrip():
    region = Region(0x7F0000001000, 3 << 20, 0, "DRAM")
    wire = msgpack.unpackb(msgpack.packb(region.to_wire()))
    assert Region.from_wire(wire) == region
    assert Region.from_wire(Region(1 << 40, 1, 3, "VRAM").to_wire(), max_bytes=1).mem == "VRAM"


GOOD = {"addr": 1 << 40, "nbytes": 4096, "dev": 0, "mem": "DRAM"}


@pytest.mark.parametrize("wire", [
    [1 << 40, 4096, 0, "DRAM"],
    {k: v for k, v in GOOD.items() if k != "dev"},
    {**GOOD, "extra": 1},
    {**GOOD, "addr": str(1 << 40)},
    {**GOOD, "addr": True},
    {**GOOD, "nbytes": 4096.0},
    {**GOOD, "dev": None},
    {**GOOD, "addr": 0},
    {**GOOD, "addr": -4096},
    {**GOOD, "addr": 1 << 64},
    {**GOOD, "nbytes": 0},
    {**GOOD, "nbytes": -1},
    {**GOOD, "nbytes": (1 << 48) + 1},
    {**GOOD, "addr": (1 << 64) - 4096, "nbytes": 4097},
    {**GOOD, "dev": -1},
    {**GOOD, "dev": 1 << 20},
    {**GOOD, "mem": "GPU"},
    {**GOOD, "mem": b"DRAM"},
])
def test_region_from_wire_rejects(wire):
    with pytest.raises(MalformedMessage):
        Region.from_wire(wire)


def test_region_from_wire_max_bytes():
    with pytest.raises(MalformedMessage):
        Region.from_wire(GOOD, max_bytes=4095)
    assert Region.from_wire(GOOD, max_bytes=4096).nbytes == 4096


R, L = Region(1 << 40, 1 << 16, 0, "DRAM"), Region(1 << 41, 1 << 16, 0, "DRAM")


def test_plan_coalesces_neighbours_in_order():
    segs = [(0, 100, 8), (8, 108, 8), (16, 116, 4), (64, 0, 8), (200, 8, 8), (0, 300, 4)]
    r, lo, n = plan_segments(segs, R, L)
    runs = list(zip(r.tolist(), lo.tolist(), n.tolist()))
    assert runs == [(0, 100, 20), (64, 0, 8), (200, 8, 8), (0, 300, 4)]
    r2, lo2, n2 = plan_segments(np.array(segs, dtype=np.uint64), R, L)
    assert (r2 == r).all() and (lo2 == lo).all() and (n2 == n).all()
    assert len(plan_segments([], R, L)[2]) == 0


@pytest.mark.parametrize("segs", [
    [(0, 0, 8), ((1 << 16) - 7, 0 + 8, 8)],  # remote end one past
    [(0, 0, 8), (0, (1 << 16) - 7, 8)],  # local end one past
    [(0, 0, 1 << 17)],  # larger than both
    [(-1, 0, 8)], [(0, -1, 8)], [(0, 0, 0)], [(0, 0, -8)],
    [(0, 0, 8), (100, 4, 8)],  # overlapping local ranges
    [(0, 0, True)], [(0.0, 0, 8)], [("0", 0, 8)], [(0, 0)], [(0, 0, 8, 0)], [7], None,
    [(1 << 63, 0, 8)], [(0, 0, (1 << 64) - 1)],
    np.array([[0, 0, 8]], dtype=np.float64), np.array([0, 0, 8]),
    np.array([[1 << 63, 0, 8]], dtype=np.uint64),
])
def test_plan_rejects(segs):
    with pytest.raises(MalformedMessage):
        plan_segments(segs, R, L)


def test_plan_limits_segment_count(monkeypatch):
    monkeypatch.setattr(nixl_segments, "MAX_SEGMENTS", 4)
    plan_segments([(i * 8, i * 8, 8) for i in range(4)], R, L)
    with pytest.raises(LimitExceeded):
        plan_segments(((i * 8, i * 8, 8) for i in range(5)), R, L)
    with pytest.raises(LimitExceeded):
        plan_segments(np.zeros((5, 3), dtype=np.int64), R, L)


# -- two agents in one process -----------------------------------------------------------------------
