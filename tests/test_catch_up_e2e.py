"""End to end on real SGLang (CPU test bed): the draft catch-up (issue 3).

1. Draft KV rows. The same six prompts run on a stock EAGLE3 server (always
   speculating) and on EAGLE3_DYNAMIC servers with threshold 3, so the six run
   plain, the four short ones finish, and the two long ones resume speculation and
   finish speculating. Each server writes the draft K and V rows of every finished
   request (``dynspec_testbed/draft_kv.py``). With the catch-up (buffer of 4 positions, so
   it also flushes in plain mode), the long requests' rows equal EAGLE3's at every
   position, under both schedulers, within float32 rounding; the short ones, which
   finish while plain, differ at most in their last 4 positions (the documented
   stale tail). With the catch-up off, the positions decoded plain differ: the
   comparison can fail.

   With mixed chunked prefill, the decoding requests' gaps are replayed before each
   mixed step; their draft KV is held to the same bound.

2. Acceptance right after a resume. With the counting pair (the right proposal
   depends on the position, see ``dynspec_testbed/models.py``) and one draft step, every
   speculative step accepts 2 tokens when the draft state is current. The first
   step after a resume accepts 2 with the catch-up (sync and overlap schedulers)
   and fewer without it. Outputs count up, as the target alone does.

Greedy outputs equal the EAGLE3 server's, token for token, in every run.
"""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from dynspec_testbed.draft_kv import DUMP_DIR_ENV, load_dumps
from dynspec_testbed.host_reads import HOST_READS_ENV, load_reports
from dynspec_testbed.server import (
    CI_ENV,
    OVERLAP_CI_ENV,
    assert_no_kv_left,
    dynamic_server_args,
    generate,
    serve,
    speculative_server_args,
)
from dynspec_testbed.workload import plugin_counters, random_requests, run_waves
from sglang_dynspec.config import FLUSH_STREAM_ENV, FLUSH_TOKENS_ENV
from sglang_dynspec.worker import FLUSH_WITHOUT_LAST_MLP

pytestmark = pytest.mark.server

BUFFER = 4  # --speculative-catch-up-tokens in these tests
# float32 on CPU: plain decode and verify compute the target's hidden states with
# different kernels; the draft's K/V rows then differ by ~1e-5, junk by ~1.
KV_TOLERANCE = 1e-4

LONG = random_requests(2, seed=21, prefix="long", new_tokens=(60, 60))
SHORT = random_requests(4, seed=22, prefix="short", new_tokens=(20, 20))
KV_WAVES = [LONG + SHORT]
# One request alone (speculating), then six (plain), of which two outlive the rest.
# Prompts longer than a 32-token prefill chunk, started 0.15 s apart: with
# --enable-mixed-chunk their chunks mix with the decoding requests, whose gaps are
# then replayed before the mixed step.
# Mixed steps with decoding requests in plain mode, by construction: four requests
# decode (plain: above the threshold of 3) and, once the server has run some plain
# steps, three prompts longer than the 32-token prefill chunk join, so their chunks
# are prefilled in mixed steps beside requests whose gaps are not empty.
# The decoding wave lasts 200 plain steps so that the joining prompts reach the scheduler
# while it decodes even on a loaded machine: with 80 (about 2 s on the test bed) a run of
# the whole suite once saw the joining wave prefilled only after the decoding wave ended,
# so no step mixed.
MIX_DECODING = random_requests(4, seed=41, prefix="mixdec", new_tokens=(200, 200))
MIX_JOINING = random_requests(3, seed=42, prefix="mixjoin", prompt_len=(40, 70), new_tokens=(20, 20))
# The second wave goes as one batched request (run_waves(batched=True)): sent as six
# concurrent posts, a full suite run on two loaded cores once saw them reach the
# scheduler so far apart that no step held more than three, so nothing ran plain.
COUNT_WAVES = [
    random_requests(1, seed=31, prefix="alone", new_tokens=(30, 30)),
    random_requests(2, seed=32, prefix="long", new_tokens=(60, 60))
    + random_requests(4, seed=33, prefix="short", new_tokens=(20, 20)),
]


