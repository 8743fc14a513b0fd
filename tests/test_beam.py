"""Beam search's stopping rule: a request stops early only when no live beam can still beat the
k-th best finished hypothesis under length normalisation. With negative summed log-probabilities
a longer beam's normalised score can rise, so today's normalised score is no upper bound."""

from types import SimpleNamespace

from engine.beam import _best_reachable, _done


def _beam(cum_logprob: float, length: int):
    return SimpleNamespace(cum_logprob=cum_logprob, output_ids=[0] * length)


def _request(finished, live, max_tokens: int = 10, k: int = 1):
    return SimpleNamespace(params=SimpleNamespace(beam_width=k, max_tokens=max_tokens),
                           finished_beams=finished, live_seqs=live)


def test_a_live_beam_that_can_still_overtake_keeps_the_search_going():
    finished = [_beam(-2.0, 2)]             # normalised -1.0
    live = [_beam(-3.0, 2)]                 # normalised -1.5 now, but -3/10 = -0.3 if it ran to 10 tokens
    assert _best_reachable(live[0], 10) == -0.3
    assert not _done(_request(finished, live, max_tokens=10))


def test_search_stops_when_no_live_beam_can_reach_the_worst_finished():
    finished = [_beam(-2.0, 2)]             # normalised -1.0
    live = [_beam(-12.0, 3)]                # best reachable -12/10 = -1.2 < -1.0
    assert _done(_request(finished, live, max_tokens=10))
    assert not _done(_request([], live))    # fewer than k finished: never done
    assert not _done(_request(finished, [_beam(-9.0, 3)], max_tokens=10))  # -0.9 > -1.0
