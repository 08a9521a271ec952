"""The goodput policy's inputs, measured on each rank and agreed across ranks.

* **Step costs**: the start-up table (``cost_model.StepCostTable``, the same on every
  rank: the first rank's measurement, broadcast), corrected by the ratio of measured to
  predicted step time per mode and batch-size bucket. Measured: the device time of every
  decode step's forward (``on_step_device_time``; steps that ran a catch-up excepted, it is
  timed on its own), and the host time between two decode steps of the same mode with
  nothing between them, the second of a run or later. Neither needs a quiet stretch of
  steps, so prefills between decode steps slow the correction down, they do not stop it.
* **Acceptance**: speculating, the increase of the scheduler's per-request host counters
  (``spec_num_correct_drafts``, ``spec_verify_ct``; identical on every rank) once
  ``SETTLE_STEPS`` speculative steps have run since the last plain one (under the overlap
  scheduler a plain step's result is processed after the next step has started, and
  the counters count it as a verify with no accepted draft). Plain, the draft catch-up's
  replay: the share of replayed positions where the draft's top-1 proposal is the token
  the target decoded (``on_replay``; the catch-up's tally is read back just before
  an agreeing step and dated by the step its window closed at), turned into the
  expected accept length of the configured chain (``goodput.expected_accept_length``)
  and scaled by how the last such
  estimate compared with the counters that followed it (the replay drafts from the
  target's hidden states at every step; a real chain does so at its first step only).
  The policy gets the most recently measured one. With ``SGLANG_SIMULATE_ACC_LEN`` set
  (benchmarks only) the counters show the simulated value; the plain-mode estimate
  takes the simulated value and the start-up log says so.
* **Catch-up cost**: device seconds per replayed position of the catch-ups so far.
* **Realized tokens/s per mode** (telemetry only, never a decision input): output tokens
  over host seconds of the decode steps timed as above in the last ``agree_every`` steps
  (a plain step gives one token per request; a speculative one what the counters count).

Rank-local values (device and host times, replay shares, catch-up times) reach the
policy only through ``agree`` (the first rank's values handed to every rank), every
``agree_every`` decode steps, so every rank's policy sees the same snapshot. Pure
Python: the clock and the agreement are injected.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable

from sglang_dynspec.cost_model import CostCorrections, CostModel, StepCostTable
from sglang_dynspec.goodput import Estimates, expected_accept_length
from sglang_dynspec.policy import Mode

# Speculative steps after a plain one whose accept counters are not used (see above).
SETTLE_STEPS = 2

AcceptCounters = Iterable[tuple[object, int, int]]  # (request id, correct drafts, verify steps)


class _Average:
    """An exponential moving average; None until the first sample."""

    def __init__(self, alpha: float):
        self.alpha, self.value = alpha, None

    def add(self, sample: float) -> None:
        if not math.isfinite(sample):
            return
        self.value = sample if self.value is None else self.value + self.alpha * (sample - self.value)


class EstimateFeed:
    """Measures, agrees and hands :class:`goodput.Estimates` to the goodput policy."""

    def __init__(
        self,
        agree: Callable[[dict], dict],
        *,
        draft_steps: int = 3,
        agree_every: int = 16,
        simulated_acceptance: float | None = None,
        table: StepCostTable | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self._agree, self._agree_every, self._clock = agree, agree_every, clock
        self._draft_steps = draft_steps
        self.simulated_acceptance = simulated_acceptance
        self.table = table
        self.corrections = CostCorrections()
        self._counter_acceptance = _Average(0.2)
        # A replay covers many positions at once: a sample weighs more than one step's counters.
        self._replay_agreement = _Average(0.5)
        self._replay_bias = _Average(0.5)  # counters / replay estimate, when both were fresh
        # The replay (its decode step) that gave the bias its last sample: each replay gives
        # at most one, from the first counters measured after it. The counters of a long
        # speculative phase measure a world the replay before it did not see: where the
        # acceptance fell while speculating, every agreement of that phase took counters of
        # 1.0 over a replay of 3.0 as the replay's bias, the plain phase after it scaled every
        # replay by about 0.6, and a second rise of the acceptance was never acted on
        # (tests/test_goodput.py's state machine found it, 2026-12-08).
        self._bias_from_replay = -1
        self._catch_up = [0.0, 0]  # device seconds, positions
        self._counters: dict[object, tuple[int, int]] = {}
        # Decode step of each source's last sample: the freshest one wins.
        self._fresh = {"counters": -1, "replay": -1}
        self._last: tuple[float, Mode, int, float] | None = None  # start, mode, batch, context
        self._run = 0  # decode steps in a row in the current mode, nothing between
        self._mode_run = 0  # decode steps in the current mode since the last switch (prefills allowed)
        self._mode: Mode | None = None
        self._phase_start = 0  # decode step at which the current mode began
        self._steps = 0
        self.estimates = Estimates()
        # Realized output tokens/s per mode (telemetry, rank-local): tokens and host seconds
        # of the decode steps timed since the last agreement, and the last window's rate.
        self._window = {mode: [0, 0.0] for mode in Mode}
        self.realized: dict[Mode, float | None] = dict.fromkeys(Mode)

    # -------------------------------------------------------------- rank-local inputs
    def set_table(self, table: StepCostTable) -> None:
        """The start-up table (the same on every rank)."""
        self.table = table

    def on_other_step(self) -> None:
        """A prefill, mixed or idle step ran: the time since the last decode step is not a step time."""
        self._last = None
        self._run = 0

    def on_catch_up_step(self) -> None:
        """The decode step just queued ran a draft catch-up (a resume, or a full buffer's
        flush). Its host time is not a step time, nor is the next step's: the overlap
        scheduler waits on a step's outputs one step later, so the catch-up's device time
        lands in the next interval. On the H200 a resume's catch-up taken as a step time
        made speculation look 4x dearer (R = 0.23 at batch 64 where the table gives 0.94:
        benchmarks/results/h200-decision-20261202-logs/)."""
        self._run = 0

    def on_step_device_time(self, mode: Mode, batch_size: int, context_len: float, seconds: float) -> None:
        """The device time of one decode step's forward, read once the device ran it."""
        predicted = self.table.seconds(mode, batch_size, context_len) if self.table is not None else None
        if predicted:
            self.corrections.observe("device", mode, batch_size, seconds, predicted)

    def on_replay(self, matches: int, positions: int, measured_at: int | None = None) -> None:
        """Catch-ups compared the draft's top-1 proposal with the target's token at
        ``positions`` replayed positions, ``matches`` of which agreed. ``measured_at``:
        the decode step (``steps``) by which they had run, when they are read back
        later than that (the catch-up's tally is read a window late); default now."""
        if positions > 0:
            self._replay_agreement.add(matches / positions)
            self._fresh["replay"] = self._steps if measured_at is None else measured_at

    @property
    def steps(self) -> int:
        """Decode steps counted so far."""
        return self._steps

    def agrees_next(self) -> bool:
        """True if the next ``before_decode`` agrees the inputs (the same steps on every rank)."""
        return (self._steps + 1) % self._agree_every == 0

    def on_catch_up_time(self, positions: int, seconds: float) -> None:
        if positions > 0 and seconds >= 0:
            self._catch_up[0] += seconds
            self._catch_up[1] += positions

    # ---------------------------------------------------------------- per decode step
    def before_decode(
        self, batch_size: int, context_len: float, counters: Callable[[], AcceptCounters] | None
    ) -> Estimates | None:
        """Called before each decode step's decision; returns new agreed estimates every
        ``agree_every`` steps (the same steps on every rank), else None."""
        now = self._clock()
        interval = None  # (mode, batch size, host seconds) of the step just run, if it was timed
        if self._last is not None and self._run >= 2:
            start, mode, size, ctx = self._last
            interval = (mode, size, now - start)
            predicted = self.table.seconds(mode, size, ctx) if self.table is not None else None
            if predicted:
                self.corrections.observe("host", *interval, predicted)
        tokens = None  # output tokens of a speculative step: verified requests + accepted drafts
        if counters is not None and self._mode is Mode.SPEC and self._mode_run > SETTLE_STEPS:
            tokens = self._observe(counters())
        else:
            self._counters.clear()  # deltas across plain steps would count them as rejections
        if interval is not None:
            mode, size, seconds = interval
            self._count_realized(mode, size if mode is Mode.PLAIN else tokens, seconds)
        self._steps += 1
        if self._steps % self._agree_every:
            return None
        for mode, (count, seconds) in self._window.items():
            if seconds > 0:
                self.realized[mode] = count / seconds
            self._window[mode] = [0, 0.0]
        agreed = self._agree(
            {
                "corrections": self.corrections.snapshot(),
                "replay": self._replay_agreement.value,
                "replay_step": self._fresh["replay"],
                "catch_up": list(self._catch_up),
            }
        )
        self.estimates = self._estimates(agreed)
        return self.estimates

    def after_decision(self, mode: Mode, batch_size: int, context_len: float) -> None:
        """The decode step about to run: ``mode`` at ``batch_size`` requests."""
        same = self._last is not None and self._last[1] is mode
        self._run = self._run + 1 if same else 1
        if mode is not self._mode:
            self._mode_run, self._phase_start = 1, self._steps
        else:
            self._mode_run += 1
        self._mode = mode
        self._last = (self._clock(), mode, batch_size, context_len)

    # ----------------------------------------------------------------------- helpers
    def _count_realized(self, mode: Mode, tokens: int | None, seconds: float) -> None:
        if tokens is not None and seconds > 0 and math.isfinite(seconds):
            self._window[mode][0] += tokens
            self._window[mode][1] += seconds

    def _observe(self, counters: AcceptCounters) -> int | None:
        """Folds the counters' increase into the acceptance; returns the output tokens
        it counts (each verify gives one token plus its accepted drafts), None if the
        counters did not move (no request seen before, nothing verified since)."""
        correct = verify = 0
        seen = {}
        for rid, c, v in counters:
            seen[rid] = (c, v)
            old = self._counters.get(rid)
            if old is not None and v > old[1]:
                correct += c - old[0]
                verify += v - old[1]
        self._counters = seen
        if verify > 0:
            if self._fresh["counters"] < self._phase_start:
                self._counter_acceptance.value = None  # a new speculative phase: start afresh
            self._counter_acceptance.add(1.0 + correct / verify)
            self._fresh["counters"] = self._steps
            return verify + correct
        return None

    def replay_acceptance(self, agreement: float | None) -> float | None:
        """The expected accept length the replay's agreement share predicts, bias-corrected."""
        if self.simulated_acceptance is not None:
            return self.simulated_acceptance
        if agreement is None:
            return None
        bias = self._replay_bias.value if self._replay_bias.value is not None else 1.0
        return max(1.0, expected_accept_length(agreement, self._draft_steps) * bias)

    def _estimates(self, agreed: dict) -> Estimates:
        costs = None if self.table is None else CostModel.with_snapshot(self.table, agreed["corrections"])
        seconds, positions = agreed["catch_up"]
        counted = self._counter_acceptance.value
        replayed = self.replay_acceptance(agreed["replay"])
        replay_step = agreed["replay_step"]
        # How the replay's estimate compared with the counters measured after it.
        if counted is not None and replayed is not None and self.simulated_acceptance is None:
            raw = expected_accept_length(agreed["replay"], self._draft_steps)
            if self._fresh["counters"] > replay_step > self._bias_from_replay and raw > 0:
                self._replay_bias.add(counted / raw)
                self._bias_from_replay = replay_step
        if replayed is not None and (counted is None or replay_step >= self._fresh["counters"]):
            acceptance, source = (
                replayed,
                ("simulated" if self.simulated_acceptance is not None else "replay"),
            )
        elif counted is not None:
            acceptance, source = counted, "counters"
        elif self.simulated_acceptance is not None:
            acceptance, source = self.simulated_acceptance, "simulated"
        else:
            acceptance, source = None, "none"
        return Estimates(
            costs=costs,
            acceptance=acceptance,
            acceptance_source=source,
            catch_up_seconds_per_token=seconds / positions if positions else 0.0,
        )
