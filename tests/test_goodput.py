"""The decision: cost model, goodput policy, estimate feed and controller (pure Python).

``DecisionMachine`` at the end drives the real ``ModeController``, ``EstimateFeed`` and
``GoodputPolicy`` against a simulated server: a fake clock; true step costs that grow
with batch size and context; a start-up table measured off by up to 1.5x per mode;
acceptance that rises and collapses in either mode, with the catch-up's replay
predicting it with a bias the feed must learn; prefills between decode steps at every
rate from every decode step to none. Properties: the decision settles on the faster mode
within ``SETTLE_BOUND`` decode steps of the world's last change, and never switches
sooner than the dwell after the last switch (going plain is free and immediate). A
resume's catch-up runs inside the first speculative step, and its time reaches the host
one step late, as under the overlap scheduler. The table's error is a factor common to
both modes (other clocks, a host-bound server) times up to 10% per mode: the running
mode's measurements correct the common part, nothing measures the other mode's own
error without running it, so true ratios within ``AMBIGUOUS`` of the switching point
are not judged.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
from hypothesis import given, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from sglang_dynspec import config
from sglang_dynspec.controller import ModeController
from sglang_dynspec.cost_cache import cache_file, format_table, read_cached, startup_costs, write_cached
from sglang_dynspec.cost_model import (
    BUCKET_EDGES,
    CostCorrections,
    CostModel,
    StepCost,
    StepCostTable,
    bucket_of,
)
from sglang_dynspec.estimates import SETTLE_STEPS, EstimateFeed
from sglang_dynspec.goodput import (
    Estimates,
    GoodputPolicy,
    GoodputSettings,
    crossover_batch_size,
    expected_accept_length,
)
from sglang_dynspec.policy import Mode
from sglang_dynspec.telemetry import TelemetrySink

S, P = Mode.SPEC, Mode.PLAIN
SIZES, CONTEXTS = (1, 4, 16, 32, 64, 128), (128, 1024, 4096)


def linear_costs(spec=(6e-3, 0.15e-3, 0.4e-6), plain=(5e-3, 0.03e-3, 0.1e-6)):
    """t(mode, B, c) = a + b*B + k*B*c seconds; the verify's context term is the larger."""

    def t(mode: Mode, b: float, c: float) -> float:
        a, per_b, per_bc = spec if mode is S else plain
        return a + per_b * b + per_bc * b * c

    return t


def measured_table(t, scale=None) -> StepCostTable:
    scale = scale or {}
    return StepCostTable.from_points(
        StepCost(m, b, c, t(m, b, c) * scale.get(m, 1.0)) for m in Mode for b in SIZES for c in CONTEXTS
    )


# ------------------------------------------------------------------------ cost model
def test_buckets_cover_every_size_in_order():
    assert bucket_of(1) == 0 and bucket_of(2) == 1 and bucket_of(3) == 2
    assert [bucket_of(e) for e in BUCKET_EDGES] == list(range(len(BUCKET_EDGES)))
    sizes = range(0, 2000)
    assert all(bucket_of(a) <= bucket_of(b) for a, b in zip(sizes, sizes[1:]))


@settings(max_examples=300, deadline=None)
@given(b=st.integers(1, 512), c=st.floats(0, 16384), mode=st.sampled_from(list(Mode)))
def test_table_interpolates_costs_linear_in_batch_and_context_exactly(b, c, mode):
    """a + b*B + k*B*c is bilinear: interpolation between the timed points, and linear
    extrapolation beyond the largest batch and on both sides of the contexts, reproduce it."""
    t = linear_costs()
    assert measured_table(t).seconds(mode, b, c) == pytest.approx(t(mode, b, c), rel=1e-9)


def test_table_round_trips_through_rows_and_refuses_bad_points():
    table = measured_table(linear_costs())
    assert StepCostTable.from_rows(table.as_rows()) == table
    assert StepCostTable.from_points([]).seconds(S, 4, 100) is None
    for bad in (dict(batch_size=0), dict(seconds=0.0), dict(seconds=float("nan")), dict(context_len=-1)):
        with pytest.raises(ValueError):
            StepCost(**{"mode": "spec", "batch_size": 1, "context_len": 1, "seconds": 1e-3, **bad})


