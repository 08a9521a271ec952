"""End to end on real SGLang (CPU test bed): the goodput policy decides from what it
measures on this machine, and greedy output stays the non-speculative server's.

* The random-weight draft proposes tokens the target rejects (about 1 token per
  speculative step): speculation cannot pay, so after its probes the server runs plain,
  even with one request.
* The agreeing pair accepts every draft (steps + 1 tokens per step): at one request the
  server speculates.

Each server answers a warm-up of waves, then a tail of single requests whose steps are
counted from ``/metrics``; the acceptance estimate the policy used is read there too.
"""

from __future__ import annotations

import pytest

from dynspec_testbed.server import (
    OVERLAP_CI_ENV,
    CpuServer,
    assert_no_kv_left,
    dynamic_server_args,
)
from dynspec_testbed.workload import compare_outputs, plugin_counters, run_waves, waves_of

pytestmark = pytest.mark.server

WARM_UP = waves_of([1, 3, 1], seed=31, prefix="gp-warm", new_tokens=(40, 48))
TAIL = waves_of([1] * 5, seed=32, prefix="gp-tail", new_tokens=(48, 56))
# Decode steps a policy may spend in the other mode in the tail: a probe lasts the
# dwell plus up to one agreement period (16 steps) and the settle steps.
PROBE_BUDGET = 40


def goodput_args(models, pair: str) -> list:
    # No policy flag (goodput is the default; the log line checked below names it) and no
    # --speculative-disable-batch-threshold (with goodput it would be a hard bound).
    extra = ["--max-running-requests", 8, "--enable-metrics"]
    return dynamic_server_args(models, pair, policy=None, disable_above=None, dwell=4, extra=extra)


def serve_and_measure(models, reference_servers, pair: str, tmp_path):
    reference = reference_servers.serve(pair, lambda url: {**run_waves(url, WARM_UP), **run_waves(url, TAIL)})
    log = tmp_path / "goodput.log"
    with CpuServer(goodput_args(models, pair), log_path=log, env=OVERLAP_CI_ENV) as server:
        got = run_waves(server.url, WARM_UP)
        before = plugin_counters(server.url)
        got.update(run_waves(server.url, TAIL))
        after = plugin_counters(server.url)
        assert_no_kv_left(server.url, timeout=60)
    mismatches = compare_outputs(reference, got)
    assert not mismatches, (
        f"{len(mismatches)} requests differ from the non-speculative server: {mismatches[:3]}"
    )
    tail = {"spec": after.steps_spec - before.steps_spec, "plain": after.steps_plain - before.steps_plain}
    return after, tail, log.read_text()


def test_random_draft_ends_plain_even_at_one_request(tiny_models, reference_servers, tmp_path):
    after, tail, text = serve_and_measure(tiny_models, reference_servers, "random", tmp_path)
    assert after.acceptance is not None and after.acceptance < 1.5, after
    assert after.mode == 0, f"still speculating at the end: {after}"
    assert tail["plain"] > 0 and tail["spec"] <= PROBE_BUDGET, tail
    assert "goodput policy" in text and "step costs (timed at start-up" in text


def test_agreeing_pair_speculates_at_one_request(tiny_models, reference_servers, tmp_path):
    after, tail, text = serve_and_measure(tiny_models, reference_servers, "agree", tmp_path)
    assert after.acceptance is not None and after.acceptance > 3.5, after  # 3 drafts + the bonus
    assert after.mode == 1, f"not speculating at the end: {after}"
    assert tail["spec"] > 0 and tail["plain"] <= PROBE_BUDGET, tail
    assert "step costs (" in text  # both modes' costs were known before deciding
