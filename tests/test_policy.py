"""The threshold policy: unit tests and a Hypothesis state machine over batch-size sequences,
driven through the controller that owns it in the worker.

Pure Python, so these run without SGLang or torch.
"""

from __future__ import annotations

import pytest
from controller_steps import drive
from hypothesis import event, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from sglang_dynspec.controller import ModeController
from sglang_dynspec.policy import Mode, SwitchThresholds, ThresholdPolicy


def controller(n, m, k) -> ModeController:
    return ModeController(ThresholdPolicy(SwitchThresholds(n, m, k)))


def test_switches_off_above_n_and_back_at_m():
    c = controller(4, 2, 0)
    modes = drive(c, [1, 4, 5, 5, 3, 4, 2, 1])
    S, P = Mode.SPEC, Mode.PLAIN
    assert modes == [S, S, P, P, P, P, S, S]
    assert c.stats.switches == {Mode.PLAIN: 1, Mode.SPEC: 1}
    assert c.stats.decode_steps == {Mode.SPEC: 4, Mode.PLAIN: 4}


def test_dwell_delays_a_switch_but_does_not_cancel_it():
    modes = drive(controller(4, 2, 3), [9, 1, 1, 1, 1])
    # Switches to plain at once (no earlier switch), then must stay 3 steps.
    assert modes == [Mode.PLAIN, Mode.PLAIN, Mode.PLAIN, Mode.SPEC, Mode.SPEC]


def test_each_switch_is_reported_once_at_the_step_it_takes_effect():
    from sglang_dynspec.telemetry import TelemetrySink

    class Recorder(TelemetrySink):
        def __init__(self):
            self.switches = []

        def on_switch(self, switch, steps_before):
            self.switches.append((switch, dict(steps_before)))

    rec = Recorder()
    c = ModeController(ThresholdPolicy(SwitchThresholds(1, 0, 0)), [rec])
    drive(c, [1, 5, 5, 0])
    assert [(s.step, s.batch_size, s.old, s.new) for s, _ in rec.switches] == [
        (1, 5, Mode.SPEC, Mode.PLAIN),
        (3, 0, Mode.PLAIN, Mode.SPEC),
    ]
    assert [before for _, before in rec.switches] == [
        {Mode.SPEC: 1, Mode.PLAIN: 0},
        {Mode.SPEC: 1, Mode.PLAIN: 2},
    ]


@pytest.mark.parametrize(
    "n, m, k",
    [(-1, 0, 0), (4, -1, 0), (4, 2, -1), (4, 4, 0), (4, 5, 0)],
)
def test_thresholds_reject_bad_values(n, m, k):
    with pytest.raises(ValueError):
        SwitchThresholds(n, m, k)


def test_negative_batch_size_is_rejected():
    with pytest.raises(ValueError):
        ThresholdPolicy(SwitchThresholds(4, 2, 0)).decide(-1)


# ------------------------------------------------------------------- state machine
class SwitchingMachine(RuleBasedStateMachine):
    """Feeds random decode batch sizes to a policy and checks, after every step:

    * it never switches sooner than the dwell allows;
    * once the dwell allows, it is plain above N and speculating at or below M;
    * between the thresholds it keeps its mode;
    * a twin fed the same sequence decides identically (determinism);
    * its counters agree with the modes it returned.
    """

    @initialize(
        n=st.integers(min_value=1, max_value=64),
        gap=st.integers(min_value=1, max_value=16),
        k=st.integers(min_value=0, max_value=12),
    )
    def setup(self, n, gap, k):
        self.t = SwitchThresholds(n, max(0, n - gap), k)
        note(f"thresholds {self.t}")
        self.controller = ModeController(ThresholdPolicy(self.t))
        self.twin = ThresholdPolicy(self.t)
        self.modes: list[Mode] = []
        self.switch_steps: list[int] = []
        self.prev_mode = Mode.SPEC

    def _step(self, bs: int) -> None:
        steps_since_switch = len(self.modes) - self.switch_steps[-1] if self.switch_steps else None
        dwell_allows = steps_since_switch is None or steps_since_switch >= self.t.min_dwell_steps
        (mode,) = drive(self.controller, [bs])
        assert self.twin.decide(bs) is mode, "two policies fed the same sizes disagreed"
        note(f"step {len(self.modes)}: batch {bs} -> {mode.value}")

        if mode is not self.prev_mode:
            event("switch")
            assert dwell_allows, (
                f"switched after {steps_since_switch} steps, dwell is {self.t.min_dwell_steps}"
            )
            self.switch_steps.append(len(self.modes))
        if dwell_allows and bs > self.t.disable_above:
            assert mode is Mode.PLAIN, f"batch {bs} > N={self.t.disable_above} but {mode}"
        if dwell_allows and bs <= self.t.enable_at_or_below:
            assert mode is Mode.SPEC, f"batch {bs} <= M={self.t.enable_at_or_below} but {mode}"
        if self.t.enable_at_or_below < bs <= self.t.disable_above:
            assert mode is self.prev_mode, "switched inside the hysteresis band"
        self.modes.append(mode)
        self.prev_mode = mode

    @rule(bs=st.integers(min_value=0, max_value=96))
    def decode_step(self, bs):
        self._step(bs)

    @rule(bs=st.integers(min_value=0, max_value=96), repeat=st.integers(1, 20))
    def steady_load(self, bs, repeat):
        # Long runs at one size are what lets the dwell expire; single random
        # steps rarely produce them.
        for _ in range(repeat):
            self._step(bs)

    @invariant()
    def counters_match_returned_modes(self):
        if not hasattr(self, "controller"):
            return
        stats = self.controller.stats
        assert stats.total_decode_steps == len(self.modes)
        assert stats.decode_steps[Mode.SPEC] == self.modes.count(Mode.SPEC)
        assert stats.decode_steps[Mode.PLAIN] == self.modes.count(Mode.PLAIN)
        assert sum(stats.switches.values()) == len(self.switch_steps)
        assert self.controller.policy.mode is self.prev_mode


SwitchingMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=60, deadline=None)
TestSwitchingMachine = SwitchingMachine.TestCase