def test_corrections_scale_the_table_and_the_host_bounds_the_step():
    table = measured_table(linear_costs())
    c = CostCorrections(alpha=1.0, first_samples=1)
    predicted = table.seconds(S, 32, 1024)
    c.observe("device", S, 32, 2 * predicted, predicted)

    def model_of(c):  # every sample taken at its word (the weighing is tested below)
        return dataclasses.replace(CostModel.with_snapshot(table, c.snapshot()), prior_samples=0)

    model = model_of(c)
    assert model.seconds(S, 32, 1024) == pytest.approx(2 * predicted)
    # A bucket not run yet takes the mode's mean ratio, a mode not run yet the other's.
    assert model.seconds(S, 2, 128) == pytest.approx(2 * table.seconds(S, 2, 128))
    assert model.seconds(P, 32, 1024) == pytest.approx(2 * table.seconds(P, 32, 1024))
    c.observe("device", P, 64, table.seconds(P, 64, 1024), table.seconds(P, 64, 1024))
    assert model_of(c).seconds(P, 32, 1024) == pytest.approx(table.seconds(P, 32, 1024))
    for _ in range(2):  # host-bound: the step takes longer (a first sample moves it 2x at most)
        c.observe("host", S, 32, 3 * predicted, predicted)
    assert model_of(c).seconds(S, 32, 1024) == pytest.approx(3 * predicted)


def test_a_bucket_measured_a_few_times_is_weighed_against_its_neighbours():
    table = measured_table(linear_costs())
    c = CostCorrections(alpha=1.0, first_samples=1)

    def observe(kind, mode, batch, ratio, times=1):
        for _ in range(times):
            c.observe(kind, mode, batch, ratio, 1.0)

    def ratio(kind, mode, batch):
        model = CostModel.with_snapshot(table, c.snapshot())
        ratios, samples = (
            (model.device_ratio, model.device_samples)
            if kind == "device"
            else (model.host_ratio, model.host_samples)
        )
        return model.ratio(ratios, mode, batch, samples)

    k = CostModel(table).prior_samples
    observe("device", P, 48, 1.4, times=11)  # alone: weighed against the table's 1
    assert ratio("device", P, 48) == pytest.approx((11 * 1.4 + k * 1.0) / (11 + k))
    observe("device", S, 8, 1.2, times=5)  # a plain bucket alone: against the other mode's mean
    assert ratio("device", P, 48) == pytest.approx((11 * 1.4 + k * 1.2) / (11 + k))
    observe("device", P, 32, 0.98, times=400)
    observe("device", P, 64, 1.0, times=400)  # the mode's own neighbours come first
    assert ratio("device", P, 48) == pytest.approx((11 * 1.4 + k * 0.99) / (11 + k))
    assert ratio("device", P, 32) == pytest.approx((400 * 0.98 + k * 1.2) / (400 + k))
    observe("device", P, 48, 1.4, times=989)  # measured 1,000 times: its own
    assert ratio("device", P, 48) == pytest.approx(1.4, abs=0.03)
    assert ratio("device", P, 96) == pytest.approx((0.98 + 1.4 + 1.0) / 3)  # never run: the mean
    assert ratio("host", P, 48) is None  # kinds are apart
    snapshot = c.snapshot()
    assert snapshot["samples"]["device:plain:" + str(bucket_of(48))] == 1000
    # What /metrics shows is what the decision uses.
    model = CostModel.with_snapshot(table, snapshot)
    assert model.ratios()[("device", P, bucket_of(32))] == pytest.approx(ratio("device", P, 32))
    assert set(model.ratios()) == {
        ("device", m, bucket_of(b)) for m, b in ((P, 48), (S, 8), (P, 32), (P, 64))
    }


def test_plain_steps_slowed_by_admissions_do_not_lock_speculation_in():
    """H200, 3B shape, C=48 (benchmarks/results/h200-20261203-d79b2bd/): 11 plain steps
    taken while the 48 requests were admitted read 1.40x the table. As the bucket's whole
    correction that made plain at batch 48 40% dearer, R = 1.28 where the table gave
    0.92, and the policy speculated through both repeats, where EAGLE-3 is 0.88x the
    baseline; speculating, it never measured plain at that size again."""
    clock, table = FakeClock(), measured_table(linear_costs())
    acceptance = 0.92 * table.seconds(S, 48, 256) / table.seconds(P, 48, 256)
    feed = EstimateFeed(
        agree=lambda x: x, agree_every=16, clock=clock, table=table, simulated_acceptance=acceptance
    )
    controller = ModeController(
        GoodputPolicy(GoodputSettings()), feed=feed, start_timer=lambda: FakeTimer(clock)
    )

    def step(batch, context, slowdown=1.0):
        mode = controller.before_decode(batch, context_len=context)
        clock.now += table.seconds(mode, batch, context) * slowdown
        controller.after_decode(mode)
        return mode

    # The last requests of the previous load: long contexts, where plain pays at batch 32.
    tail = [step(32, 1024) for _ in range(48)]
    assert tail[-1] is P
    ramp = []
    for batch in (40, 42, 44, 46, 48, 48):  # admissions between plain steps that read 1.4x
        controller.on_other_step()
        ramp += [step(batch, 256, slowdown=1.4) for _ in range(2)]
    assert ramp.count(P) >= 11, ramp
    steady = [step(48, 256 + i) for i in range(256)]  # then the table is right
    assert steady.count(S) == 0, (steady.index(S), steady.count(S))


