"""The goodput policy's inputs, measured on each rank and agreed across ranks.

* **Step times**: the host wall time from one decode step's start to the next's, when
  both ran in the same mode with nothing in between (no prefill or mixed step) and
  not right after a switch (a resume's catch-up, a lagging result). Under the overlap
  scheduler that is the steady-state time per step of the pipeline, which is what
  tokens per second divide by. Rank-local, so they reach the policy only through
  ``agree`` (rank 0's table broadcast to every TP rank), every ``agree_every`` decode
  steps: between two agreements every rank's policy sees the same snapshot.
* **Acceptance**: the increase of the scheduler's per-request host counters
  (``spec_num_correct_drafts``, ``spec_verify_ct``) over stretches of speculative steps;
  identical on every rank by construction. With ``SGLANG_SIMULATE_ACC_LEN`` set
  (benchmarks only) the simulated value is used instead, and the start-up log says so.

Pure Python: the clock and the agreement are injected.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from sglang_dynspec.goodput import AcceptanceMeter, Estimates, StepTimes
from sglang_dynspec.policy import Mode

# Decode steps after a switch whose timing and accept counters are not used: the
# first pays the resume's catch-up, and the overlap scheduler processes a step's
# result one step late.
SETTLE_STEPS = 2

AcceptCounters = Iterable[tuple[object, int, int]]  # (request id, correct drafts, verify steps)


class EstimateFeed:
    """Measures, agrees and hands :class:`Estimates` to a goodput policy."""

    def __init__(
        self,
        agree: Callable[[dict], dict],
        agree_every: int = 16,
        simulated_acceptance: float | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self._agree, self._agree_every, self._clock = agree, agree_every, clock
        self._simulated = simulated_acceptance
        self.times = StepTimes()
        self.acceptance = AcceptanceMeter()
        self._last: tuple[float, Mode, int] | None = None  # (start, mode, batch size) of the last decode step
        self._same_mode_run = 0  # decode steps in a row in the current mode, with nothing between
        self._counters: dict[object, tuple[int, int]] = {}
        self._steps = 0
        self.estimates = Estimates()

    def on_other_step(self) -> None:
        """A prefill, mixed or idle step ran: the time since the last decode step is not a step time."""
        self._last = None
        self._same_mode_run = 0

    def before_decode(
        self, batch_size: int, counters: Callable[[], AcceptCounters] | None
    ) -> Estimates | None:
        """Called before each decode step's decision; returns new agreed estimates every
        ``agree_every`` steps (the same steps on every rank), else None."""
        now = self._clock()
        if self._last is not None and self._same_mode_run > SETTLE_STEPS:
            start, mode, size = self._last
            self.times.record(mode, size, now - start)
        if self._simulated is None and counters is not None and self._last is not None:
            if self._last[1] is Mode.SPEC and self._same_mode_run > SETTLE_STEPS:
                self._observe(counters())
            else:
                self._counters.clear()  # deltas across plain steps would count them as rejections
        self._steps += 1
        if self._steps % self._agree_every:
            return None
        agreed = self._agree(dict(self.times.seconds))
        acceptance, source = (
            (self._simulated, "simulated")
            if self._simulated is not None
            else (self.acceptance.value, "measured" if self.acceptance.value is not None else "none")
        )
        self.estimates = Estimates(acceptance=acceptance, acceptance_source=source, step_seconds=agreed)
        return self.estimates

    def after_decision(self, mode: Mode, batch_size: int) -> None:
        """The decode step about to run: ``mode`` at ``batch_size``."""
        same = self._last is not None and self._last[1] is mode
        self._same_mode_run = self._same_mode_run + 1 if same else 1
        self._last = (self._clock(), mode, batch_size)

    def _observe(self, counters: AcceptCounters) -> None:
        correct = verify = 0
        seen = {}
        for rid, c, v in counters:
            seen[rid] = (c, v)
            old = self._counters.get(rid)
            if old is not None and v > old[1]:
                correct += c - old[0]
                verify += v - old[1]
        self._counters = seen
        self.acceptance.observe(correct, verify)
