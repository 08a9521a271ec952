"""The controller's telemetry: step statistics, log lines and Prometheus series (no SGLang)."""

from __future__ import annotations

import functools
import logging
import math

import torch
from controller_steps import drive as drive_steps
from prometheus_client import CollectorRegistry

from sglang_dynspec import metric_names as names
from sglang_dynspec.controller import ModeController, build_sinks
from sglang_dynspec.mode_log import ModeLog
from sglang_dynspec.policy import Mode, SwitchThresholds, ThresholdPolicy
from sglang_dynspec.prometheus_export import PrometheusExport


def controller(*sinks) -> ModeController:
    return ModeController(
        ThresholdPolicy(SwitchThresholds(disable_above=3, enable_at_or_below=1, min_dwell_steps=0)), sinks
    )


# The shared driver, with every plain step replaying the plain decode graph.
drive = functools.partial(drive_steps, plain_graph=True)


def test_switches_are_logged_with_the_steps_before_them(caplog):
    caplog.set_level(logging.INFO, logger="sglang_dynspec")
    drive(controller(ModeLog()), [1, 1, 5, 5, 5, 1])
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "[sglang-dynspec] spec -> plain at decode batch size 5 (decode step 2; steps before it: spec 2, plain 0): "
        "batch 5 > 3",
        "[sglang-dynspec] plain -> spec at decode batch size 1 (decode step 5; steps before it: spec 2, plain 3): "
        "batch 1 <= 1",
    ]


class FakeTimer:
    """A device timer whose work completes when the test says so."""

    def __init__(self, seconds):
        self.value, self.done = seconds, False

    def seconds(self):
        return self.value if self.done else None


def test_catch_ups_are_read_once_complete_and_never_waited_for(caplog):
    caplog.set_level(logging.INFO, logger="sglang_dynspec")
    c = controller(ModeLog())
    timer = FakeTimer(0.004)
    c.on_catch_up("resume", requests=2, tokens=10, timer=timer)
    drive(c, [1])  # polls: not complete yet
    assert caplog.records == [] and c.stats.catch_ups_timed == 0
    assert c.stats.catch_ups["resume"] == 1 and c.stats.catch_up_tokens == 10  # counted when queued
    timer.done = True
    drive(c, [1, 1])  # each is reported once
    assert [r.getMessage() for r in caplog.records] == [
        "[sglang-dynspec] draft catch-up (resume): 10 positions of 2 requests in 4.00 ms",
    ]
    assert c.stats.catch_ups_timed == 1 and c.stats.catch_up_seconds == 0.004


def test_first_speculative_step_after_a_resume_reports_its_acceptance(caplog):
    caplog.set_level(logging.INFO, logger="sglang_dynspec")
    c = controller(ModeLog())
    drive(c, [5, 5], accept_lens=torch.tensor([1, 1]))  # plain steps
    drive(c, [1], accept_lens=torch.tensor([4, 2]))  # the resume step (CPU: read at once)
    drive(c, [1], accept_lens=torch.tensor([3, 3]))  # steady state: not reported
    assert [r.getMessage() for r in caplog.records][-1] == (
        "[sglang-dynspec] first speculative step after resume: 3.00 tokens accepted per request (2 requests)"
    )
    assert (c.stats.resume_steps, c.stats.resume_requests, c.stats.resume_accepted_tokens) == (1, 2, 6)


def test_only_the_first_rank_logs_and_only_with_metrics_on_it_exports():
    assert build_sinks(first_rank=False, metrics_enabled=True, labels={}) == []
    assert [type(s) for s in build_sinks(first_rank=True, metrics_enabled=False, labels={})] == [ModeLog]