# ------------------------------------------------------------------ acceptance formula
@settings(max_examples=200, deadline=None)
@given(p=st.floats(0, 1), k=st.integers(0, 8))
def test_expected_accept_length_of_a_chain(p, k):
    e = expected_accept_length(p, k)
    closed = k + 1 if p == 1 else (1 - p ** (k + 1)) / (1 - p)
    assert e == pytest.approx(closed) and 1 <= e <= k + 1
    assert expected_accept_length(0.0, k) == 1 and expected_accept_length(1.0, k) == k + 1
    if p < 1:
        assert expected_accept_length(min(1.0, p + 0.01), k) >= e  # more agreement, longer accepts


# ----------------------------------------------------------------------------- policy
def est(acceptance=None, scale=None, catch_up=0.0, source="counters"):
    return Estimates(
        costs=CostModel(measured_table(linear_costs(), scale)),
        acceptance=acceptance,
        acceptance_source=source if acceptance is not None else "none",
        catch_up_seconds_per_token=catch_up,
    )


def test_without_acceptance_it_speculates_exactly_where_the_most_a_step_accepts_would_pay():
    e = est()
    p = GoodputPolicy(GoodputSettings(min_dwell_steps=1, max_acceptance=4.0))
    p.update(e)
    for b in (1, 8, 32, 64, 128):
        pays = 4.0 * e.step_seconds(P, b, 256) > (1 - p.settings.margin) * e.step_seconds(S, b, 256)
        assert (p.decide(b, 256) is S) == pays, b


def test_ratio_decides_with_hysteresis_and_the_dwell():
    p = GoodputPolicy(GoodputSettings(min_dwell_steps=4, margin=0.05))
    p.update(est(acceptance=2.0))
    b_low, b_high = 4, 128  # R > 1 at 4 requests, R < 1 at 128 (linear_costs, context 256)
    assert est(2.0).ratio(b_low, 256) > 1.2 and est(2.0).ratio(b_high, 256) < 0.8
    assert p.decide(b_low, 256) is S
    assert p.decide(b_high, 256) is P and "R = " in p.last_reason
    assert [p.decide(b_low, 256) for _ in range(4)] == [P, P, P, S]  # the dwell, then back
    assert p.decide(b_high, 256) is P  # going plain waits for no dwell


def test_resume_must_pay_for_the_catch_up():
    e_free, e_costly = est(acceptance=3.0), est(acceptance=3.0, catch_up=1.0)  # a second per position
    for e, expected in ((e_free, S), (e_costly, P)):
        p = GoodputPolicy(GoodputSettings(min_dwell_steps=1))
        p.mode = P
        p.update(e)
        assert p.decide(4, 256, catch_up_tokens=4 * 64) is expected


def test_hard_bound_never_speculates_above_it():
    p = GoodputPolicy(GoodputSettings(min_dwell_steps=1, speculation_bound=8))
    p.update(est(acceptance=5.0))
    assert p.decide(9, 0) is P and "bound 8" in p.last_reason
    assert p.decide(8, 0) is S


def test_without_step_costs_it_keeps_its_mode():
    p = GoodputPolicy(GoodputSettings(min_dwell_steps=1))
    assert [p.decide(b, 0) for b in (1, 500)] == [S, S] and p.last_ratio is None


@pytest.mark.parametrize(
    "kwargs", [dict(margin=1.0), dict(min_dwell_steps=0), dict(speculation_bound=0), dict(max_acceptance=0.5)]
)
def test_settings_reject_bad_values(kwargs):
    with pytest.raises(ValueError):
        GoodputSettings(**kwargs)


def test_crossover_is_the_first_batch_size_where_plain_wins():
    e = est()
    for acceptance in (1.5, 2.0, 3.0, 4.0):
        for c in (128, 2048):
            got = crossover_batch_size(e, acceptance, c, 512)
            brute = next((b for b in range(1, 513) if e.ratio(b, c, acceptance) < 1), None)
            assert got == brute
    assert crossover_batch_size(e, 3.0, 128, 512) > crossover_batch_size(e, 3.0, 4096, 512)  # context matters


# -------------------------------------------------------------------------------- feed
class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_feed_measures_acceptance_from_counters_despite_prefills_between_steps():
    clock = FakeClock()
    feed = EstimateFeed(agree=lambda x: x, agree_every=1, clock=clock, table=measured_table(linear_costs()))
    counters = {"a": [0, 0]}
    got = None
    for _ in range(12):
        e = feed.before_decode(4, 256, lambda: [(rid, c, v) for rid, (c, v) in counters.items()])
        got = e.acceptance if e.acceptance is not None else got
        feed.after_decision(S, 4, 256)
        counters["a"][0] += 2  # 2 drafts accepted per step: 3 tokens with the bonus
        counters["a"][1] += 1
        feed.on_other_step()  # a prefill after every decode step
        clock.now += 0.01
    assert got == pytest.approx(3.0) and feed.estimates.acceptance_source == "counters"


