"""The start-up calibration's grid, order, budget and table (no server; see
``tests/test_step_timing_e2e.py`` for the real steps)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sglang_dynspec.config import ConfigError
from sglang_dynspec.step_timing import (
    BATCH_LADDER,
    BUDGET_ENV,
    DEFAULT_BUDGET_SECONDS,
    EAGER_BATCH_LADDER,
    EAGER_CONTEXT_LADDER,
    StepCostSample,
    StepLimits,
    budget_from_environ,
    coarse_to_fine,
    format_step_costs,
    grid_for,
    measurement_order,
    pipelined_step_seconds,
    run_within_budget,
)

# SGLang's default decode graph batch sizes up to 160 (1, 2, 4, then steps of 8, then 16).
CAPTURED = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 104, 112, 120, 128, 144, 160)


@given(st.integers(0, 40))
def test_coarse_to_fine_is_a_permutation_with_the_ends_first(n):
    order = coarse_to_fine(n)
    assert sorted(order) == list(range(n))
    assert order[:2] == ([0, n - 1] if n > 1 else list(range(n)))


def test_coarse_to_fine_halves():
    assert coarse_to_fine(9) == [0, 8, 4, 2, 6, 1, 3, 5, 7]


@given(
    st.lists(st.integers(1, 512), min_size=1, max_size=12, unique=True),
    st.lists(st.integers(1, 8192), min_size=1, max_size=5, unique=True),
)
def test_measurement_order_covers_the_grid_corners_first(batch_sizes, context_lens):
    order = measurement_order(batch_sizes, context_lens)
    assert sorted(order) == sorted(itertools.product(batch_sizes, context_lens))
    corners = set(
        itertools.product({min(batch_sizes), max(batch_sizes)}, {min(context_lens), max(context_lens)})
    )
    assert set(order[: len(corners)]) == corners
    assert order[0] == (min(batch_sizes), min(context_lens))


def test_limits_drop_what_serving_would_not_run_and_snap_to_captured_graphs():
    limits = StepLimits(max_batch_size=100, max_context_len=3000, graph_batch_sizes=CAPTURED)
    # 3 replays the 4 graph, 97 the 104 graph (beyond the limit of 100): left out.
    assert limits.batch_sizes([1, 3, 4, 64, 97, 100, 200]) == [1, 4, 64]
    assert limits.context_lens([128, 512, 2048, 8192, 0]) == [128, 512, 2048, 3000]
    eager = StepLimits(max_batch_size=16, max_context_len=2000)
    assert eager.batch_sizes([0, 1, 3, 16, 17]) == [1, 3, 16]


def test_cuda_grid_is_the_ladder_up_to_the_largest_graph():
    limits = StepLimits(max_batch_size=160, max_context_len=4096, graph_batch_sizes=CAPTURED)
    batch_sizes, context_lens = grid_for(limits)
    assert batch_sizes == [1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 160]
    assert context_lens == [128, 512, 2048, 4096]
    assert all(b / a <= 2 for a, b in itertools.pairwise(batch_sizes))
    assert set(batch_sizes) <= set(CAPTURED) and set(batch_sizes) <= set(BATCH_LADDER) | {160}


def test_eager_grid_is_small():
    batch_sizes, context_lens = grid_for(StepLimits(max_batch_size=16, max_context_len=2000))
    assert (batch_sizes, context_lens) == (list(EAGER_BATCH_LADDER), list(EAGER_CONTEXT_LADDER))
    # Fewer rows than the ladder: the largest batch is always measured.
    assert grid_for(StepLimits(max_batch_size=8, max_context_len=2000))[0] == [1, 4, 8]
    # Contexts are capped at the longest.
    assert grid_for(StepLimits(max_batch_size=8, max_context_len=100))[1] == [64, 100]
    assert grid_for(StepLimits(max_batch_size=8, max_context_len=40))[1] == [40]


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def fake_measure(clock: FakeClock, cost):
    """A measurement that advances the clock by ``cost(bs, ctx)`` seconds."""
    measured = []

    def measure(bs, ctx):
        measured.append((bs, ctx))
        clock.now += cost(bs, ctx)
        return [StepCostSample(mode, bs, ctx, 0.001) for mode in ("plain", "spec")]

    return measure, measured


def test_budget_stops_before_a_point_predicted_to_overrun():
    clock = FakeClock()
    measure, measured = fake_measure(clock, lambda bs, ctx: bs * ctx / 1000)
    points = measurement_order([1, 4, 16], [64, 256])
    decisions = []

    def agree(decision):
        decisions.append(decision)
        return decision

    samples = run_within_budget(points, measure, budget_seconds=5.0, clock=clock, agree=agree)
    # (1,64) 0.064 s, (1,256) 0.256, (16,64) 1.024, (16,256) 4.096: 5.44 s is past the
    # budget after the fourth point, so nothing more starts.
    assert measured == points[:4]
    assert len(samples) == 8 and decisions == [True] * 4 + [False]


def test_budget_skips_nothing_it_can_afford_and_respects_zero():
    clock = FakeClock()
    measure, measured = fake_measure(clock, lambda bs, ctx: 0.01)
    points = measurement_order([1, 2, 4, 8], [64, 256, 1024])
    assert len(run_within_budget(points, measure, 10.0, clock=clock)) == 2 * len(points)
    assert measured == points
    assert run_within_budget(points, measure, 0.0, clock=clock) == []


def test_budget_counts_from_the_given_start_and_the_corners_are_always_measured():
    clock = FakeClock()
    measure, measured = fake_measure(clock, lambda bs, ctx: 0.01)
    points = measurement_order([1, 2, 4, 8], [64, 256, 1024])
    began = clock()
    clock.now += 20.0  # a warm-up that spent the whole budget and more
    samples = run_within_budget(points, measure, 15.0, clock=clock, start=began, at_least=4)
    assert measured == points[:4] and len(samples) == 8
    # Without the warm-up's time, the same budget measures the whole grid.
    measure, measured = fake_measure(clock, lambda bs, ctx: 0.01)
    run_within_budget(points, measure, 15.0, clock=clock, at_least=4)
    assert measured == points


def test_budget_prediction_uses_the_cheapest_dominating_point():
    clock = FakeClock()
    measure, measured = fake_measure(clock, lambda bs, ctx: 3.0 if (bs, ctx) == (16, 256) else 0.5)
    points = measurement_order([1, 4, 16], [64, 256])
    assert points[4:] == [(4, 64), (4, 256)]
    # The corners take 4.5 s. (4, 64) is predicted by (16, 64): 0.5 s, within 7 s;
    # (4, 256) only by (16, 256): 3 s, past it.
    run_within_budget(points, measure, budget_seconds=7.0, clock=clock)
    assert measured == points[:5]


def test_pipelined_step_seconds_warms_up_then_takes_the_median_run(monkeypatch):
    import sglang_dynspec.device_timer as device_timer

    took = iter([1.0, 1.0, 2.0, 30.0, 2.5])  # two warm-up runs, then a stall among three
    calls, now = [], [0.0]

    def step():
        calls.append(1)
        now[0] += next(took)

    monkeypatch.setattr(device_timer.time, "perf_counter", lambda: now[0])
    assert pipelined_step_seconds(step, "cpu", warmup=2, repeats=3) == pytest.approx(2.5)
    assert len(calls) == 5


def test_table_lists_every_point_in_milliseconds():
    samples = [
        StepCostSample("plain", 1, 64, 0.0012),
        StepCostSample("spec", 1, 64, 0.0034),
        StepCostSample("plain", 16, 64, 0.0056),
        StepCostSample("spec", 16, 64, 0.0078),
        StepCostSample("plain", 1, 256, 0.0021),
        StepCostSample("spec", 1, 256, 0.0043),
    ]
    lines = format_step_costs(samples, 1.5).splitlines()
    assert lines[0] == "[sglang-dynspec] step costs, ms per decode step (3 points, calibrated in 1.5 s):"
    assert lines[1].split() == ["context", "64", "|", "batch", "1", "16"]
    assert lines[2].split() == ["|", "plain", "1.200", "5.600"]
    assert lines[3].split() == ["|", "spec", "3.400", "7.800"]
    assert lines[4].split() == ["context", "256", "|", "batch", "1", "16"]
    assert lines[5].split() == ["|", "plain", "2.100", "-"]
    assert lines[6].split() == ["|", "spec", "4.300", "-"]


def test_budget_comes_from_the_environment():
    assert budget_from_environ({}) == DEFAULT_BUDGET_SECONDS == 15.0
    assert budget_from_environ({BUDGET_ENV: " 120 "}) == 120.0
    assert budget_from_environ({BUDGET_ENV: "0"}) == 0.0
    for bad in ("-1", "soon", "nan", "inf"):
        with pytest.raises(ConfigError, match=BUDGET_ENV):
            budget_from_environ({BUDGET_ENV: bad})


def test_measure_step_costs_warms_up_every_batch_size_then_times_each_point(monkeypatch, caplog):
    """The orchestration, on fake steps: warm-up at every batch size of the grid (shortest
    context), then per point ``warmup`` + ``repeats`` steps of each mode; a step that
    replayed no graph where the limits say graphs exist is named in a warning."""
    import contextlib
    import types

    import sglang_dynspec.step_timing as step_timing

    calls = []

    @contextlib.contextmanager
    def synthetic_decode_batch(spec_worker, bs, ctx):
        yield types.SimpleNamespace(next_batch=lambda: (bs, ctx))

    def plain(spec_worker, batch, plain_graph):
        calls.append(("plain", *batch))
        return types.SimpleNamespace(result=types.SimpleNamespace(can_run_cuda_graph=True))

    def spec(spec_worker, batch):
        calls.append(("spec", *batch))
        return types.SimpleNamespace(can_run_cuda_graph=batch[0] != 4)  # 4 requests: eager

    limits = StepLimits(max_batch_size=16, max_context_len=300, graph_batch_sizes=(1, 4, 16))
    monkeypatch.setattr(step_timing, "step_limits", lambda worker, graph: limits)
    monkeypatch.setattr(step_timing.compat, "synthetic_decode_batch", synthetic_decode_batch)
    monkeypatch.setattr(step_timing.compat, "run_speculative_decode", spec)
    monkeypatch.setattr(step_timing, "run_plain_decode", plain)
    monkeypatch.setattr(step_timing, "PlainDecoder", types.SimpleNamespace(of=lambda worker: worker))
    worker = types.SimpleNamespace(device="cpu")
    samples = step_timing.measure_step_costs(
        worker,
        object(),
        [1, 4, 16, 32],
        [64, 256, 512],
        warmup=1,
        repeats=3,
        budget_seconds=60,
        agree=lambda x: x,
    )
    warm = [("plain", bs, 64) for bs in (1, 4, 16)]
    assert [c for c in calls[:6] if c[0] == "plain"] == warm and len(calls[:6]) == 6
    points = measurement_order([1, 4, 16], [64, 256, 300])
    assert [(s.batch_size, s.context_len) for s in samples[::2]] == points
    assert [s.mode for s in samples] == ["plain", "spec"] * len(points)
    assert len(calls) == 6 + len(points) * 2 * (1 + 3)
    assert "3 steps ran without their CUDA graph" in caplog.text
    assert "('spec', 4, 64)" in caplog.text
