"""The goodput policy and its inputs: unit tests and Hypothesis state machines (pure Python)."""

from __future__ import annotations

import pytest
from hypothesis import event, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from sglang_dynspec import config
from sglang_dynspec.controller import ModeController
from sglang_dynspec.estimates import SETTLE_STEPS, EstimateFeed
from sglang_dynspec.goodput import (
    BUCKET_EDGES,
    AcceptanceMeter,
    Estimates,
    GoodputPolicy,
    GoodputSettings,
    bucket_of,
)
from sglang_dynspec.policy import Mode

S, P = Mode.SPEC, Mode.PLAIN


def table(t_spec: float, t_plain: float, sizes=range(1, 1025)) -> dict:
    """Step times of both modes at every bucket (seconds)."""
    buckets = {bucket_of(b) for b in sizes}
    return {**{(S, b): t_spec for b in buckets}, **{(P, b): t_plain for b in buckets}}


def test_buckets_cover_every_size_in_order():
    assert bucket_of(1) == 0 and bucket_of(2) == 1 and bucket_of(3) == 2
    assert [bucket_of(e) for e in BUCKET_EDGES] == list(range(len(BUCKET_EDGES)))
    assert bucket_of(10_000) == len(BUCKET_EDGES) - 1
    sizes = range(0, 2000)
    assert all(bucket_of(a) <= bucket_of(b) for a, b in zip(sizes, sizes[1:]))


def test_ratio_is_acceptance_times_plain_over_spec_time():
    est = Estimates(acceptance=3.0, step_seconds=table(0.015, 0.006))
    assert est.ratio(32) == pytest.approx(3.0 * 0.006 / 0.015)
    assert est.predicted_tokens_per_second(32, S) == pytest.approx(32 * 3.0 / 0.015)
    assert est.predicted_tokens_per_second(32, P) == pytest.approx(32 / 0.006)
    assert Estimates(step_seconds=table(0.015, 0.006)).ratio(32) is None  # no acceptance yet


def test_first_measures_the_current_mode_then_probes_the_other():
    p = GoodputPolicy(GoodputSettings(min_dwell_steps=2))
    assert [p.decide(8) for _ in range(3)] == [S, S, S]  # nothing measured: keep measuring spec
    p.update(Estimates(acceptance=1.0, step_seconds={(S, bucket_of(8)): 0.010}))
    assert p.decide(8) is P and p.last_reason.startswith("probe plain")
    assert p.decide(8) is P  # waits for the plain measurement
    p.update(Estimates(acceptance=1.0, step_seconds={(S, bucket_of(8)): 0.010, (P, bucket_of(8)): 0.005}))
    assert p.decide(8) is P  # R = 0.5: plain pays
    p.update(Estimates(acceptance=4.0, step_seconds={(S, bucket_of(8)): 0.010, (P, bucket_of(8)): 0.005}))
    assert p.decide(8) is S and p.last_reason.startswith("R = 2.00")


def test_hard_bound_never_speculates_above_it():
    p = GoodputPolicy(GoodputSettings(min_dwell_steps=1, max_spec_batch=16))
    p.update(Estimates(acceptance=5.0, step_seconds=table(0.001, 0.010)))  # speculation pays hugely
    assert p.decide(17) is P and "bound 16" in p.last_reason
    assert p.decide(16) is S


@pytest.mark.parametrize(
    "kwargs", [{"margin": 1.0}, {"margin": -0.1}, {"min_dwell_steps": 0}, {"max_spec_batch": 0}]
)
def test_settings_reject_bad_values(kwargs):
    with pytest.raises(ValueError):
        GoodputSettings(**kwargs)