def test_feed_reports_realized_tokens_per_second_per_mode_over_its_last_window():
    clock = FakeClock()
    feed = EstimateFeed(agree=lambda x: x, agree_every=16, clock=clock, table=measured_table(linear_costs()))
    counters = {rid: [0, 0] for rid in range(8)}
    read = lambda: [(rid, c, v) for rid, (c, v) in counters.items()]  # noqa: E731
    assert feed.realized == {S: None, P: None}
    for i in range(32):  # 8 requests: speculating at 8 ms a step, 3 tokens a request, then plain at 4 ms
        mode = S if i < 16 else P
        feed.before_decode(8, 256, read)
        feed.after_decision(mode, 8, 256)
        if mode is S:
            for c in counters.values():
                c[0] += 2
                c[1] += 1
        if i == 20:
            feed.on_other_step()  # a prefill: the time since the last decode step is not a step's
            clock.now += 1.0
        clock.now += 0.008 if mode is S else 0.004
        if i == 15:
            assert feed.realized[S] == pytest.approx(8 * 3 / 0.008) and feed.realized[P] is None
    feed.before_decode(8, 256, read)  # the 33rd step closes the second window
    assert feed.realized[S] == pytest.approx(3000) and feed.realized[P] == pytest.approx(8 / 0.004)


def test_feed_corrects_costs_from_device_times_and_agrees_every_n_steps():
    table = measured_table(linear_costs())
    sent = []

    def agree(payload):
        sent.append(payload)
        return payload

    feed = EstimateFeed(agree=agree, agree_every=4, table=table, clock=FakeClock())
    for _ in range(3):
        assert feed.before_decode(32, 1024, None) is None
        feed.after_decision(P, 32, 1024)
        feed.on_step_device_time(P, 32, 1024, 2 * table.seconds(P, 32, 1024))
        feed.on_other_step()
    e = feed.before_decode(32, 1024, None)
    k = e.costs.prior_samples  # three samples at 2x, weighed against the table (nothing else ran)
    assert len(sent) == 1
    assert e.costs.seconds(P, 32, 1024) == pytest.approx(table.seconds(P, 32, 1024) * (3 * 2 + k) / (3 + k))


def test_replay_estimates_plain_mode_acceptance_and_learns_its_bias():
    feed = EstimateFeed(agree=lambda x: x, agree_every=1, draft_steps=3, clock=FakeClock())
    counters = {"a": [0, 0]}

    def step(mode, accepted=0):
        e = feed.before_decode(4, 256, lambda: [(r, c, v) for r, (c, v) in counters.items()])
        feed.after_decision(mode, 4, 256)
        counters["a"][1] += 1
        counters["a"][0] += accepted
        return e

    for _ in range(3):
        step(P)
    feed.on_replay(matches=50, positions=100)  # p = 0.5: 1 + .5 + .25 + .125 = 1.875
    e = step(P)
    assert e.acceptance_source == "replay" and e.acceptance == pytest.approx(1.875)
    for _ in range(SETTLE_STEPS + 3):
        e = step(S, accepted=1)  # the chain really accepts 2 tokens per step
    assert e.acceptance_source == "counters" and e.acceptance == pytest.approx(2.0)
    feed.on_replay(matches=50, positions=100)
    e = step(P)
    assert e.acceptance_source == "replay" and e.acceptance == pytest.approx(2.0)  # bias 2/1.875 learnt


def test_controller_reads_the_replays_back_only_before_agreeing_and_dates_them_when_closed():
    """The catch-up's tally is read (``set_replay_source``) only just before a step that
    agrees, every rank at the same steps; what it returns is dated by the step its
    window was closed at, so counters measured after that step are the fresher source."""
    feed = EstimateFeed(agree=lambda x: x, agree_every=4, draft_steps=3, clock=FakeClock())
    policy = GoodputPolicy(GoodputSettings(min_dwell_steps=1))
    controller = ModeController(policy, feed=feed, start_timer=lambda: FakeTimer(FakeClock()))
    reads, windows = [], []  # steps at which the source was read; windows it closed, not yet read back

    def read_back(stamp):
        reads.append(stamp)
        done, windows[:] = list(windows), [(50, 100, stamp)]  # one window late, as ReplayTally
        return done

    controller.set_replay_source(read_back)
    counters = {"a": [0, 0]}

    def step(plain: bool, accepted: int = 0):
        mode = controller.before_decode(4, lambda: [(r, c, v) for r, (c, v) in counters.items()], plain)
        controller.after_decode(mode)
        counters["a"][1] += 1
        counters["a"][0] += accepted
        return feed.estimates

    for _ in range(8):
        e = step(plain=True)  # plain (a penalised batch under --speculative-penalties exact)
    assert reads == [3, 7]  # before the 4th and 8th steps, the agreeing ones
    # The window closed at step 3 arrived at step 7: p = 0.5, the replay's estimate.
    assert e.acceptance_source == "replay" and e.acceptance == pytest.approx(1.875)
    for _ in range(8):
        e = step(plain=False, accepted=2)  # speculating, 3 tokens per step
    # At step 15 the window closed at step 11 arrives, older than the counters since
    # (measured from step 11 on, once the settle steps have passed).
    assert reads == [3, 7, 11, 15] and feed._fresh["replay"] == 11
    assert e.acceptance_source == "counters" and e.acceptance == pytest.approx(3.0)


