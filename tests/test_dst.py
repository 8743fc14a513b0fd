"""The deterministic simulation tier (dst): thousands of seeds of faults against the real
migration protocol, pools and ledger with no invariant broken; every known bug put back as a
mutant is found within its stated number of seeds; a failure replays exactly from its printed
schedule, shrunk to faults that all matter; the sender's protocol runs as sans-IO steps."""


import pytest

from dst.faults import Fault, format_schedule, parse_schedule
from dst.mutants import MUTANTS, mutant
from dst.run import quiet, replay_command, run_seed, run_seeds, shrink

SEEDS = 2000  # the tier: seeds 0..1999, every invariant after every step

# mutant -> seeds within which the simulator must find it (under zmq's guarantees, the default,
# unless TRANSPORT names another); measured over seeds 0..1999: the first seed that finds it, and
# how many of the 2000 do
FOUND_WITHIN = {
    "late_migrated": 200,           # 1cce57b; first seed 7, 126 of 2000
    "late_submit": 500,             # 6a35fe1; first seed 165, 39 of 2000
    "skip_checksum": 800,           # first seed 26, 60 of 2000
    "fail_keeps_reservation": 100,  # first seed 3, 412 of 2000
    "abort_keeps_reused": 500,      # first seed 26, 60 of 2000
    "late_read_lands": 300,         # nixl (reads are events, not cancellable): first seed 70, 21 of 2000
}
TRANSPORT = {"late_read_lands": "nixl"}  # zmq reads no pool: the mutant is out of its reach


@pytest.fixture(autouse=True)
def _quiet():
    quiet()


def test_every_invariant_holds_over_the_seeds():
    report = run_seeds(0, SEEDS, stop_at_first=False)
    failures = [(o.seed, o.violation, replay_command(o.seed, o.faults)) for o in report["failures"]]
    assert failures == []
    assert report["seeds"] == SEEDS
    # the faults did bite: requests were answered and requests failed, over thousands of faults
    assert report["answered"] > SEEDS // 2 and report["failed"] > SEEDS // 10 and report["faults"] > SEEDS


@pytest.mark.parametrize("name", sorted(FOUND_WITHIN))
def test_each_mutant_is_found_within_its_seeds(name):
    transport = TRANSPORT.get(name, "zmq")
    report = run_seeds(0, FOUND_WITHIN[name], mutant_name=name, transport=transport)
    assert report["failures"], f"mutant {name} survived {FOUND_WITHIN[name]} seeds under {transport}"


def test_every_mutant_has_a_stated_bound():
    exhaustive_only = {"reoffer"}  # found by the exhaustive mode (test_dst_explore.py)
    assert set(MUTANTS) == set(FOUND_WITHIN) | exhaustive_only


def test_a_failure_replays_from_its_shrunk_schedule():
    name = "abort_keeps_reused"
    [out] = run_seeds(0, FOUND_WITHIN[name], mutant_name=name)["failures"]
    small = shrink(out.seed, out.faults, name)
    assert 0 < len(small) <= len(out.faults)
    with mutant(name):
        again = run_seed(out.seed, parse_schedule(format_schedule(small)))
        assert again.violation is not None
        for i in range(len(small)):  # minimal: every fault left is needed
            assert run_seed(out.seed, small[:i] + small[i + 1:]).violation is None
    assert run_seed(out.seed, small).violation is None  # the real code survives the same schedule
    cmd = replay_command(out.seed, small, name)
    assert cmd.startswith(f"pdserve bench sim --seed {out.seed} --faults '")
    assert " --transport zmq " in cmd  # the guarantees it ran under
    assert cmd.endswith(f"--mutant {name}")


def test_a_seed_is_deterministic():
    a, b = run_seed(123), run_seed(123)
    assert (a.faults, a.steps, a.answered, a.failed, a.violation) == \
        (b.faults, b.steps, b.answered, b.failed, b.violation)
    assert run_seed(123, a.faults).steps == a.steps  # its recorded schedule is the same run


def test_schedules_round_trip_and_name_bad_kinds():
    faults = [Fault(3, "drop"), Fault(9, "crash_decode", 17)]
    assert parse_schedule(format_schedule(faults)) == faults
    with pytest.raises(ValueError, match="unknown fault 'melt'"):
        parse_schedule("4:melt:0")
    with pytest.raises(KeyError, match="unknown mutant"):
        with mutant("nope"):
            pass



# The schedules under which the simulator found bugs in the coordinator's core (the seed, the
# schedule as `bench sim` printed it, what broke); each fails on the core before its fix.
FOUND_IN_THE_CORE = [
    # the receiver committed, the sender's ack timed out: the held blocks were sent elsewhere and,
    # with one decode worker, the request failed with 503 after every token had arrived
    (5, "11:delay:51533,20:delay:18322,24:cancel:17279,39:supersede:10894,54:delay:38804,77:delay:52471"),
    # the prefill worker crashed after the decode worker imported: the request waited for its
    # Migrated report until the deadline
    (2201, "13:delay:19091,49:crash_prefill:24299"),
]


@pytest.mark.parametrize("seed,schedule", FOUND_IN_THE_CORE)
def test_the_schedules_that_found_bugs_in_the_core_hold_every_invariant(seed, schedule):
    out = run_seed(seed, parse_schedule(schedule))
    assert out.violation is None
    assert out.answered >= 1  # the request they failed is answered now


def test_streamed_migrations_are_simulated_and_answered():
    """Half the seeds migrate while the prompt is computed (`dst.workers.StreamFeed`): without faults
    every request is answered through `migrate_streamed_steps`, chunk by chunk in virtual time."""
    from dst.world import World
    from transfer.session import SenderSession

    streamed = []
    real = SenderSession.migrate_streamed_steps

    def counted(self, *args, **kwargs):
        streamed.append(args[1])
        return real(self, *args, **kwargs)

    SenderSession.migrate_streamed_steps = counted
    try:
        world = World(1, [], stream=True, requests=3)
        world.run()
    finally:
        SenderSession.migrate_streamed_steps = real
    assert sorted(streamed) == ["r0/0", "r1/0", "r2/0"]
    assert [kind for kind, _ in world.coordinator.outcomes.values()] == ["answered"] * 3


def test_a_seed_runs_alike_in_any_process():
    """A replay runs in another process, whose string hashing differs (PYTHONHASHSEED): nothing the
    simulation does may follow a set's order of strings. Seeds 266 and 292 went another way under
    hash seed 3 than under 1 while the core sent a dropped request's aborts in a set's order."""
    import os
    import subprocess
    import sys

    code = ("from dst.run import quiet, run_seed\nquiet()\n"
            "for s in range(260, 300):\n"
            "    o = run_seed(s)\n"
            "    print(s, [(f.at, f.kind, f.arg) for f in o.faults], o.answered, o.failed, o.steps)\n")
    outs = [subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": h},
                           capture_output=True, text=True, timeout=300, check=True).stdout
            for h in ("1", "3")]
    assert outs[0].count("\n") == 40 and outs[0] == outs[1]
