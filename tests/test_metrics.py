"""The plugin's switch logs and Prometheus series (no SGLang needed)."""

from __future__ import annotations

import logging

from prometheus_client import REGISTRY

from sglang_dynspec.metrics import ModeMetrics
from sglang_dynspec.policy import Mode, SwitchPolicy, SwitchThresholds


def drive(metrics: ModeMetrics, sizes):
    policy = SwitchPolicy(SwitchThresholds(disable_above=3, enable_at_or_below=1, min_dwell_steps=0))
    for bs in sizes:
        mode = policy.decide(bs)
        metrics.on_step(mode, policy.last_switch, policy.steps, replayed_graph=mode is Mode.PLAIN)
    return policy


def test_switches_are_logged_with_the_steps_before_them(caplog):
    caplog.set_level(logging.INFO, logger="sglang_dynspec")
    drive(ModeMetrics(export=False), [1, 1, 5, 5, 5, 1])
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "[sglang-dynspec] spec -> plain at decode batch size 5 (decode step 2; steps before it: spec 2, plain 0)",
        "[sglang-dynspec] plain -> spec at decode batch size 1 (decode step 5; steps before it: spec 2, plain 3)",
    ]


class FakeTimer:
    """A device timer whose work completes when the test says so."""

    def __init__(self, seconds):
        self.value, self.done = seconds, False

    def seconds(self):
        return self.value if self.done else None


class FakeAcceptLens:
    def __init__(self, values):
        self.values = values

    def tolist(self):
        return list(self.values)


def test_catch_ups_and_resume_acceptance_are_read_once_complete(caplog):
    caplog.set_level(logging.INFO, logger="sglang_dynspec")
    metrics = ModeMetrics(export=False)
    timer, marker = FakeTimer(0.004), FakeTimer(0.0)
    metrics.on_catch_up("resume", requests=2, tokens=10, timer=timer)
    metrics.watch_first_step_after_resume(FakeAcceptLens([4, 2]), marker)
    metrics.poll()
    assert caplog.records == []  # nothing has completed on the device yet: no sync, no log
    timer.done = marker.done = True
    metrics.poll()
    metrics.poll()  # each is reported once
    assert [r.getMessage() for r in caplog.records] == [
        "[sglang-dynspec] draft catch-up (resume): 10 positions of 2 requests in 4.00 ms",
        "[sglang-dynspec] first speculative step after resume: 3.00 tokens accepted per request (2 requests)",
    ]


def test_prometheus_series_follow_the_steps():
    labels = {"model_name": "test-model"}
    metrics = ModeMetrics(export=True, labels=labels, log_switches=False)
    drive(metrics, [1, 5, 5, 1, 1])
    done = FakeTimer(0.5)
    done.done = True
    metrics.on_catch_up("buffer_full", requests=3, tokens=12, timer=done)
    metrics.on_catch_up("resume", requests=1, tokens=2, timer=done)
    metrics.watch_first_step_after_resume(FakeAcceptLens([3, 4, 4]), done)
    metrics.poll()

    def value(name, **extra):
        return REGISTRY.get_sample_value(name, {**labels, **extra})

    assert value("sglang:spec_dynamic_decode_steps_total", mode="spec") == 3
    assert value("sglang:spec_dynamic_decode_steps_total", mode="plain") == 2
    assert value("sglang:spec_dynamic_switches_total", to="plain") == 1
    assert value("sglang:spec_dynamic_switches_total", to="spec") == 1
    assert value("sglang:spec_dynamic_plain_graph_steps_total") == 2
    assert value("sglang:spec_dynamic_mode") == 1
    assert value("sglang:spec_dynamic_catch_up_total", reason="buffer_full") == 1
    assert value("sglang:spec_dynamic_catch_up_total", reason="resume") == 1
    assert value("sglang:spec_dynamic_catch_up_total", reason="mixed") == 0
    assert value("sglang:spec_dynamic_catch_up_tokens_total") == 14
    assert value("sglang:spec_dynamic_catch_up_seconds_count") == 2
    assert value("sglang:spec_dynamic_catch_up_seconds_sum") == 1.0
    assert value("sglang:spec_dynamic_resume_accepted_tokens_total") == 11
    assert value("sglang:spec_dynamic_resume_requests_total") == 3