def test_simulated_acceptance_is_the_plain_mode_estimate_and_named():
    feed = EstimateFeed(agree=lambda x: x, agree_every=1, simulated_acceptance=3.0, clock=FakeClock())
    e = feed.before_decode(4, 0, None)
    assert (e.acceptance, e.acceptance_source) == (3.0, "simulated")
    feed.on_replay(1, 100)
    feed.after_decision(P, 4, 0)
    assert feed.before_decode(4, 0, None).acceptance == 3.0


# -------------------------------------------------------------------------- cost cache
KEY = {"gpu": "H200", "model": "llama", "sglang": "0.5.17"}


def test_startup_costs_are_measured_once_then_read_from_the_cache(tmp_path):
    table = measured_table(linear_costs())
    measured = []

    def measure():
        measured.append(1)
        return table.points

    first = startup_costs(KEY, tmp_path, measure, agree=lambda x: x, first_rank=True)
    again = startup_costs(KEY, tmp_path, measure, agree=lambda x: x, first_rank=True)
    assert (first.cache_hit, again.cache_hit, len(measured)) == (False, True, 1)
    assert first.table == again.table == table
    other = startup_costs({**KEY, "sglang": "0.5.23"}, tmp_path, measure, agree=lambda x: x, first_rank=True)
    assert not other.cache_hit and len(measured) == 2
    assert startup_costs(KEY, None, measure, agree=lambda x: x, first_rank=True).cache_hit is False


def test_a_corrupt_or_foreign_cache_file_is_measured_over(tmp_path):
    table = measured_table(linear_costs())
    path = write_cached(tmp_path, KEY, table)
    assert read_cached(tmp_path, KEY) == table
    path.write_text("{not json")
    assert read_cached(tmp_path, KEY) is None
    cache_file(tmp_path, KEY).write_text('{"format": 1, "key": {"gpu": "other"}, "rows": []}')
    assert read_cached(tmp_path, KEY) is None


def test_a_table_cut_short_by_the_budget_is_cached_and_a_restart_reads_it(tmp_path):
    table = measured_table(linear_costs())
    got = startup_costs(KEY, tmp_path, lambda: table.points[:3], lambda x: x, True)
    assert len(got.table.points) == 3 and not got.cache_hit
    again = startup_costs(KEY, tmp_path, lambda: pytest.fail("measured again"), lambda x: x, True)
    assert again.cache_hit and again.table == got.table


def test_one_stalled_step_moves_a_correction_by_at_most_a_factor_of_two():
    c = CostCorrections(alpha=1.0, first_samples=1)
    c.observe("device", S, 8, 1.0, 1.0)
    c.observe("device", S, 8, 100.0, 1.0)
    assert c.device[(S, bucket_of(8))] == 2.0
    # The first samples too, from the table's 1.
    c.observe("host", S, 64, 5.0, 1.0)
    c.observe("host", P, 64, 0.1, 1.0)
    assert c.host[(S, bucket_of(64))] == 2.0 and c.host[(P, bucket_of(64))] == 0.5


def test_a_bucket_starts_from_the_median_of_its_first_samples():
    c = CostCorrections(alpha=1.0)
    c.observe("device", P, 128, 2.5, 1.0)  # the first step after an admission: stalled
    assert (P, bucket_of(128)) not in c.device  # one sample does not move the table yet
    c.observe("device", P, 128, 1.1, 1.0)
    c.observe("device", P, 128, 0.9, 1.0)
    assert c.device[(P, bucket_of(128))] == pytest.approx(1.1)
    c.observe("host", S, 4, 3.0, 1.0)  # kinds and modes are separate buckets
    assert c.host == {} and c.device.keys() == {(P, bucket_of(128))}
    for ratio in (4.0, 5.0, 6.0):  # a table off by more than 2x starts at 2x and moves on
        c.observe("host", P, 4, ratio, 1.0)
    assert c.host[(P, bucket_of(4))] == 2.0