COMMON = ["--max-running-requests", 16, "--enable-metrics"]


def eagle3_args(models) -> list:
    return speculative_server_args("EAGLE3", models, extra=COMMON)


def dynamic_args(models, buffer: int, pair: str = "random", steps: int = 3, draft_tokens: int = 4, extra=()):
    return dynamic_server_args(
        models,
        pair,
        steps=steps,
        draft_tokens=draft_tokens,
        disable_above=3,
        dwell=0,
        extra=["--speculative-catch-up-tokens", buffer, *COMMON, *extra],
    )


def join_while_decoding(url: str, plain_steps: int = 6, timeout: float = 120.0) -> dict[str, dict]:
    """MIX_DECODING, then MIX_JOINING once the server has run ``plain_steps`` plain steps
    (a server without the plugin's metrics: once it has decoded for a second)."""
    with ThreadPoolExecutor(max_workers=len(MIX_DECODING) + len(MIX_JOINING)) as pool:
        decoding = {r.rid: pool.submit(generate, url, **r.kwargs()) for r in MIX_DECODING}
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            counters = plugin_counters(url)
            if not counters.has_plugin_metrics:
                time.sleep(1.0)
                break
            if counters.steps_plain >= plain_steps:
                break
            time.sleep(0.05)
        else:
            raise AssertionError(f"the decoding wave never ran {plain_steps} plain steps")
        joining = {r.rid: pool.submit(generate, url, **r.kwargs()) for r in MIX_JOINING}
        return {rid: f.result() for rid, f in {**decoding, **joining}.items()}


def outputs_and_counters(args, log: Path, env: dict[str, str], waves=None, workload=None):
    """Run ``waves`` (or ``workload(url)``) on a server; check that no KV is left once
    idle; return (output ids by rid, plugin counters)."""

    def run(url):
        outputs = workload(url) if workload is not None else run_waves(url, waves)
        assert_no_kv_left(url, timeout=60)
        return {rid: out["output_ids"] for rid, out in outputs.items()}, plugin_counters(url)

    return serve(args, run, log_path=log, env=env)


def dumps_by_tokens(directory: Path) -> dict[tuple[int, ...], dict]:
    return {
        tuple(record["token_ids"]): record
        for record in load_dumps(directory).values()
        if not str(record["rid"]).startswith("HEALTH_CHECK")
    }


def started_as(tokens: tuple[int, ...], requests) -> bool:
    return any(tokens[: len(r.input_ids)] == r.input_ids for r in requests)


def is_long(tokens: tuple[int, ...]) -> bool:
    return started_as(tokens, LONG)


def kv_mismatches(a: dict, b: dict) -> list[int]:
    """Positions whose draft K or V rows differ by more than the tolerance."""
    assert a["k"].shape == b["k"].shape, (a["k"].shape, b["k"].shape)
    diff = torch.maximum((a["k"] - b["k"]).abs(), (a["v"] - b["v"]).abs())
    per_position = diff.amax(dim=(0, 2, 3))  # [layers, positions, heads, dim] -> [positions]
    return (per_position > KV_TOLERANCE).nonzero().flatten().tolist()


@pytest.fixture(scope="module")
def eagle3_draft_kv(tiny_models, tmp_path_factory):
    """Outputs and draft KV dumps of the always-speculating EAGLE3 server."""
    root = tmp_path_factory.mktemp("eagle3-kv")
    args = eagle3_args(tiny_models)
    outputs, _ = outputs_and_counters(
        args, root / "server.log", {**CI_ENV, DUMP_DIR_ENV: str(root)}, KV_WAVES
    )
    return outputs, dumps_by_tokens(root)


def run_dynamic_with_dumps(tiny_models, tmp_path, env, buffer, extra=()):
    args = dynamic_args(tiny_models, buffer, extra=extra)
    outputs, counters = outputs_and_counters(
        args, tmp_path / "server.log", {**env, DUMP_DIR_ENV: str(tmp_path)}, KV_WAVES
    )
    assert counters.steps_plain > 0 and counters.switches_to_spec >= 1, counters
    return outputs, counters, dumps_by_tokens(tmp_path)


