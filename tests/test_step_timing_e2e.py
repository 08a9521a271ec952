"""End to end on real SGLang (CPU test bed): the start-up step-cost calibration
(``SGLANG_DYNSPEC_CALIBRATE=1``, ``step_timing``) times both decode modes at every
point of the CPU grid, under the synchronous and the overlap scheduler, and leaves no
trace: afterwards the server switches modes under load, every greedy output equals a
non-speculative server's, and no KV is left once idle.

Three server starts: the non-speculative reference, then one calibrating
EAGLE3_DYNAMIC server per scheduler (the cost cache is off, so each one times).
"""

from __future__ import annotations

import re

import pytest

from dynspec_testbed.server import CpuServer, dynamic_server_args, wait_until_idle
from dynspec_testbed.workload import compare_outputs, plugin_counters, run_waves, waves_of
from sglang_dynspec.config import COST_CACHE_ENV
from sglang_dynspec.step_timing import BUDGET_ENV, CALIBRATE_ENV

pytestmark = pytest.mark.server

# One OpenMP thread per server: on a small shared machine two threads stall each other
# at every barrier, and timings jitter tenfold (every server here alike, so greedy
# outputs stay comparable).
CI_ENV = {"SGLANG_IS_IN_CI": "1", "SGLANG_CPU_OMP_THREADS_BIND": "0"}
# The whole grid, however slow the machine: the default budget (15 s) cuts it short
# under load (the budget itself is unit-tested in test_step_timing.py).
CALIBRATING = {**CI_ENV, CALIBRATE_ENV: "1", BUDGET_ENV: "300", COST_CACHE_ENV: "off"}
SCHEDULERS = {"sync": CALIBRATING, "overlap": {**CALIBRATING, "SGLANG_DYNSPEC_TESTBED_OVERLAP": "1"}}
# Wave sizes cross the switching threshold (3 running requests) both ways.
WAVES = waves_of([1, 2, 5, 10, 1, 8, 2], seed=17, prefix="cal", new_tokens=(12, 40))
# The CPU grid (no CUDA graphs): --max-running-requests 16, context length 2048.
GRID = {(bs, ctx) for bs in (1, 4, 16) for ctx in (64, 256)}

HEAD = re.compile(
    r"\[sglang-dynspec\] step costs \(timed at start-up in ([0-9.]+) s; device ms per decode step\):"
)
CONTEXT_ROW = re.compile(r"^\s+context\s+(\d+)\s+batch((?:\s+\d+)+)\s*$")
MODE_ROW = re.compile(r"^\s+(plain|spec) ms((?:\s+(?:[0-9.]+|-))+)\s*$")


def parse_step_costs(log: str) -> tuple[float, dict[tuple[str, int, int], float], str]:
    """(seconds the calibration took, {(mode, batch, context): ms}, the table's text)
    from the server log's one step-cost table."""
    lines = log.splitlines()
    heads = [i for i, line in enumerate(lines) if HEAD.search(line)]
    assert len(heads) == 1, f"expected one step-cost table in the log, found {len(heads)}"
    seconds = float(HEAD.search(lines[heads[0]]).group(1))
    costs, sizes, context, table = {}, [], None, [lines[heads[0]]]
    for line in lines[heads[0] + 1 :]:
        if m := CONTEXT_ROW.match(line):
            context, sizes = int(m.group(1)), [int(b) for b in m.group(2).split()]
        elif (m := MODE_ROW.match(line)) and context is not None:
            cells = m.group(2).split()
            assert len(cells) == len(sizes), line
            costs.update({(m.group(1), b, context): float(c) for b, c in zip(sizes, cells) if c != "-"})
        else:
            break
        table.append(line)
    return seconds, costs, "\n".join(table)


@pytest.fixture(scope="module")
def reference(reference_servers) -> dict[str, dict]:
    return reference_servers.serve("random", lambda url: run_waves(url, WAVES))


@pytest.mark.parametrize("scheduler", sorted(SCHEDULERS))
def test_calibration_times_every_point_and_leaves_no_trace(tiny_models, reference, tmp_path, scheduler):
    log = tmp_path / "server.log"
    args = dynamic_server_args(
        tiny_models, "random", disable_above=3, extra=["--max-running-requests", 16, "--enable-metrics"]
    )
    with CpuServer(args, log_path=log, env=SCHEDULERS[scheduler]) as server:
        got = run_waves(server.url, WAVES)
        loads = wait_until_idle(server.url, timeout=60)
        counters = plugin_counters(server.url)
        startup = server.startup_seconds
    text = log.read_text()
    seconds, costs, table = parse_step_costs(text)
    print(f"\n[{scheduler}] server up in {startup:.1f} s, calibration {seconds:.1f} s\n{table}")

    # Every grid point, both modes, positive times.
    assert {(bs, ctx) for _, bs, ctx in costs} == GRID, table
    assert len(costs) == 2 * len(GRID) and all(ms > 0 for ms in costs.values()), table
    # A speculative step (3 draft steps, a 4-token verify, a draft extend) costs more
    # than a plain one: about 2-3x here on a quiet machine, at every point. On a shared
    # 2-core machine another process can stall a few timed steps for seconds and flip a
    # point, so the test asks for most points, not all.
    slower = [(bs, ctx) for bs, ctx in sorted(GRID) if costs[("spec", bs, ctx)] > costs[("plain", bs, ctx)]]
    assert len(slower) > len(GRID) / 2, f"spec slower than plain only at {slower}:\n{table}"
    assert "ran without their CUDA graph" not in text  # no graphs on the CPU: nothing expected

    # The calibration left no trace: the server switches both ways, its greedy output is
    # the non-speculative server's, and no KV is in use once idle.
    assert all(load["num_used_tokens"] == 0 for load in loads), f"KV in use once idle: {loads}"
    assert counters.switches_to_plain >= 1 and counters.switches_to_spec >= 1, counters
    assert counters.steps_plain > 0 and counters.steps_spec > 0, counters
    mismatches = compare_outputs(reference, got)
    assert not mismatches, f"{len(mismatches)} of {len(got)} requests differ: {mismatches[:3]}"
    if scheduler == "overlap":
        assert "Non-overlap (synchronous) spec v2" not in text, "overlap was not in use"
    else:
        assert "Non-overlap (synchronous) spec v2" in text
