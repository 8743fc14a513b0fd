"""Allocator-policy simulator: step-loop semantics on hand-computed traces, scenario validation,
the shipped scenario's findings, and the `pdserve simulate` command's files."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from allocsim.policies import make_policies
from allocsim.run import StepStats, results_to_json, run_policy, simulate
from allocsim.scenario import ScenarioError, load_default_scenario, load_scenario, parse_scenario
from kvcache.allocator import BlockAllocator
from pdserve_cli.main import main


def req(rid, arrival, prompt, max_new, output):
    return {"id": rid, "arrival": arrival, "prompt": prompt, "max_new_tokens": max_new, "output": output}


def by_name(results):
    return {r.name: r for r in results}


def counts(r):
    return (r.admitted, r.rejected, r.growth_failures, r.failures_despite_free_capacity, r.completed,
            r.peak_reserved, r.peak_live, r.peak_waste, r.steps)


# Trace A: capacity 16. a = 3+5 (output 2), b = 4+6 (output 3) at step 0; c = 2+2 (output 2) at step 1.
TRACE_A = {"capacity": 16, "block_sizes": [4, 8],
           "requests": [req("a", 0, 3, 5, 2), req("b", 0, 4, 6, 3), req("c", 1, 2, 2, 2)]}


def test_trace_a_max_reservation():
    r = by_name(simulate(parse_scenario(TRACE_A), check=True))["max_reservation"]
    # t0: a takes [0,8); b asks 10 with 8 free -> rejected (not fragmentation). a gen 1.
    #     reserved 8, live 3+1=4, waste 4, free 8, largest 8.
    # t1: c takes [8,12). a gen 2 -> finished (still holds). c gen 1.
    #     reserved 8+4=12, live 5+3=8, waste 4, free 4, largest 4 ([12,16)).
    # t2: a releases. c gen 2 -> finished. reserved 4, live 4, waste 0, free 12, largest 8 ([0,8)).
    assert counts(r) == (2, 1, 0, 0, 2, 12, 8, 4, 3)
    assert r.series == [StepStats(0, 8, 4, 4, 8, 8), StepStats(1, 12, 8, 4, 4, 4),
                        StepStats(2, 4, 4, 0, 12, 8)]
    rejected = [e for e in r.events if e.kind == "rejected"]
    assert [(e.step, e.request, e.free, e.asked) for e in rejected] == [(0, "b", 8, 10)]


def test_trace_a_exact_contiguous():
    r = by_name(simulate(parse_scenario(TRACE_A), check=True))["exact_contiguous"]
    # t0: a [0,3), b [3,7). a's next slot 3 is b's -> growth failure with 9 free (fragmentation);
    #     a frees [0,3) at once. b grows to [3,8). reserved 5, live 5, free 11, largest 8 ([8,16)).
    # t1: c [0,2). b -> [3,9), c -> [0,3). reserved 9, live 9, free 7, largest 7 ([9,16)).
    # t2: b -> [3,10), gen 3 -> finished. c's slot 3 is b's -> growth failure with 6 free.
    #     reserved 7 (b), free 9, largest 6 ([10,16)).
    assert counts(r) == (3, 0, 2, 2, 1, 9, 9, 0, 3)
    assert r.series == [StepStats(0, 5, 5, 0, 11, 8), StepStats(1, 9, 9, 0, 7, 7),
                        StepStats(2, 7, 7, 0, 9, 6)]
    fails = [(e.step, e.request, e.free, e.asked) for e in r.events if e.kind == "growth_failure"]
    assert fails == [(0, "a", 9, 1), (2, "c", 6, 1)]


def test_trace_a_paged_4():
    r = by_name(simulate(parse_scenario(TRACE_A), check=True))["paged_4"]
    # 4 blocks. t0: a 1 block, b 1 block. a has 3 tokens -> no new block; b has 4 -> new block.
    #     reserved 4+8=12, live 4+5=9, waste 3, free 4 (one block).
    # t1: c takes the last block. a has 4 tokens -> needs a block, none free -> growth failure
    #     (0 free < 4 asked: not fragmentation); its block returns. b (6 tokens), c (3 tokens).
    #     reserved 8+4=12, live 6+3=9, waste 3, free 4.
    # t2: b gen 3 and c gen 2 finish. reserved 12, live 7+4=11, waste 1, free 4.
    assert counts(r) == (3, 0, 1, 0, 2, 12, 11, 3, 3)
    assert r.series == [StepStats(0, 12, 9, 3, 4, 4), StepStats(1, 12, 9, 3, 4, 4),
                        StepStats(2, 12, 11, 1, 4, 4)]


def test_trace_a_paged_8():
    r = by_name(simulate(parse_scenario(TRACE_A), check=True))["paged_8"]
    # 2 blocks, a and b take one each. t0: reserved 16, live 9, waste 7, free 0.
    # t1: c rejected (0 free < 8 asked). a finishes (5 tokens), b 6. reserved 16, live 11, waste 5.
    # t2: a releases; b finishes with 7. reserved 8, live 7, waste 1, free 8.
    assert counts(r) == (2, 1, 0, 0, 2, 16, 11, 7, 3)
    assert r.series[-1] == StepStats(2, 8, 7, 1, 8, 8)


# Trace B: the seed's picture. x = 20+4, y = 12+4 (output 1), z = 12+4 at step 0; w = 16+4 at step 2.
TRACE_B = {"capacity": 64, "block_sizes": [8],
           "requests": [req("x", 0, 20, 4, 4), req("y", 0, 12, 4, 1), req("z", 0, 12, 4, 4),
                        req("w", 2, 16, 4, 1)]}


def test_trace_b_max_reservation_fails_despite_free_capacity():
    r = by_name(simulate(parse_scenario(TRACE_B), check=True))["max_reservation"]
    # t0: x [0,24), y [24,40), z [40,56); y finishes at once. reserved 56, live 21+13+13=47, free 8.
    # t1: y's [24,40) is free: free 24, largest 16. reserved 40, live 22+14=36, waste 4.
    # t2: w asks 20 with 24 free but 16 the largest interval -> rejected despite free capacity.
    # t3: x and z finish. reserved 40, live 40, waste 0.
    assert counts(r) == (3, 1, 0, 1, 3, 56, 47, 9, 4)
    assert r.series[1] == StepStats(1, 40, 36, 4, 24, 16)
    assert r.series[2] == StepStats(2, 40, 38, 2, 24, 16)
    assert [(e.step, e.kind, e.request, e.free, e.asked) for e in r.events if e.request == "w"] == \
        [(2, "rejected", "w", 24, 20)]


def test_trace_b_exact_contiguous():
    r = by_name(simulate(parse_scenario(TRACE_B), check=True))["exact_contiguous"]
    # t0: x [0,20), y [20,32), z [32,44). x and y are boxed in -> 2 growth failures with free space.
    #     z -> [32,45). reserved 13, free 51, largest 32 ([0,32)).
    # t2: w [0,16) -> [0,17) finishes; z -> [32,47). reserved 32, free 32, largest 17 ([47,64)).
    # t3: z finishes at [32,48). reserved 16, largest 32.
    assert counts(r) == (4, 0, 2, 2, 2, 32, 32, 0, 4)
    assert r.series[0] == StepStats(0, 13, 13, 0, 51, 32)
    assert r.series[2] == StepStats(2, 32, 32, 0, 32, 17)


def test_trace_b_paged_reuses_scattered_blocks():
    results = simulate(parse_scenario(TRACE_B), record_layout=True, check=True)
    r = by_name(results)["paged_8"]
    # 8 blocks: x 0,1,2; y 3,4; z 5,6; block 7 clean. y frees tail first (4 then 3), so the clean
    # queue is 7,4,3: w gets blocks 7 and 4, and its 17th token takes block 3.
    # t2: reserved 24+16+24=64, live 23+15+17=55, waste 9, free 0.
    assert counts(r) == (4, 0, 0, 0, 4, 64, 55, 9, 4)
    assert r.series[2] == StepStats(2, 64, 55, 9, 0, 0)
    w = sorted(s for s in r.layouts[2] if s[2] == "w")
    assert w == [(24, 1, "w", True), (25, 7, "w", False), (32, 8, "w", True), (56, 8, "w", True)]


def test_arrival_order_idle_steps_and_partial_last_block():
    sc = parse_scenario({"capacity": 18, "block_sizes": [4],
                         "requests": [req("late", 3, 2, 2, 2), req("early", 3, 1, 1, 1)]})
    # Steps 0-2 are idle (nothing arrived yet); at step 3 'late' is admitted first (file order).
    # Paged: 18 // 4 = 4 blocks = 16 usable slots.
    results = by_name(simulate(sc, check=True))
    paged = results["paged_4"]
    assert paged.steps == 5 and paged.series[0] == StepStats(0, 0, 0, 0, 16, 16)
    assert [e.request for e in paged.events if e.kind == "admitted"] == ["late", "early"]
    mr = results["max_reservation"]
    assert mr.series[3] == StepStats(3, 6, 5, 1, 12, 12)  # late [0,4) 3 live, early [4,6) 2 live
    assert mr.series[4] == StepStats(4, 4, 4, 0, 14, 14)  # early released at step 4


def test_paged_policy_uses_the_real_block_allocator():
    policies = make_policies(parse_scenario({**TRACE_A, "capacity": 18}))
    paged = [p for p in policies if p.name.startswith("paged_")]
    assert [p.name for p in policies] == ["max_reservation", "exact_contiguous", "paged_4", "paged_8"]
    assert [type(p.allocator) for p in paged] == [BlockAllocator, BlockAllocator]
    assert [p.allocator.num_blocks for p in paged] == [4, 2]


MALFORMED = [
    (lambda s: s["requests"][2].update(output=3), "requests[2].output: must be 1..max_new_tokens"),
    (lambda s: s["requests"][0].update(output=0), "requests[0].output: must be 1..max_new_tokens"),
    (lambda s: s.update(capacity=0), "capacity:"),
    (lambda s: s.update(capacity="80"), "capacity:"),
    (lambda s: s.update(block_sizes=[4, 0]), "block_sizes[1]:"),
    (lambda s: s.update(block_sizes=[4, 32]), "block_sizes[1]:"),
    (lambda s: s.update(block_sizes=[4, 4]), "block_sizes[1]: duplicate"),
    (lambda s: s.update(block_sizes=[]), "block_sizes:"),
    (lambda s: s.pop("block_sizes"), "block_sizes: missing"),
    (lambda s: s.update(requests=[]), "requests:"),
    (lambda s: s["requests"].append(5), "requests[3]: must be an object"),
    (lambda s: s["requests"][1].update(id="a"), "requests[1].id: duplicate"),
    (lambda s: s["requests"][1].update(id=""), "requests[1].id:"),
    (lambda s: s["requests"][0].update(prompt=0), "requests[0].prompt:"),
    (lambda s: s["requests"][0].update(arrival=-1), "requests[0].arrival:"),
    (lambda s: s["requests"][0].update(arrival=True), "requests[0].arrival:"),
    (lambda s: s["requests"][1].update(max_new_tokens=2.5), "requests[1].max_new_tokens:"),
    (lambda s: s["requests"][0].pop("max_new_tokens"), "requests[0].max_new_tokens: missing"),
    (lambda s: s["requests"][0].update(ouput=1), "requests[0].ouput: unknown field"),
    (lambda s: s.update(capacty=80), "capacty: unknown field"),
]


@pytest.mark.parametrize("mutate,message", MALFORMED)
def test_malformed_scenario_names_the_field(mutate, message):
    raw = json.loads(json.dumps(TRACE_A))
    mutate(raw)
    with pytest.raises(ValueError) as info:
        parse_scenario(raw)
    assert isinstance(info.value, ScenarioError)
    assert str(info.value).startswith(message), str(info.value)


def test_unparsable_file_and_non_object(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"capacity": 80,')
    with pytest.raises(ScenarioError, match="not valid JSON"):
        load_scenario(bad)
    with pytest.raises(ScenarioError, match="^scenario: must be a JSON object"):
        parse_scenario([1, 2])


def test_shipped_scenario_shows_the_seed_findings():
    sc = load_default_scenario()
    assert sc.capacity == 80 and sc.block_sizes == (4, 8, 16)
    r = by_name(simulate(sc, check=True))
    n = len(sc.requests)
    # 1. maximum reservation rejects requests.
    assert r["max_reservation"].rejected >= 1
    # 2. exact contiguous growth fails although enough slots are free in total.
    assert r["exact_contiguous"].failures_despite_free_capacity >= 1
    # 3. paged with 4-slot blocks admits and completes the whole trace.
    p4 = r["paged_4"]
    assert (p4.admitted, p4.rejected, p4.growth_failures, p4.completed) == (n, 0, 0, n)
    # 4. larger blocks fail, for lack of slots (their tail waste), never through fragmentation.
    for name in ("paged_8", "paged_16"):
        assert r[name].rejected + r[name].growth_failures >= 1, name
        assert r[name].failures_despite_free_capacity == 0, name
    assert p4.peak_waste < r["paged_8"].peak_waste < r["paged_16"].peak_waste


POLICY_KEYS = {"name", "admitted", "rejected", "growth_failures", "failures_despite_free_capacity",
               "completed", "peak_reserved", "peak_live", "peak_waste", "steps", "series"}
ROW_KEYS = {"step", "reserved", "live", "waste", "free", "largest_free_interval"}


def test_cli_writes_json_and_png(tmp_path, capsys):
    out, fig = tmp_path / "sim.json", tmp_path / "sim.png"
    assert main(["simulate", "--json", str(out), "--figure", str(fig)]) == 0
    table = capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert set(doc) == {"policies"}
    names = [p["name"] for p in doc["policies"]]
    assert names == ["max_reservation", "exact_contiguous", "paged_4", "paged_8", "paged_16"]
    for p in doc["policies"]:
        assert set(p) == POLICY_KEYS
        assert len(p["series"]) == p["steps"] and all(set(row) == ROW_KEYS for row in p["series"])
        assert [row["step"] for row in p["series"]] == list(range(p["steps"]))
        assert any(line.split()[:1] == [p["name"]] for line in table.splitlines())
    assert doc == results_to_json(simulate(load_default_scenario()))
    assert fig.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_svg_and_bad_scenario(tmp_path, capsys):
    sc, fig = tmp_path / "s.json", tmp_path / "s.svg"
    sc.write_text(json.dumps(TRACE_B))
    assert main(["simulate", "--scenario", str(sc), "--figure", str(fig)]) == 0
    assert b"<svg" in fig.read_bytes()[:2000]
    capsys.readouterr()
    broken = json.loads(json.dumps(TRACE_B))
    broken["requests"][3]["output"] = 9
    sc.write_text(json.dumps(broken))
    assert main(["simulate", "--scenario", str(sc)]) == 2
    assert "requests[3].output: must be 1..max_new_tokens" in capsys.readouterr().err
    assert main(["simulate", "--figure", str(tmp_path / "f.gif")]) == 2


@settings(max_examples=60)
@given(st.integers(8, 48), st.lists(st.tuples(st.integers(0, 6), st.integers(1, 12), st.integers(1, 10),
                                              st.integers(1, 10)), min_size=1, max_size=8))
def test_invariants_on_random_traces(capacity, raw):
    reqs = [req(f"r{i}", a, p, m, min(o, m)) for i, (a, p, m, o) in enumerate(raw)]
    sc = parse_scenario({"capacity": capacity, "block_sizes": [2, 4, 8], "requests": reqs})
    for policy in make_policies(sc):
        r = run_policy(sc, policy, check=True)  # check: integrity every step, no leak at the end
        b = getattr(policy, "block_size", 1)  # contiguous policies use every slot
        usable = capacity // b * b
        assert r.admitted + r.rejected == len(reqs)
        assert r.completed + r.growth_failures == r.admitted
        assert r.steps == len(r.series) and r.steps >= max(a for a, *_ in raw) + 1
        for s in r.series:
            assert s.reserved + s.free == usable and s.waste == s.reserved - s.live >= 0
            assert s.largest_free_interval <= s.free
        if r.name == "max_reservation":
            assert r.growth_failures == 0
        if r.name == "exact_contiguous":
            assert r.peak_waste == 0
        if r.name.startswith("paged_"):
            assert r.failures_despite_free_capacity == 0
            assert all(s.largest_free_interval == s.free for s in r.series)