def test_prometheus_series_follow_the_steps():
    labels = {"model_name": "test-model"}
    registry = CollectorRegistry()
    c = controller(PrometheusExport(labels, registry))
    drive(c, [1, 5, 5, 1], accept_lens=torch.tensor([1]))
    c.after_decode(c.before_decode(1), accept_lens=torch.tensor([9]))  # not the first after a resume
    done = FakeTimer(0.5)
    done.done = True
    c.on_catch_up("buffer_full", requests=3, tokens=12, timer=done)
    c.on_catch_up("resume", requests=1, tokens=2, timer=done)
    c.before_decode(1)  # polls

    def value(name, **extra):
        return registry.get_sample_value(name, {**labels, **extra})

    assert value(names.total(names.STEPS_COUNTER), mode="spec") == 3
    assert value(names.total(names.STEPS_COUNTER), mode="plain") == 2
    assert value(names.total(names.SWITCHES_COUNTER), to="plain") == 1
    assert value(names.total(names.SWITCHES_COUNTER), to="spec") == 1
    assert value(names.total(names.PLAIN_GRAPH_COUNTER)) == 2
    assert value(names.MODE_GAUGE) == 1
    assert value(names.total(names.CATCH_UP_COUNTER), reason="buffer_full") == 1
    assert value(names.total(names.CATCH_UP_COUNTER), reason="resume") == 1
    assert value(names.total(names.CATCH_UP_COUNTER), reason="mixed") == 0
    assert value(names.total(names.CATCH_UP_TOKENS_COUNTER)) == 14
    assert value(names.CATCH_UP_SECONDS + "_count") == 2
    assert value(names.CATCH_UP_SECONDS + "_sum") == 1.0
    assert value(names.total(names.RESUME_ACCEPTED_COUNTER)) == 1
    assert value(names.total(names.RESUME_REQUESTS_COUNTER)) == 1


def test_realized_tokens_per_second_reach_the_gauge_nan_until_a_mode_has_run():
    labels = {"model_name": "test-model"}
    registry = CollectorRegistry()
    export = PrometheusExport(labels, registry)
    export.on_realized({Mode.SPEC: 3000.0, Mode.PLAIN: None})

    def value(mode):
        return registry.get_sample_value(names.REALIZED_GAUGE, {**labels, "mode": mode})

    assert value("spec") == 3000.0 and math.isnan(value("plain"))
    export.on_realized({Mode.SPEC: 2500.0, Mode.PLAIN: 2000.0})
    assert (value("spec"), value("plain")) == (2500.0, 2000.0)


def test_a_required_plain_step_leaves_the_policy_as_it_was():
    """A batch with per-token penalties decodes plain below the threshold, without a
    switch; the policy's own decision applies again once the batch no longer needs it."""
    registry = CollectorRegistry()
    c = controller(PrometheusExport({"model_name": "m"}, registry))
    assert c.before_decode(2) is Mode.SPEC
    c.after_decode(Mode.SPEC)
    for _ in range(3):
        assert c.before_decode(2, needs_per_token_penalties=True) is Mode.PLAIN
        c.after_decode(Mode.PLAIN)
    assert c.policy.mode is Mode.SPEC and c.stats.switches == dict.fromkeys(Mode, 0)
    assert c.stats.penalty_plain_steps == 3 and c.stats.decode_steps[Mode.PLAIN] == 3
    assert registry.get_sample_value(names.total(names.PENALTY_PLAIN_COUNTER), {"model_name": "m"}) == 3
    assert c.before_decode(2) is Mode.SPEC
    # Above the threshold the policy itself goes plain (and that is a switch).
    assert c.before_decode(100) is Mode.PLAIN and c.stats.switches[Mode.PLAIN] == 1


def test_relaxed_penalties_speculate_and_count_the_steps_that_applied_them_per_step():
    """With relaxed penalties (the default) the policy decides alone; a speculative step
    whose batch has a penalised request is counted (it got EAGLE-3's per-step
    penalties), a plain one is not."""
    registry = CollectorRegistry()
    c = ModeController(
        ThresholdPolicy(SwitchThresholds(disable_above=3, enable_at_or_below=1, min_dwell_steps=0)),
        [PrometheusExport({"model_name": "m"}, registry)],
        exact_penalties=False,
    )
    modes = []
    for batch in (2, 2, 5, 5, 1):
        mode = c.before_decode(batch, needs_per_token_penalties=True)
        c.after_decode(mode)
        modes.append(mode)
    assert modes == [Mode.SPEC, Mode.SPEC, Mode.PLAIN, Mode.PLAIN, Mode.SPEC]
    assert c.stats.relaxed_penalty_steps == 3 and c.stats.penalty_plain_steps == 0
    assert registry.get_sample_value(names.total(names.RELAXED_PENALTY_COUNTER), {"model_name": "m"}) == 3