# ------------------------------------------------------------------ state machine
class GoodputMachine(RuleBasedStateMachine):
    """Random batch sizes, step times and acceptance fed to a policy; after every step:

    * it never switches sooner than the dwell allows;
    * with both modes measured at the batch's bucket, no re-probe due and the dwell
      allowing, it runs the better predicted mode whenever R is outside [1 - m, 1 + m];
    * it never speculates above the bound;
    * a twin fed the same inputs decides identically.
    """

    @initialize(
        dwell=st.integers(1, 12),
        margin=st.sampled_from([0.0, 0.05, 0.2]),
        bound=st.none() | st.integers(1, 128),
        reprobe=st.integers(20, 400),
    )
    def setup(self, dwell, margin, bound, reprobe):
        self.s = GoodputSettings(
            margin=margin, min_dwell_steps=dwell, reprobe_every=reprobe, max_spec_batch=bound
        )
        note(f"{self.s}")
        self.policy, self.twin = GoodputPolicy(self.s), GoodputPolicy(self.s)
        self.steps = 0
        self.last_switch: int | None = None
        self.visited: dict = {}

    @rule(
        acceptance=st.none() | st.floats(1.0, 6.0),
        t_spec=st.floats(0.001, 0.05),
        t_plain=st.floats(0.001, 0.05),
        full=st.booleans(),
    )
    def new_estimates(self, acceptance, t_spec, t_plain, full):
        times = table(t_spec, t_plain) if full else {(S, bucket_of(1)): t_spec}
        est = Estimates(acceptance=acceptance, step_seconds=times)
        self.policy.update(est)
        self.twin.update(est)

    @rule(bs=st.integers(0, 160), repeat=st.integers(1, 30))
    def decode_steps(self, bs, repeat):
        for _ in range(repeat):
            self._step(bs)

    def _step(self, bs):
        p, s = self.policy, self.s
        before = p.mode
        dwell_allows = self.last_switch is None or self.steps - self.last_switch >= s.min_dwell_steps
        other = P if before is S else S
        last_other = self.visited.get((other, bucket_of(bs)))
        reprobe_due = last_other is not None and self.steps - last_other >= s.reprobe_every
        mode = p.decide(bs)
        assert self.twin.decide(bs) is mode, "two policies fed the same inputs disagreed"
        if mode is not before:
            event("switch")
            assert dwell_allows, "switched before the dwell allowed it"
            self.last_switch = self.steps
        if s.max_spec_batch is not None and bs > s.max_spec_batch:
            assert mode is P or not dwell_allows
            assert mode is P or before is S
        ratio = p.estimates.ratio(bs)
        bounded = s.max_spec_batch is not None and bs > s.max_spec_batch
        if ratio is not None and dwell_allows and not reprobe_due and not bounded:
            if ratio > 1 + s.margin:
                assert mode is S, f"R = {ratio:.2f} but {mode}"
            if ratio < 1 - s.margin:
                assert mode is P, f"R = {ratio:.2f} but {mode}"
        self.visited[(mode, bucket_of(bs))] = self.steps
        self.steps += 1

    @invariant()
    def mode_is_a_mode(self):
        if hasattr(self, "policy"):
            assert self.policy.mode in (S, P)


GoodputMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
TestGoodputMachine = GoodputMachine.TestCase


def run(policy: GoodputPolicy, bs: int, steps: int) -> list[Mode]:
    return [policy.decide(bs) for _ in range(steps)]


def test_rising_acceptance_during_a_plain_phase_brings_speculation_back():
    p = GoodputPolicy(GoodputSettings(min_dwell_steps=4, reprobe_every=50))
    times = table(0.012, 0.006)
    p.update(Estimates(acceptance=1.2, step_seconds=times))  # R = 0.6: plain
    assert run(p, 64, 10)[-1] is P
    # Acceptance is measured only while speculating: the re-probe measures it again.
    p.update(Estimates(acceptance=3.5, step_seconds=times))  # the probe measured 3.5: R = 1.75
    modes = run(p, 64, 120)
    assert modes[-1] is S and S in modes


def test_collapsing_acceptance_during_a_speculative_phase_ends_it():
    p = GoodputPolicy(GoodputSettings(min_dwell_steps=4))
    times = table(0.008, 0.006)
    p.update(Estimates(acceptance=3.0, step_seconds=times))  # R = 2.25
    assert run(p, 8, 10) == [S] * 10
    p.update(Estimates(acceptance=1.05, step_seconds=times))  # R = 0.79
    assert p.decide(8) is P and p.last_reason.startswith("R = 0.79")


