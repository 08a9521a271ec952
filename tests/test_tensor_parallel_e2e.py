"""End to end on real SGLang (CPU test bed): EAGLE3_DYNAMIC with two tensor-parallel ranks.

Both ranks run the plugin: they agree on its settings at start-up, decide each step's
mode from inputs that are identical on both, and run the plain step, the catch-up and
the speculative step in lockstep. A rank that decided differently would enter another
collective and the server would hang; outputs would differ if a rank ran a different
computation. The non-speculative reference runs with two ranks too, so that the
arithmetic (the split matmuls and their all-reduce) is the same on both servers.

Two ranks on the CPU engine need their cores named (``SGLANG_CPU_OMP_THREADS_BIND``)
and gloo groups (the test bed turns SGLang's PyNccl default off, ``plugin.py``).
``tests/test_two_ranks.py`` covers the refusal of settings that differ between ranks.

The goodput policy (the default) adds rank-local inputs: step costs timed at start-up
on each rank's clock (the first rank's table is handed to both, or read from the cache
by the first rank alone) and device and host times every step (agreed every 16
steps). A rank that took its own would decide differently and hang the server.
"""

from __future__ import annotations

import pytest

from dynspec_testbed.server import (
    TWO_RANK_CI_ENV,
    CpuServer,
    assert_no_kv_left,
    baseline_server_args,
    dynamic_server_args,
    flush_cache,
    serve,
    wait_until_idle,
)
from dynspec_testbed.workload import compare_outputs, plugin_counters, run_waves, waves_of
from sglang_dynspec.config import COST_CACHE_ENV, REQUEST_MODES_ENV, REQUEST_MODES_KEY

pytestmark = pytest.mark.server

WAVES = waves_of([1, 6, 1, 6, 2, 8], seed=51, prefix="tp", new_tokens=(12, 32))
GOODPUT_WAVES = waves_of([1, 4, 1, 4], seed=52, prefix="tp-gp", new_tokens=(24, 40))


@pytest.fixture(scope="module")
def two_rank_reference(tiny_models, tmp_path_factory) -> dict[str, dict[str, dict]]:
    """The non-speculative server's outputs for both tests' waves, with two ranks too
    (the same split matmuls and all-reduce as the servers compared with it); its prefix
    cache is emptied between the two workloads, as on a fresh server."""

    def both(url: str) -> dict[str, dict[str, dict]]:
        switching = run_waves(url, WAVES)
        wait_until_idle(url)
        flush_cache(url)
        return {"switching": switching, "goodput": run_waves(url, GOODPUT_WAVES)}

    return serve(
        baseline_server_args(tiny_models, extra=["--tp-size", 2]),
        both,
        log_path=tmp_path_factory.mktemp("two-rank-reference") / "reference.log",
        env=TWO_RANK_CI_ENV,
    )


def test_two_ranks_switch_both_ways_and_match_the_baseline(tiny_models, two_rank_reference, tmp_path):
    reference = two_rank_reference["switching"]

    args = dynamic_server_args(
        tiny_models, extra=["--tp-size", 2, "--speculative-catch-up-tokens", 8, "--enable-metrics"]
    )
    log = tmp_path / "dynamic.log"
    with CpuServer(args, log_path=log, env={**TWO_RANK_CI_ENV, REQUEST_MODES_ENV: "1"}) as server:
        got = run_waves(server.url, WAVES)
        counters = plugin_counters(server.url)
        assert_no_kv_left(server.url)

    assert [str(m) for m in compare_outputs(reference, got)] == []
    assert "TP1" in log.read_text(), "the second rank never started"
    assert counters.switches_to_plain >= 2 and counters.switches_to_spec >= 2, counters
    assert counters.catch_ups["resume"] >= 1 and counters.catch_ups["buffer_full"] >= 1, counters
    modes = [set(r["meta_info"][REQUEST_MODES_KEY]) for r in got.values()]
    assert {"plain"} in modes and {"spec"} in modes, modes


def test_two_ranks_with_the_goodput_policy_decide_alike_and_a_restart_reads_the_cached_table(
    tiny_models, two_rank_reference, tmp_path
):
    reference = two_rank_reference["goodput"]
    # No policy flag: goodput is the default. The random draft is rejected (about one
    # token per speculative step), so once the counters have measured it, it goes plain.
    args = dynamic_server_args(
        tiny_models,
        policy=None,
        disable_above=None,
        dwell=4,
        extra=["--tp-size", 2, "--max-running-requests", 8, "--enable-metrics"],
    )
    env = {**TWO_RANK_CI_ENV, COST_CACHE_ENV: str(tmp_path / "cost-cache")}
    texts = []
    for start in ("first", "restart"):
        log = tmp_path / f"goodput-{start}.log"
        with CpuServer(args, log_path=log, env=env) as server:
            got = run_waves(server.url, GOODPUT_WAVES)
            counters = plugin_counters(server.url)
            assert_no_kv_left(server.url)
        assert [str(m) for m in compare_outputs(reference, got)] == [], start
        assert counters.switches_to_plain >= 1 and counters.steps_plain > 0, (start, counters)
        texts.append(log.read_text())
    first, restart = texts
    assert "TP1" in first and "goodput policy" in first
    assert "step costs (timed at start-up" in first
    assert "step costs (read from the cache" in restart
    assert list((tmp_path / "cost-cache").glob("step-costs-*.json")), "no table was cached"
