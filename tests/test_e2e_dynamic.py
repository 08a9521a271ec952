"""End to end on real SGLang (CPU test bed): EAGLE3_DYNAMIC's greedy output equals a
non-speculative server's, token for token, while the mode switches both ways.

The reference outputs are recorded first, on the session's shared non-speculative
servers (``reference_servers``: idle, they sleep and take no core), then each
EAGLE3_DYNAMIC configuration is started, driven and compared. Every server runs with ``SGLANG_IS_IN_CI=1`` so SGLang
asserts a missing overlap publish (otherwise silent, and wrong tokens follow).

Coverage (issue 2): load patterns crossing the thresholds both ways, logprobs, a
regex-constrained request, retraction under a small KV pool, mixed chunked prefill,
topk 1 and topk 4, the random and the always-agreeing model pair, the synchronous
and the overlap scheduler, the original crash scenario (threshold 5, concurrency
1, 2, 5 then 10, 16 draft tokens) under both schedulers, and no KV leak once idle.
"""

from __future__ import annotations

import math
import re

import pytest

from dynspec_testbed.server import (
    CI_ENV,
    OVERLAP_CI_ENV,
    CpuServer,
    assert_no_kv_left,
    dynamic_server_args,
    retracting,
)
from dynspec_testbed.workload import (
    compare_outputs,
    plugin_counters,
    random_requests,
    run_staggered,
    run_waves,
    split_into_waves,
    waves_of,
)
from sglang_dynspec.config import (
    REQUEST_MODES_ENV,
    REQUEST_MODES_KEY,
    SPLIT_KV_DRAFT_EXTEND_ENV,
    SPLIT_KV_VERIFY_ENV,
)

pytestmark = pytest.mark.server

# ----------------------------------------------------------------- request sets
# Wave sizes go up past and back below the thresholds used below (3 and 5).
WAVES = waves_of([1, 2, 5, 10, 1, 8, 2], seed=11, prefix="wave", new_tokens=(12, 40))
# The original crash scenario, then one more request once load has fallen.
CRASH_WAVES = waves_of([1, 2, 5, 10, 1], seed=12, prefix="crash", new_tokens=(16, 32))
# Requests joining a running batch; prompts longer than the 32-token prefill chunk
# of the mixed-chunk server, so prefill chunks mix with decode.
STAGGERED = random_requests(12, seed=13, prefix="stag", prompt_len=(33, 70))
LOGPROBS = split_into_waves(
    random_requests(7, seed=14, prefix="lp", extra={"return_logprob": True, "top_logprobs_num": 3}),
    [7],
)
REGEX = split_into_waves(
    random_requests(
        6,
        seed=15,
        prefix="re",
        extra={
            "sampling_params": {
                "regex": "(the|quick|brown|fox|dog)( (the|quick|brown|fox|dog)){3,9}",
                "ignore_eos": False,
            }
        },
    ),
    [6],
)
RANDOM_PAIR_SETS = {
    "waves": WAVES,
    "crash": CRASH_WAVES,
    "logprobs": LOGPROBS,
    "regex": REGEX,
}


def run_sets(url: str, sets: dict[str, list], staggered: bool) -> dict[str, dict]:
    results: dict[str, dict] = {}
    for waves in sets.values():
        results.update(run_waves(url, waves))
    if staggered:
        results.update(run_staggered(url, STAGGERED, gap_s=0.15))
    return results


@pytest.fixture(scope="module")
def reference(reference_servers) -> dict[str, dict[str, dict]]:
    """Greedy outputs of non-speculative servers: random target and agreeing target."""
    return {
        "random": reference_servers.serve(
            "random", lambda url: run_sets(url, RANDOM_PAIR_SETS, staggered=True)
        ),
        "agree": reference_servers.serve(
            "agree", lambda url: {**run_waves(url, WAVES), **run_waves(url, CRASH_WAVES)}
        ),
    }


def dynamic_args(models, pair: str, *, extra=(), **settings) -> list:
    return dynamic_server_args(
        models, pair, extra=["--max-running-requests", 16, "--enable-metrics", *extra], **settings
    )


def assert_identical(reference: dict[str, dict], got: dict[str, dict]) -> None:
    mismatches = compare_outputs({k: reference[k] for k in got}, got)
    tokens = sum(len(r["output_ids"]) for r in got.values())
    assert not mismatches, (
        f"{len(mismatches)} of {len(got)} requests differ from the non-speculative server "
        f"({tokens} tokens): " + "; ".join(map(str, mismatches[:5]))
    )


def assert_switched_both_ways_and_no_leak(server: CpuServer) -> None:
    assert_no_kv_left(server.url, timeout=60)
    counters = plugin_counters(server.url)
    assert counters.has_plugin_metrics, "EAGLE3_DYNAMIC metrics missing from /metrics"
    assert counters.steps_plain > 0 and counters.steps_spec > 0, counters
    assert counters.switches_to_plain >= 1 and counters.switches_to_spec >= 1, counters


def assert_step_modes_reported(results: dict[str, dict]) -> None:
    """With SGLANG_DYNSPEC_REQUEST_MODES=1 each response lists the mode of each of its
    decode steps: as many entries as SGLang counted verify steps for it (plain steps
    are counted there too), and both modes among the requests of a switching run."""
    counts = {}
    for rid, result in results.items():
        meta = result["meta_info"]
        modes = meta[REQUEST_MODES_KEY]
        assert set(modes) <= {"plain", "spec"}, (rid, modes)
        assert len(modes) == meta["spec_verify_ct"], (rid, len(modes), meta["spec_verify_ct"])
        # Each plain step yields one token and each speculative step at least one,
        # after the prefill's first token.
        assert meta["completion_tokens"] >= 1 + len(modes), (rid, meta["completion_tokens"], len(modes))
        counts[rid] = (modes.count("plain"), modes.count("spec"))
    assert any(plain for plain, _ in counts.values()) and any(spec for _, spec in counts.values()), counts
    # The lone request of the first wave ran alone, below the threshold: speculative only.
    assert counts["wave0"][0] == 0 and counts["wave0"][1] > 0, counts