def test_a_stalled_first_plain_step_does_not_bring_speculation_back():
    """H200, acceptance 4.0, C=128 (benchmarks/results/h200-decision-20261202-81b196c/):
    the first plain step at batch 128, right after 80 admissions, read 2x the table;
    as the bucket's only sample it doubled plain's cost, R went 0.76 -> 1.51 and the
    policy resumed for 55 steps at batch 128, where speculation costs a quarter."""
    clock, table = FakeClock(), measured_table(linear_costs())
    t_spec, t_plain = table.seconds(S, 128, 256), table.seconds(P, 128, 256)
    acceptance = 0.76 * t_spec / t_plain
    feed = EstimateFeed(
        agree=lambda x: x, agree_every=16, clock=clock, table=table, simulated_acceptance=acceptance
    )
    realized = []  # what the telemetry sinks get at each agreement

    class Sink(TelemetrySink):
        def on_realized(self, tokens_per_second):
            realized.append(dict(tokens_per_second))

    controller = ModeController(
        GoodputPolicy(GoodputSettings()), [Sink()], feed=feed, start_timer=lambda: FakeTimer(clock)
    )
    # Speculating at batch 8 (it pays there), then 120 admitted three decode steps
    # before the inputs are next agreed (every 16 steps), as on the H200.
    first = 45
    modes = []
    for i in range(first + 64):
        batch = 8 if i < first else 128
        if i == first:
            controller.on_other_step()  # the admissions' prefill
        mode = controller.before_decode(batch, context_len=256)
        modes.append(mode)
        clock.now += table.seconds(mode, batch, 256) * (2.5 if i == first else 1.0)
        controller.after_decode(mode)
    assert set(modes[:first]) == {S} and set(modes[first:]) == {P}, modes
    assert len(realized) == len(modes) // 16 and realized[0][P] is None  # spec: no counters here
    assert realized[-1][P] == pytest.approx(128 / t_plain)


def test_a_catch_up_step_and_the_next_are_not_host_step_times():
    """The resume's catch-up runs inside the first speculative step and, under the
    overlap scheduler, its device time lands in the next host interval."""
    clock = FakeClock()
    feed = EstimateFeed(
        agree=lambda x: x, agree_every=1000, clock=clock, table=measured_table(linear_costs())
    )
    feed.corrections = CostCorrections(first_samples=1)  # every sample counts at once
    step = linear_costs()(S, 8, 256)
    controller = ModeController(
        GoodputPolicy(GoodputSettings(min_dwell_steps=1)), feed=feed, start_timer=lambda: FakeTimer(clock)
    )
    for i in range(8):
        controller.before_decode(8, context_len=256)
        if i == 1:
            controller.on_catch_up("resume", 8, 8 * 64, FakeTimer(clock))
        controller.after_decode(S)
        clock.now += step * (20 if i == 2 else 1)  # step 1's catch-up, seen during step 2
    assert feed.corrections.host[(S, bucket_of(8))] == pytest.approx(1.0)


def test_other_ranks_take_the_first_ranks_cache_answer(tmp_path):
    """Only the first rank reads the cache; every rank measures or none does."""
    table = measured_table(linear_costs())
    write_cached(tmp_path, KEY, table)
    from_first = startup_costs(KEY, tmp_path, lambda: pytest.fail("measured"), lambda x: x, first_rank=True)
    handed = from_first.table.as_rows()
    other = startup_costs(KEY, tmp_path, lambda: pytest.fail("measured"), lambda x: handed, first_rank=False)
    assert other.cache_hit and other.table == table
    assert "context   1024" in format_table(table)


# -------------------------------------------------------------------------- controller
def test_controller_builds_itself_from_settings():
    c = ModeController.from_settings(
        config.settings_from_environ({config.POLICY.env: "goodput"}),
        first_rank=False,
        metrics_enabled=False,
        labels={},
        agree=lambda x: x,
    )
    assert isinstance(c.policy, GoodputPolicy) and c.policy.settings.max_acceptance == 4.0
    assert c.simulated_acceptance is None


@pytest.mark.parametrize(
    "raw, expected", [("3", 3.0), ("inf", 4.0), ("0.5", 1.0), ("-1", None), ("nan", None)]
)
def test_a_simulated_acceptance_is_taken_as_sglangs_verify_clamps_it(raw, expected):
    """At most the draft tokens, at least the bonus token; 0 or less, or NaN, is off."""
    c = ModeController.from_settings(
        config.settings_from_environ({config.SIMULATED_ACCEPTANCE_ENV: raw}),
        first_rank=False,
        metrics_enabled=False,
        labels={},
        agree=lambda x: x,
        max_acceptance=4.0,
    )
    assert c.simulated_acceptance == expected


