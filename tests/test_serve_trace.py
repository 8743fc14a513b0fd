"""The Mooncake trace reader (measure.serve_trace): token content fixed per hash id, shared ids give
shared prefixes, the last block cut to input_length, the time scale, typed errors for bad lines,
and the shipped trace is what its generator makes."""

from __future__ import annotations

import json

import pytest

from measure import serve_trace as st
from measure.loadgen import PROMPT_ID_RANGE


def _write(tmp_path, rows, name="t.jsonl"):
    p = tmp_path / name
    p.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(p)


ROWS = [{"timestamp": 1000, "input_length": 600, "output_length": 5, "hash_ids": [7, 8]},
        {"timestamp": 3000, "input_length": 1100, "output_length": 9, "hash_ids": [7, 8, 9]},
        {"timestamp": 2000, "input_length": 100, "output_length": 3, "hash_ids": [4]}]


def test_block_content_is_fixed_per_hash_id_and_salt():
    a = st.block_tokens(7)
    assert a == st.block_tokens(7) and len(a) == st.BLOCK_TOKENS
    assert a != st.block_tokens(8) and a != st.block_tokens(7, salt=1)
    lo, hi = PROMPT_ID_RANGE
    assert all(lo <= t < hi for t in a)


def test_shared_ids_share_the_prefix_and_the_last_block_is_cut(tmp_path):
    recs = st.read_mooncake(_write(tmp_path, ROWS))
    assert [r.timestamp_ms for r in recs] == [1000, 2000, 3000]  # sorted by timestamp
    first, short, long_ = (st.prompt_tokens(r) for r in recs)
    assert len(first) == 600 and len(short) == 100 and len(long_) == 1100
    assert long_[:600] == first                       # ids 7, 8 shared: the same tokens
    assert first[:512] == st.block_tokens(7) and first[512:] == st.block_tokens(8)[:88]
    assert long_[1024:] == st.block_tokens(9)[:76]    # the partial last block, cut to input_length
    assert short == st.block_tokens(4)[:100]


def test_time_scale_and_rate(tmp_path):
    recs = st.read_mooncake(_write(tmp_path, ROWS))
    assert st.mean_rate(recs) == pytest.approx(1.0)   # 2 gaps over 2 s
    specs = st.to_specs(recs, time_scale=2.0)
    assert [s.arrival_s for s in specs] == [0.0, 2.0, 4.0]
    assert [s.max_tokens for s in specs] == [5, 3, 9] and [len(s.prompt) for s in specs] == [600, 100, 1100]
    assert st.scale_for_rate(recs, 4.0) == pytest.approx(0.25)  # 4 req/s: a quarter of the time
    assert [s.arrival_s for s in st.to_specs(recs, st.scale_for_rate(recs, 4.0))] == [0.0, 0.25, 0.5]
    assert len(st.to_specs(recs, limit=2)) == 2
    salted = st.to_specs(recs, salt=3)
    assert salted[0].prompt != specs[0].prompt and salted[2].prompt[:600] == salted[0].prompt
    with pytest.raises(ValueError):
        st.to_specs(recs, time_scale=0.0)


@pytest.mark.parametrize("row, match", [
    ({"timestamp": 0, "input_length": 600, "output_length": 5}, "missing hash_ids"),
    ({"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [1, 2]}, "needs 3 hash ids"),
    ({"timestamp": -1, "input_length": 10, "output_length": 5, "hash_ids": [1]}, "timestamp"),
    ({"timestamp": 0, "input_length": 0, "output_length": 5, "hash_ids": [1]}, "input_length"),
    ({"timestamp": 0, "input_length": 10, "output_length": 5, "hash_ids": ["a"]}, "hash_ids"),
    ("{not json", "not JSON"),
])
def test_bad_lines_are_refused_with_the_line_named(tmp_path, row, match):
    path = _write(tmp_path, [ROWS[0], row])
    with pytest.raises(st.TraceError, match=match) as e:
        st.read_mooncake(path)
    assert ":2:" in str(e.value)


def test_format_is_recognised(tmp_path):
    assert st.is_mooncake(_write(tmp_path, ROWS))
    plan_trace = tmp_path / "plan.json"
    rows = [{"arrival_s": 0, "prompt_tokens": 4, "output_tokens": 2}]
    plan_trace.write_text(json.dumps({"requests": rows}))
    assert not st.is_mooncake(str(plan_trace))


def test_the_shipped_trace_is_its_generators_output(tmp_path):
    from measure.traces import generate

    out = tmp_path / "again.jsonl"
    generate.write(generate.generate(), str(out))
    assert out.read_text() == open(generate.DEFAULT_PATH).read()
    recs = st.read_mooncake(generate.DEFAULT_PATH)
    firsts = [r.hash_ids[0] for r in recs]
    assert len(recs) == 120 and len(set(firsts)) == generate.NUM_SYSTEM  # every prompt starts shared
    assert max(r.input_length for r in recs) <= generate.MAX_INPUT