def test_sync_topk4_random_pair_crash_scenario_retraction_mixed_chunk(tiny_models, reference, tmp_path):
    """Synchronous scheduler, 16 draft tokens (topk 4), threshold 5: the original crash
    configuration; a small KV pool (each request reserves 2 x 20 speculative slots)
    and SGLang's retraction test switch retract requests, and long staggered prompts
    mix prefill chunks with decode."""
    log = tmp_path / "server.log"
    args = dynamic_args(
        tiny_models,
        "random",
        steps=5,
        topk=4,
        draft_tokens=16,
        disable_above=5,
        dwell=0,
        extra=["--max-total-tokens", "600", "--enable-mixed-chunk", "--chunked-prefill-size", "32"],
    )
    # Whether the small pool runs out depends on how requests interleave; SGLang's own
    # test switch also retracts running requests every 10th forward, so every run
    # retracts (both ways it is the real retract_decode path).
    retract_env = {**CI_ENV, **retracting(every=10)}
    with CpuServer(args, log_path=log, env=retract_env) as server:
        got = run_sets(server.url, RANDOM_PAIR_SETS, staggered=True)
        assert_switched_both_ways_and_no_leak(server)
        counters = plugin_counters(server.url)
    assert_identical(reference["random"], got)
    # Mixed prefill+decode steps ran with decoding requests caught up before them (8 in
    # the 2026-12-01 CI run).
    assert counters.catch_ups["mixed"] >= 1, counters
    text = log.read_text()
    retracted = sum(int(n) for n in re.findall(r"#retracted_reqs: (\d+)", text))
    assert retracted > 0, "no request was retracted; the scenario is not exercised"
    assert "Non-overlap (synchronous) spec v2" in text


def test_overlap_topk4_random_pair_crash_scenario(tiny_models, reference, tmp_path):
    """Overlap scheduler, 16 draft tokens (topk 4), threshold 5: the crash configuration
    again, now with the publish, grammar barrier and FutureMap relay of the plain step."""
    log = tmp_path / "server.log"
    args = dynamic_args(tiny_models, "random", steps=5, topk=4, draft_tokens=16, disable_above=5, dwell=0)
    with CpuServer(args, log_path=log, env={**OVERLAP_CI_ENV, REQUEST_MODES_ENV: "1"}) as server:
        got = run_sets(server.url, RANDOM_PAIR_SETS, staggered=False)
        assert_switched_both_ways_and_no_leak(server)
    assert_identical(reference["random"], got)
    assert_step_modes_reported(got)
    text = log.read_text()
    assert "Non-overlap (synchronous) spec v2" not in text, "overlap was not in use"
    assert "torch gather_spec_extras in use" in text, "the overlap FutureMap relay never ran"


def test_overlap_topk1_agreeing_pair_keeps_full_acceptance(tiny_models, reference, tmp_path):
    """The agreeing pair accepts every draft of a chain; right after plain phases it still does."""
    steps = 3
    args = dynamic_args(tiny_models, "agree", steps=steps, topk=1, draft_tokens=4, disable_above=3, dwell=2)
    log = tmp_path / "server.log"
    with CpuServer(args, log_path=log, env={**OVERLAP_CI_ENV, SPLIT_KV_VERIFY_ENV: "1"}) as server:
        got = {**run_waves(server.url, WAVES), **run_waves(server.url, CRASH_WAVES)}
        assert_switched_both_ways_and_no_leak(server)
        counters = plugin_counters(server.url)
    assert_identical(reference["agree"], got)
    # The first speculative step after every resume accepted the full chain, as every
    # other step does (tests/test_catch_up_e2e.py shows the same with a pair whose right
    # proposal depends on the position, where a stale draft state would fail).
    assert counters.resume_requests >= 1, counters
    assert counters.resume_accept_length == steps + 1, counters
    # The lone request after each 10-request wave runs right after a plain phase, in
    # spec mode throughout. With every draft accepted, each verify step commits
    # steps + 1 tokens (the drafts + the bonus), as in steady state; the first token
    # comes from prefill.
    for lone in (WAVES[4][0], CRASH_WAVES[4][0]):
        meta = got[lone.rid]["meta_info"]
        n, verify_steps = meta["completion_tokens"], meta["spec_verify_ct"]
        full_acceptance = math.ceil((n - 1) / (steps + 1))
        assert verify_steps <= full_acceptance + 1, (
            f"{lone.rid}: {n} tokens took {verify_steps} verify steps; full acceptance needs "
            f"{full_acceptance}"
        )
    # The split-KV verify's switch ran in the scheduler's order (after the target's attention
    # backends exist) and, on the CPU's attention backend, names what it needs.
    assert f"({SPLIT_KV_VERIFY_ENV}): not used: the target's attention backend is " in log.read_text()
    assert "(--attention-backend triton)" in log.read_text()
    # ... and so did the draft extend's (on by default), naming the draft's flag.
    assert (
        f"draft extend attention ({SPLIT_KV_DRAFT_EXTEND_ENV}): not used: the draft's attention backend is "
        in (log.read_text())
    )
    assert "(--speculative-draft-attention-backend triton)" in log.read_text()