# With a flush budget of two full logs, the six requests' gaps are flushed in pieces; and
# through the side stream's bookkeeping (on the CPU the work runs in order: the device
# side of SGLANG_DYNSPEC_FLUSH_STREAM is checked on the H200).
FLUSH_IN_PIECES_ENV = {**OVERLAP_CI_ENV, FLUSH_TOKENS_ENV: str(2 * BUFFER), FLUSH_STREAM_ENV: "1"}
# SGLang's prefill forwards of at most 5 tokens: every catch-up forward then holds one
# request's gap (a flush of six gaps of 4 runs as six forwards, a resume of two as two).
SMALL_PREFILL = 5
FORWARDS_OF_ONE_GAP_ENV = dict(OVERLAP_CI_ENV)


@pytest.mark.parametrize(
    "scheduler_env",
    [CI_ENV, OVERLAP_CI_ENV, FLUSH_IN_PIECES_ENV, FORWARDS_OF_ONE_GAP_ENV],
    ids=[
        "sync",
        "overlap",
        "overlap-flushes-in-pieces-on-a-side-stream",
        "overlap-catch-up-forwards-within-the-chunked-prefill-size",
    ],
)
def test_draft_kv_after_catch_up_equals_always_speculating(
    tiny_models, eagle3_draft_kv, tmp_path, scheduler_env
):
    reference_outputs, reference_kv = eagle3_draft_kv
    reads = tmp_path / "host-reads"
    small = scheduler_env is FORWARDS_OF_ONE_GAP_ENV
    outputs, counters, kv = run_dynamic_with_dumps(
        tiny_models,
        tmp_path,
        {**scheduler_env, HOST_READS_ENV: str(reads)},
        BUFFER,
        extra=["--chunked-prefill-size", SMALL_PREFILL] if small else (),
    )

    assert outputs == reference_outputs
    assert counters.catch_ups["resume"] >= 1 and counters.catch_ups["buffer_full"] >= 1, counters
    # The flushes left out the draft's last MLP (compat.MlpAtRows), and the KV rows below
    # still equal EAGLE3's: the MLP does not feed the draft KV.
    assert FLUSH_WITHOUT_LAST_MLP in (tmp_path / "server.log").read_text()
    if small:
        assert (
            f"each catch-up forward replays at most {SMALL_PREFILL} positions"
            in (tmp_path / "server.log").read_text()
        )
        # One gap (at most BUFFER positions) per forward; unsplit, a flush is 6 x 4.
        assert counters.catch_up_tokens <= BUFFER * sum(counters.catch_ups.values()), counters
    # Positions a request's buffer holds: BUFFER, and with pieces the slack that lets them
    # start at a full buffer (catch_up.flush_slack, in the start-up log).
    held = BUFFER
    if scheduler_env is FLUSH_IN_PIECES_ENV:  # in pieces of two logs: 8 positions, not 6 x 4
        log_text = (tmp_path / "server.log").read_text()
        # (0 here: with --max-running-requests 16 a piece would hold one log of 5 and start
        # earlier than one of two logs of 4 does.)
        held += int(re.search(r"(\d+) more positions per request", log_text).group(1))
        assert counters.catch_up_tokens <= 2 * held * sum(counters.catch_ups.values()), counters
        assert f"on a side stream beside the plain steps ({FLUSH_STREAM_ENV})" in log_text
    # No host sync in the plugin's step code: its own frames read no tensor to the host
    # during these steps (plain, speculative, resume and buffer-full catch-ups) except at
    # the host-mirror sites of host_reads.ALLOWED. The guard saw the plugin's frames: the
    # plain step's host-mirror read is among the counted sites.
    [report] = load_reports(reads)
    assert report["steps"] >= 16 and report["violations"] == {}, report
    assert report["reads"].get("fresh_batch.py:build_plain_decode_batch:__int__", 0) >= 1, report
    # Each catch-up took its committed lengths from the gaps' starts (copied to the host
    # behind the step that decoded them), not from the device's seq_lens.
    assert report["reads"].get("device_timer.py:read:tolist", 0) >= 1, report
    # (The server's own warm-up request is dumped too and compared like the others.)
    assert set(kv) == set(reference_kv)
    assert sum(is_long(t) for t in kv) == len(LONG) and sum(started_as(t, SHORT) for t in kv) == len(SHORT)
    for tokens, record in kv.items():
        bad = kv_mismatches(record, reference_kv[tokens])
        positions = record["k"].shape[1]
        if is_long(tokens):
            assert bad == [], f"long request ({positions} positions): draft KV differs at {bad}"
        elif started_as(tokens, SHORT):
            # Finished while plain: at most the last positions its buffer held were never replayed.
            assert all(p >= positions - held for p in bad), (positions, bad)
        else:
            assert bad == [], f"warm-up request: draft KV differs at {bad}"


