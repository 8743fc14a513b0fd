"""Step pacing: size each engine step's token budget by time, not by a fixed token count.

A step's wall time on a given machine and model is close to `fixed + per_token * tokens` (the
fixed part reads every weight once; each token adds its share of the matmuls and attention).
`StepPacer` fits that line to the steps the engine actually ran (exponentially weighted least
squares, so it follows a machine that gets busier or quieter) and gives the scheduler a budget
that makes the next step take about `target_s`: on a fast GPU the full `max_num_batched_tokens`,
on a one-thread CPU worker running a 135M model a few dozen tokens. A long prompt therefore
prefills in chunks of bounded time, so decode rows sharing the step keep a bounded TPOT and the
worker's loop comes back to its commands and reports often. `expected_s(tokens)` is also what a
worker's heartbeat says its current step should take (runtime.heartbeat), so a coordinator can
tell a long step from a wedged loop.
"""

from __future__ import annotations

FIRST_BUDGET = 256    # tokens of the first steps, before any step was measured
MIN_BUDGET = 16       # never plan fewer tokens than this per step (prefill must progress)


class StepPacer:
    """Fits step seconds against step tokens and turns a time target into a token budget.

    target_s: wall time one step should take (0: no pacing, the budget is always `max_tokens`).
    max_tokens: the scheduler's hard cap (max_num_batched_tokens).
    decay: weight kept by older steps at each new one (0.9: about the last 10 steps count).
    """

    def __init__(self, target_s: float, max_tokens: int, decay: float = 0.9):
        if target_s < 0:
            raise ValueError(f"step target must be >= 0 seconds, got {target_s}")
        if not 0 < decay < 1:
            raise ValueError(f"decay must be in (0, 1), got {decay}")
        self.target_s, self.max_tokens, self.decay = target_s, max_tokens, decay
        self._w = self._x = self._y = self._xx = self._xy = 0.0  # weighted sums of 1, x, y, x^2, xy
        self.steps = 0

    def observe(self, tokens: int, seconds: float) -> None:
        """One step of `tokens` tokens took `seconds` of wall time."""
        if tokens <= 0 or seconds <= 0:
            return
        d = self.decay
        self._w, self._x, self._y = d * self._w + 1, d * self._x + tokens, d * self._y + seconds
        self._xx, self._xy = d * self._xx + tokens * tokens, d * self._xy + tokens * seconds
        self.steps += 1

    def line(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token) of the fitted line, or None before any step."""
        if self.steps == 0:
            return None
        spread = self._w * self._xx - self._x * self._x  # W * weighted variance of x
        if spread > 1e-9 * self._xx * self._w:
            per_token = (self._w * self._xy - self._x * self._y) / spread
            fixed = (self._y - per_token * self._x) / self._w
            if per_token > 0 and fixed >= 0:
                return fixed, per_token
        # steps of one size only (or a fit that came out negative, from noise): all time per token
        return 0.0, self._y / self._x

    def expected_s(self, tokens: int) -> float | None:
        """Seconds a step of `tokens` tokens should take, or None before any step was measured."""
        fit = self.line()
        return None if fit is None else fit[0] + fit[1] * tokens

    def budget(self) -> int:
        """Tokens the next step may schedule (decode rows included), within [MIN_BUDGET, max_tokens]."""
        return self._budget(self.line())

    def _budget(self, fit: tuple[float, float] | None) -> int:
        if self.target_s <= 0:
            return self.max_tokens
        if fit is None:
            return min(self.max_tokens, FIRST_BUDGET)
        fixed, per_token = fit
        tokens = int((self.target_s - fixed) / per_token)
        return max(min(MIN_BUDGET, self.max_tokens), min(self.max_tokens, tokens))

    def summary(self) -> dict:
        """For stats: the current budget and the fitted line (ms, us per token)."""
        fit = self.line()  # NOTE: once per snapshot (the worker loop takes one every iteration)
        return {"step_budget": self._budget(fit),
                "step_fixed_ms": round(fit[0] * 1e3, 3) if fit else None,
                "step_us_per_token": round(fit[1] * 1e6, 3) if fit else None}