# --------------------------------------------------------------------- state machine
DWELL, CAPACITY, AGREE_EVERY, MARGIN = 8, 32, 16, GoodputSettings().margin
CATCH_UP_SECONDS = 20e-6  # per replayed position: a resume of 256 x 32 positions costs 160 ms
# Decode steps after the world's last change within which the decision is right:
# the replay that reveals a rise of acceptance in plain mode comes every CAPACITY plain
# steps (two to converge), the agreement every AGREE_EVERY steps, then the dwell; one
# round trip to learn the replay's bias; the corrections' averages converge meanwhile.
SETTLE_BOUND = 4 * CAPACITY + 4 * AGREE_EVERY + 4 * DWELL
# True R / the switching point where either mode is about as fast, or where the start-up
# table's error for the mode not running (up to 10% each, beyond a factor common to both
# modes, which the running mode's corrections remove) can hide which one is faster.
AMBIGUOUS = (0.8, 1.25)


class FakeTimer:
    def __init__(self, clock: FakeClock):
        self.clock, self.start, self.end = clock, clock.now, None

    def stop(self) -> None:
        self.end = self.clock.now

    def seconds(self):
        return None if self.end is None else self.end - self.start


def agreement_for(acceptance: float, draft_steps: int = 3) -> float:
    """The per-position agreement p with expected_accept_length(p, k) = acceptance."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_accept_length(mid, draft_steps) < acceptance else (lo, mid)
    return lo


class DecisionMachine(RuleBasedStateMachine):
    @initialize(
        spec=st.tuples(st.floats(3e-3, 12e-3), st.floats(0.02e-3, 0.5e-3), st.floats(0, 1e-6)),
        plain=st.tuples(st.floats(2e-3, 8e-3), st.floats(0.005e-3, 0.1e-3), st.floats(0, 0.3e-6)),
        off=st.tuples(st.floats(0.67, 1.5), st.floats(0.9, 1.1), st.floats(0.9, 1.1)),
        acceptance=st.floats(1.0, 4.0),
        bias=st.floats(0.7, 1.0),
        batch=st.integers(1, 256),
        context=st.integers(16, 8192),
        prefill_every=st.sampled_from([None, 1, 2, 3, 4, 6, 16]),
    )
    def start(self, spec, plain, off, acceptance, bias, batch, context, prefill_every):
        self.clock = FakeClock()
        self.true_cost = linear_costs(spec, plain)
        table = measured_table(self.true_cost, {S: off[0] * off[1], P: off[0] * off[2]})
        feed = EstimateFeed(
            agree=lambda x: x, draft_steps=3, agree_every=AGREE_EVERY, clock=self.clock, table=table
        )
        policy = GoodputPolicy(GoodputSettings(min_dwell_steps=DWELL, margin=MARGIN, max_acceptance=4.0))
        self.controller = ModeController(
            policy, feed=feed, catch_up_capacity=CAPACITY, start_timer=lambda: FakeTimer(self.clock)
        )
        # The replay reads a chain's first step, which agrees at least as often as the
        # chain goes on (bias <= 1): a chain of 3 drafts accepts at most 4 * bias then.
        self.acceptance, self.bias = min(acceptance, 4.0 * bias), bias
        self.batch, self.context, self.prefill_every = batch, context, prefill_every
        self.requests: dict[int, list[float]] = {}
        self.next_rid = 0
        self._resize()
        self.steps = 0
        self.changed_at = 0
        self.last_switch: int | None = None
        self.mode = S
        self.plain_run = 0
        self.bleed = 0.0

    def _resize(self):
        rids = sorted(self.requests)[: self.batch]
        self.requests = {r: self.requests[r] for r in rids}
        while len(self.requests) < self.batch:
            self.requests[self.next_rid] = [0.0, 0]
            self.next_rid += 1

    def _counters(self):
        return [(rid, int(c), v) for rid, (c, v) in self.requests.items()]

    def _replay(self):
        positions = 1000
        p = agreement_for(self.acceptance / self.bias)
        self.controller.on_replay(round(p * positions), positions)

    def true_ratio(self) -> float:
        t = self.true_cost
        return self.acceptance * t(P, self.batch, self.context) / t(S, self.batch, self.context)

    @rule()
    def decode_step(self):
        ctx = self.context
        mode = self.controller.before_decode(self.batch, self._counters, context_len=ctx)
        self.clock.now += self.bleed  # the last catch-up, waited on one step late (overlap)
        self.bleed = 0.0
        if mode is not self.mode:
            if mode is S:  # going plain is free; a resume waits for the dwell
                assert self.last_switch is None or self.steps - self.last_switch >= DWELL, (
                    "resumed inside the dwell"
                )
            self.last_switch = self.steps
            if mode is S and self.plain_run:
                self._replay()  # the resume's catch-up replays the gaps
                positions = self.batch * min(self.plain_run, CAPACITY)
                self.controller.on_catch_up("resume", self.batch, positions, FakeTimer(self.clock))
                self.bleed = positions * CATCH_UP_SECONDS
        self.mode = mode
        self.clock.now += self.true_cost(mode, self.batch, ctx)
        self.controller.after_decode(mode)
        for counters in self.requests.values():  # as the scheduler counts, one step late
            counters[1] += 1
            if mode is S:
                counters[0] += self.acceptance - 1
        self.plain_run = self.plain_run + 1 if mode is P else 0
        if mode is P and self.plain_run % CAPACITY == 0:
            self._replay()  # a buffer-full flush
        self.steps += 1
        if self.prefill_every and self.steps % self.prefill_every == 0:
            self.controller.on_other_step()
            self.clock.now += 0.02

    @rule(n=st.integers(1, 64))
    def run(self, n):
        for _ in range(n):
            self.decode_step()

    @rule(batch=st.integers(1, 256))
    def set_batch(self, batch):
        self.batch, self.changed_at = batch, self.steps
        self._resize()

    @rule(context=st.integers(16, 8192))
    def set_context(self, context):
        self.context, self.changed_at = context, self.steps

    @rule(acceptance=st.floats(1.0, 4.0))
    def set_acceptance(self, acceptance):
        self.acceptance, self.changed_at = min(acceptance, 4.0 * self.bias), self.steps

    @rule(every=st.sampled_from([None, 1, 2, 4, 8]))
    def set_prefill_rate(self, every):
        self.prefill_every = every

    @rule()
    def settle(self):
        for _ in range(SETTLE_BOUND):
            self.decode_step()

    @invariant()
    def settles_on_the_faster_mode(self):
        if self.steps - self.changed_at < SETTLE_BOUND:
            return
        r = self.true_ratio()
        note(f"steps {self.steps}, batch {self.batch}, context {self.context}, R {r:.3f}, mode {self.mode}")
        if r < (1 - MARGIN) * AMBIGUOUS[0]:
            assert self.mode is P, f"speculating at true R = {r:.2f}"
        elif r > (1 + MARGIN) * AMBIGUOUS[1]:
            assert self.mode is S, f"plain at true R = {r:.2f}"


def one_request_at_acceptance_one() -> DecisionMachine:
    """The state machine's failing example of 2026-12-08: one request, exact start-up
    costs (true R 0.51 at acceptance 1.0, 1.53 at 3.0), a replay without bias."""
    machine = DecisionMachine()
    machine.start(
        spec=(0.00390625, 7.065392179904359e-05, 0.0),
        plain=(0.002, 2.17300324940106e-05, 0.0),
        off=(1.0, 1.0, 1.0),
        acceptance=1.0,
        bias=1.0,
        batch=1,
        context=16,
        prefill_every=None,
    )
    return machine


def test_a_second_rise_of_acceptance_while_plain_brings_speculation_back():
    """The state machine's find (2026-12-08): acceptance rises while plain (resume), falls
    while speculating (plain), rises again while plain. The counters of the speculative
    phase, measured after the fall, must not be taken as the bias of the replay before
    it: with that bias (about 0.6) every later replay read 1.8 where the truth was 3.0,
    and the policy stayed plain where speculating is 1.5x faster."""
    machine = one_request_at_acceptance_one()
    for acceptance, mode in [(1.0, P), (3.0, S), (1.0, P), (3.0, S)]:
        machine.set_acceptance(acceptance)
        machine.settle()
        # True R: 0.51 at acceptance 1.0, 1.53 at 3.0; the mode at the end of each settle.
        assert machine.mode is mode, (acceptance, machine.steps, machine.controller.policy.last_reason)


@pytest.mark.xfail(
    strict=True,
    reason="known lock-out, not fixed yet (closing note of 2026-12-08): the acceptance falls within "
    "the first agreement window after a resume, so the replay's bias takes one bad sample (1.0 over "
    "3.0), and no later replay can bring speculation back; a bounded decay of the bias towards 1 over "
    "a plain phase's replays is the candidate fix",
)
def test_a_fall_right_after_a_resume_does_not_lock_speculation_out():
    machine = one_request_at_acceptance_one()
    machine.settle()
    machine.set_acceptance(3.0)
    for _ in range(SETTLE_BOUND):
        machine.decode_step()
        if machine.mode is S:
            break
    assert machine.mode is S
    machine.set_acceptance(1.0)  # at the resume itself
    machine.settle()
    assert machine.mode is P
    machine.set_acceptance(3.0)
    machine.settle()
    machine.settle()
    assert machine.mode is S, machine.controller.policy.last_reason


DecisionMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("DYNSPEC_DECISION_EXAMPLES", "60")), stateful_step_count=20, deadline=None
)
test_decision_settles_on_the_faster_mode = DecisionMachine.TestCase
