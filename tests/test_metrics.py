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


def test_prometheus_series_follow_the_steps():
    labels = {"model_name": "test-model"}
    drive(ModeMetrics(export=True, labels=labels, log_switches=False), [1, 5, 5, 1, 1])

    def value(name, **extra):
        return REGISTRY.get_sample_value(name, {**labels, **extra})

    assert value("sglang:spec_dynamic_decode_steps_total", mode="spec") == 3
    assert value("sglang:spec_dynamic_decode_steps_total", mode="plain") == 2
    assert value("sglang:spec_dynamic_switches_total", to="plain") == 1
    assert value("sglang:spec_dynamic_switches_total", to="spec") == 1
    assert value("sglang:spec_dynamic_plain_graph_steps_total") == 2
    assert value("sglang:spec_dynamic_mode") == 1