# ------------------------------------------------------------------------- inputs
class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_feed_times_same_mode_runs_and_agrees_every_n_steps():
    clock, agreed = FakeClock(), []

    def agree(table):
        agreed.append(dict(table))
        return {k: v * 2 for k, v in table.items()}  # rank 0's values win, whatever they are

    feed = EstimateFeed(agree=agree, agree_every=4, clock=clock)
    for step in range(8):
        est = feed.before_decode(10, counters=None)
        feed.after_decision(P, 10)
        clock.now += 0.005
        if step == 3:
            assert est is not None and len(agreed) == 1
        elif step != 7:
            assert est is None
    # Steps 1..SETTLE_STEPS after the start are not timed; the rest are 5 ms each.
    assert feed.times.seconds == {(P, bucket_of(10)): pytest.approx(0.005)}
    assert feed.estimates.step_seconds == {(P, bucket_of(10)): pytest.approx(0.010)}  # the agreed copy
    feed.on_other_step()  # a prefill between two decode steps: that interval is not a step time
    clock.now += 1.0
    feed.before_decode(10, counters=None)
    assert feed.times.seconds[(P, bucket_of(10))] == pytest.approx(0.005)


def test_feed_measures_acceptance_over_speculative_steps_only():
    clock = FakeClock()
    feed = EstimateFeed(agree=lambda t: t, agree_every=1, clock=clock)
    counters = {"a": [0, 0], "b": [0, 0]}

    def step(mode, correct_per_step):
        est = feed.before_decode(2, lambda: [(rid, c, v) for rid, (c, v) in counters.items()])
        feed.after_decision(mode, 2)
        for c in counters.values():  # the scheduler advances the counters of every step
            c[0] += correct_per_step if mode is S else 0
            c[1] += 1
        clock.now += 0.01
        return est

    for _ in range(SETTLE_STEPS + 4):
        est = step(S, 2)  # 2 correct drafts per step: 3 tokens per step
    assert est.acceptance == pytest.approx(3.0) and est.acceptance_source == "measured"
    for _ in range(10):
        est = step(P, 0)  # plain steps advance verify_ct with no correct drafts: not rejections
    assert est.acceptance == pytest.approx(3.0)


def test_simulated_acceptance_is_used_and_named():
    feed = EstimateFeed(agree=lambda t: t, agree_every=1, simulated_acceptance=3.0)
    est = feed.before_decode(4, counters=lambda: pytest.fail("counters must not be read"))
    assert (est.acceptance, est.acceptance_source) == (3.0, "simulated")


def test_acceptance_meter_averages_tokens_per_step():
    m = AcceptanceMeter(alpha=0.5)
    m.observe(0, 0)
    assert m.value is None
    m.observe(6, 3)  # 3 tokens per step
    m.observe(0, 2)  # 1 token per step
    assert m.value == pytest.approx(2.0)


def test_controller_feeds_the_goodput_policy_and_logs_the_reason():
    from sglang_dynspec.telemetry import TelemetrySink

    class Recorder(TelemetrySink):
        def __init__(self):
            self.switches, self.estimates = [], []

        def on_switch(self, switch, steps_before):
            self.switches.append(switch)

        def on_estimates(self, estimates, batch_size):
            self.estimates.append(estimates)

    rec, clock = Recorder(), FakeClock()
    feed = EstimateFeed(agree=lambda t: t, agree_every=2, simulated_acceptance=1.0, clock=clock)
    c = ModeController(GoodputPolicy(GoodputSettings(min_dwell_steps=2)), [rec], feed)
    for _ in range(40):
        mode = c.before_decode(8)
        c.after_decode(mode)
        clock.now += 0.010 if mode is S else 0.004  # speculation at acceptance 1 only costs
    assert rec.estimates and rec.switches
    assert rec.switches[0].new is P and rec.switches[0].reason.startswith("probe plain")
    assert c.policy.mode is P  # R = 1 * 0.004 / 0.010 = 0.4


def test_goodput_policy_needs_a_feed():
    with pytest.raises(ValueError, match="EstimateFeed"):
        ModeController(GoodputPolicy(GoodputSettings()))


