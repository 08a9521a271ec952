"""The switch policy: unit tests and a Hypothesis state machine over batch-size sequences.

The policy is pure Python, so these run without SGLang or torch.
"""

from __future__ import annotations

import pytest
from hypothesis import event, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from sglang_dynspec.policy import Mode, SwitchPolicy, SwitchThresholds


def run(policy: SwitchPolicy, sizes) -> list[Mode]:
    return [policy.decide(bs) for bs in sizes]


def test_switches_off_above_n_and_back_at_m():
    p = SwitchPolicy(SwitchThresholds(disable_above=4, enable_at_or_below=2, min_dwell_steps=0))
    modes = run(p, [1, 4, 5, 5, 3, 4, 2, 1])
    S, P = Mode.SPEC, Mode.PLAIN
    assert modes == [S, S, P, P, P, P, S, S]
    assert p.switches == {Mode.PLAIN: 1, Mode.SPEC: 1}
    assert p.steps == {Mode.SPEC: 4, Mode.PLAIN: 4}


def test_dwell_delays_a_switch_but_does_not_cancel_it():
    p = SwitchPolicy(SwitchThresholds(disable_above=4, enable_at_or_below=2, min_dwell_steps=3))
    modes = run(p, [9, 1, 1, 1, 1])
    # Switches to plain at once (no earlier switch), then must stay 3 steps.
    assert modes == [Mode.PLAIN, Mode.PLAIN, Mode.PLAIN, Mode.SPEC, Mode.SPEC]


def test_last_switch_is_reported_once():
    p = SwitchPolicy(SwitchThresholds(1, 0, 0))
    p.decide(5)
    assert p.last_switch is not None and p.last_switch.new is Mode.PLAIN
    assert p.last_switch.step == 0 and p.last_switch.batch_size == 5
    p.decide(5)
    assert p.last_switch is None


@pytest.mark.parametrize(
    "n, m, k",
    [(-1, 0, 0), (4, -1, 0), (4, 2, -1), (4, 4, 0), (4, 5, 0)],
)
def test_thresholds_reject_bad_values(n, m, k):
    with pytest.raises(ValueError):
        SwitchThresholds(n, m, k)


def test_negative_batch_size_is_rejected():
    with pytest.raises(ValueError):
        SwitchPolicy(SwitchThresholds(4, 2, 0)).decide(-1)


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
        self.policy = SwitchPolicy(self.t)
        self.twin = SwitchPolicy(self.t)
        self.modes: list[Mode] = []
        self.switch_steps: list[int] = []
        self.prev_mode = Mode.SPEC

    def _step(self, bs: int) -> None:
        steps_since_switch = (
            len(self.modes) - self.switch_steps[-1] if self.switch_steps else None
        )
        dwell_allows = steps_since_switch is None or steps_since_switch >= self.t.min_dwell_steps
        mode = self.policy.decide(bs)
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
        if not hasattr(self, "policy"):
            return
        p = self.policy
        assert p.decode_steps == len(self.modes)
        assert p.steps[Mode.SPEC] == self.modes.count(Mode.SPEC)
        assert p.steps[Mode.PLAIN] == self.modes.count(Mode.PLAIN)
        assert sum(p.switches.values()) == len(self.switch_steps)
        assert p.mode is self.prev_mode


SwitchingMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=60, deadline=None)
TestSwitchingMachine = SwitchingMachine.TestCase