def test_draft_kv_without_catch_up_differs_where_decoded_plain(tiny_models, eagle3_draft_kv, tmp_path):
    """Negative control: the comparison above detects unwritten draft KV."""
    reference_outputs, reference_kv = eagle3_draft_kv
    outputs, counters, kv = run_dynamic_with_dumps(tiny_models, tmp_path, CI_ENV, 0)

    assert outputs == reference_outputs
    assert sum(counters.catch_ups.values()) == 0
    stale = {tokens: kv_mismatches(record, reference_kv[tokens]) for tokens, record in kv.items()}
    long_stale = [bad for tokens, bad in stale.items() if is_long(tokens)]
    assert len(long_stale) == len(LONG)
    # Every plain step left one position per running request unwritten.
    assert all(len(bad) >= BUFFER for bad in long_stale), long_stale


def within_limit(records: dict[tuple[int, ...], dict], requests) -> dict[tuple[int, ...], dict]:
    """The records of ``requests``, each cut at its prompt plus max_new_tokens: with a
    tree draft, SGLang's EAGLE3 can hold a token past the limit in ``output_ids`` when
    it releases a request's KV (not in its response), one more than the dump of the
    same request on a server that ended it with a plain step."""
    cut = {}
    for tokens, record in records.items():
        [request] = [r for r in requests if tokens[: len(r.input_ids)] == r.input_ids]
        n = len(request.input_ids) + request.max_new_tokens
        cut[tokens[:n]] = {**record, "k": record["k"][:, : n - 1], "v": record["v"][:, : n - 1]}
    return cut


def test_draft_kv_with_a_tree_draft_equals_always_speculating(tiny_models, tmp_path):
    """Top-k 4 (a tree of 8 draft tokens) on both servers: the catch-up writes the draft
    KV rows an always-speculating EAGLE3 server writes, at every position of the long
    requests and at all but the stale tail of the short ones, which finish plain."""
    tree = dict(steps=3, topk=4, draft_tokens=8)
    reference_dir, dynamic_dir = tmp_path / "eagle3", tmp_path / "dynamic"
    reference_dir.mkdir()
    dynamic_dir.mkdir()
    reference_outputs, _ = outputs_and_counters(
        speculative_server_args("EAGLE3", tiny_models, extra=COMMON, **tree),
        reference_dir / "server.log",
        {**CI_ENV, DUMP_DIR_ENV: str(reference_dir)},
        KV_WAVES,
    )
    outputs, counters = outputs_and_counters(
        dynamic_server_args(
            tiny_models,
            disable_above=3,
            dwell=0,
            extra=["--speculative-catch-up-tokens", BUFFER, *COMMON],
            **tree,
        ),
        dynamic_dir / "server.log",
        {**CI_ENV, DUMP_DIR_ENV: str(dynamic_dir)},
        KV_WAVES,
    )

    assert outputs == reference_outputs
    assert counters.catch_ups["resume"] >= 1 and counters.catch_ups["buffer_full"] >= 1, counters
    workload = LONG + SHORT
    mine = {t: r for t, r in dumps_by_tokens(dynamic_dir).items() if started_as(t, workload)}
    theirs = {t: r for t, r in dumps_by_tokens(reference_dir).items() if started_as(t, workload)}
    kv, reference_kv = within_limit(mine, workload), within_limit(theirs, workload)
    assert len(kv) == len(workload) and set(kv) == set(reference_kv)
    for tokens, record in kv.items():
        bad = kv_mismatches(record, reference_kv[tokens])
        positions = record["k"].shape[1]
        if is_long(tokens):
            assert bad == [], f"long request ({positions} positions): draft KV differs at {bad}"
        else:  # finished while plain: at most the last BUFFER positions were never replayed
            assert all(p >= positions - BUFFER for p in bad), (positions, bad)