# ------------------------------------------------------------------------- config
def test_policy_flag_and_its_combinations():
    env = {config.POLICY.env: "goodput"}
    s = config.settings_from_environ(env)
    assert s.policy == "goodput" and s.speculation_bound is None
    assert isinstance(config.build_policy(s), GoodputPolicy)
    s = config.settings_from_environ({**env, config.DISABLE_THRESHOLD.env: "48"})
    assert config.build_policy(s).settings.max_spec_batch == 48
    assert config.settings_from_environ({}).policy == "threshold"
    with pytest.raises(config.ConfigError, match="--speculative-enable-batch-threshold has no meaning"):
        config.settings_from_environ({**env, config.ENABLE_THRESHOLD.env: "4"})
    with pytest.raises(
        config.ConfigError, match="--speculative-dynamic-policy .* threshold, goodput, got 'fast'"
    ):
        config.settings_from_environ({config.POLICY.env: "fast"})
    with pytest.raises(config.ConfigError, match="SGLANG_SIMULATE_ACC_LEN must be a number"):
        config.settings_from_environ({config.SIMULATED_ACCEPTANCE_ENV: "x"})
    assert config.settings_from_environ({config.SIMULATED_ACCEPTANCE_ENV: "2.5"}).simulated_acceptance == 2.5


# ------------------------------------------------------------ telemetry and bench
def test_estimates_reach_metrics_and_the_crossover_report():
    from prometheus_client import CollectorRegistry, generate_latest

    from sglang_dynspec.bench.crossover import crossover, report
    from sglang_dynspec.bench.scrape import parse_metrics
    from sglang_dynspec.prometheus_export import PrometheusExport

    # Step times shaped like the H200 8B numbers of issue 10: plain 4.9 + 0.027 B ms,
    # speculative 7.4 + 0.33 B ms.
    times = {}
    for b in (1, 8, 32, 64, 128):
        times[(S, bucket_of(b))] = (7.4 + 0.33 * b) / 1e3
        times[(P, bucket_of(b))] = (4.9 + 0.027 * b) / 1e3
    registry = CollectorRegistry()
    export = PrometheusExport({"model_name": "goodput-test"}, registry)
    export.on_estimates(Estimates(acceptance=3.0, acceptance_source="measured", step_seconds=times), 32)
    snap = parse_metrics(generate_latest(registry).decode())
    assert (snap.acceptance, snap.acceptance_source) == (3.0, "measured")
    assert snap.step_seconds[("spec", 128)] == pytest.approx((7.4 + 0.33 * 128) / 1e3)
    # R(B) = acc (4.9 + 0.027 B) / (7.4 + 0.33 B): at acceptance 3, 1.53 at B = 8 and 0.96 at
    # B = 32, so of the measured buckets (1, 8, 32, 64, 128) speculation wins up to 8.
    assert crossover(snap.step_seconds, 3.0) == 8
    assert crossover(snap.step_seconds, 5.0) == 64  # R(32) = 1.60, R(64) = 1.16, R(128) = 0.84
    assert crossover(snap.step_seconds, 1.5) is None  # R(1) = 0.96
    text = report(snap, [1.0, 3.0])
    assert "speculation wins up to: 8" in text and "speculation wins up to: never" in text
    assert registry.get_sample_value(
        "sglang:spec_dynamic_predicted_tokens_per_second", {"model_name": "goodput-test", "mode": "plain"}
    ) == pytest.approx(32 / times[(P, bucket_of(32))])


def test_probe_steps_are_counted_until_the_measurements_confirm_the_mode():
    clock = FakeClock()
    feed = EstimateFeed(agree=lambda t: t, agree_every=2, simulated_acceptance=1.0, clock=clock)
    c = ModeController(GoodputPolicy(GoodputSettings(min_dwell_steps=2)), (), feed)
    for _ in range(40):
        mode = c.before_decode(8)
        c.after_decode(mode)
        clock.now += 0.010 if mode is S else 0.004
    probes = c.stats.probe_steps
    # The plain probe turned out to pay (R = 0.4): its steps count until the first estimate
    # with both modes measured confirmed it; nothing after that is a probe.
    assert 0 < probes[P] < c.stats.decode_steps[P] and probes[S] == 0, (probes, c.stats.decode_steps)