@pytest.mark.parametrize("scheduler_env", [CI_ENV, OVERLAP_CI_ENV], ids=["sync", "overlap"])
def test_draft_kv_with_mixed_chunks_equals_always_speculating(tiny_models, tmp_path, scheduler_env):
    """Mixed prefill+decode steps (the third catch-up point): prompts join while four
    requests decode in plain mode. Where each request's last buffer stands when a chunk
    mixes in depends on timing, so every request is held to the weaker bound: all
    positions but its last BUFFER equal the EAGLE3 server's (run with the same scheduler)."""
    reference_dir, dynamic_dir = tmp_path / "eagle3", tmp_path / "dynamic"
    reference_dir.mkdir()
    dynamic_dir.mkdir()
    reference_outputs, _ = outputs_and_counters(
        eagle3_args(tiny_models),
        reference_dir / "server.log",
        {**scheduler_env, DUMP_DIR_ENV: str(reference_dir)},
        workload=join_while_decoding,
    )
    mixed = ["--enable-mixed-chunk", "--chunked-prefill-size", 32]
    outputs, counters = outputs_and_counters(
        dynamic_args(tiny_models, BUFFER, extra=mixed),
        dynamic_dir / "server.log",
        {**scheduler_env, DUMP_DIR_ENV: str(dynamic_dir)},
        workload=join_while_decoding,
    )

    assert outputs == reference_outputs
    # The path this test names: catch-ups before mixed prefill+decode steps.
    assert counters.steps_plain > 0 and counters.catch_ups["mixed"] >= 1, counters
    reference_kv, kv = dumps_by_tokens(reference_dir), dumps_by_tokens(dynamic_dir)
    assert set(kv) == set(reference_kv)
    for tokens, record in kv.items():
        positions = record["k"].shape[1]
        bad = kv_mismatches(record, reference_kv[tokens])
        assert all(p >= positions - BUFFER for p in bad), (positions, bad, counters.catch_ups)


def counting_run(tiny_models, tmp_path, env, buffer):
    args = dynamic_args(tiny_models, buffer, "count", steps=1, draft_tokens=2)
    outputs, counters = outputs_and_counters(
        args, tmp_path / "server.log", env, workload=lambda url: run_waves(url, COUNT_WAVES, batched=True)
    )
    assert counters.switches_to_plain >= 1 and counters.switches_to_spec >= 1, counters
    prompts = {r.rid: r.input_ids for wave in COUNT_WAVES for r in wave}
    for rid, ids in outputs.items():
        start = prompts[rid][-1]
        assert ids == [(start + 1 + i) % 512 for i in range(len(ids))], rid  # what the target alone emits
    return counters


@pytest.mark.parametrize("scheduler_env", [CI_ENV, OVERLAP_CI_ENV], ids=["sync", "overlap"])
def test_first_step_after_resume_accepts_as_many_as_steady_state(tiny_models, tmp_path, scheduler_env):
    counters = counting_run(tiny_models, tmp_path, scheduler_env, BUFFER)
    assert counters.resume_requests >= 1, counters
    # Steady state of the counting pair with one draft step: 2 tokens per step.
    assert counters.resume_accept_length == 2.0, counters


def test_first_step_after_resume_without_catch_up_accepts_less(tiny_models, tmp_path):
    """Negative control: the stale draft state proposes the wrong token."""
    counters = counting_run(tiny_models, tmp_path, CI_ENV, 0)
    assert counters.resume_requests >= 1, counters
    assert counters.resume_accept_length < 2.0, counters
