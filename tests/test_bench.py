"""Tests of the benchmark tool (``sglang_dynspec.bench``).

Pure statistics are tested with hand-made inputs; ``sweep`` and ``ramp`` run
end to end through the CLI against the in-process fake SGLang server, whose
decode step time, tokens per step and switch stalls are known, so the
measured numbers can be checked against them.  Everything is light: a few
seconds of 10 ms steps on 127.0.0.1, no real SGLang.
"""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynspec_testbed.fake_server import FakeServerThread, FakeSGLang
from sglang_dynspec import metric_names
from sglang_dynspec.bench import client, fmt, records, scrape, stats
from sglang_dynspec.bench.__main__ import main
from sglang_dynspec.bench.records import (
    RAMP_SAMPLE_KEYS,
    RAMP_SUMMARY_KEYS,
    RAMP_SWITCH_KEYS,
    SWEEP_POINT_KEYS,
    read_jsonl,
)
from sglang_dynspec.bench.scrape import (
    CATCH_UP_SECONDS,
    CATCH_UP_TOKENS,
    CATCH_UPS,
    MODE,
    RESUME_ACCEPTED,
    RESUME_REQUESTS,
    RUNNING,
    STEPS,
)
from sglang_dynspec.bench.stats import ObservedSwitch, RequestTrace

STEP_S = 0.01  # fake decode step


def missing_keys(record: dict, keys) -> list[str]:
    return [k for k in keys if k not in record]


def approx_rel(expected, rel):
    return pytest.approx(expected, rel=rel)


# ---------------------------------------------------------------------------
# percentiles
# ---------------------------------------------------------------------------


def test_percentile_known_values():
    xs = [4.0, 1.0, 3.0, 2.0]
    assert stats.percentile(xs, 0) == 1.0
    assert stats.percentile(xs, 100) == 4.0
    assert stats.percentile(xs, 50) == 2.5
    # rank (n-1)*q = 3*0.99 = 2.97 -> 3 + 0.97*(4-3)
    assert stats.percentile(xs, 99) == pytest.approx(3.97)
    assert stats.percentile([7.0], 99) == 7.0
    assert stats.percentile([], 50) is None
    assert stats.median([1, 2, 100]) == 2
    with pytest.raises(ValueError):
        stats.percentile(xs, 101)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=1, max_size=50),
    st.floats(0, 100),
)
def test_percentile_matches_numpy(xs, q):
    import numpy as np

    assert stats.percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), abs=1e-6, rel=1e-9)


# ---------------------------------------------------------------------------
# ITL of multi-token chunks (bench_serving convention)
# ---------------------------------------------------------------------------


def test_itl_splits_multi_token_chunks_evenly():
    tr = RequestTrace(start=0.0)
    # completion_tokens as SGLang streams them (cumulative)
    assert stats.add_chunk(tr, 0.050, 1) == 1  # first token: TTFT only
    assert stats.add_chunk(tr, 0.080, 4) == 3  # 3 tokens after 30 ms
    assert stats.add_chunk(tr, 0.080, 4) == 0  # repeated count: ignored
    assert stats.add_chunk(tr, 0.090, 5) == 1  # 1 token after 10 ms
    tr.end = 0.1
    assert tr.ttft == pytest.approx(0.050)
    assert tr.output_tokens == 5
    assert tr.itls() == pytest.approx([0.010, 0.010, 0.010, 0.010])
    assert [g for pair in tr.chunk_gaps() for g in pair] == pytest.approx([0.05, 0.08, 0.08, 0.09])


def test_itl_first_chunk_tokens_do_not_count_and_empty_chunk_keeps_gap():
    tr = RequestTrace(start=0.0)
    stats.add_chunk(tr, 0.1, 2)  # first chunk with 2 tokens -> no ITL
    stats.add_chunk(tr, 0.15, 2)  # no new token: must not reset the gap
    stats.add_chunk(tr, 0.2, 6)  # 4 tokens after 100 ms
    assert tr.itls() == pytest.approx([0.025] * 4)


def test_summarize_point_from_known_traces():
    a = RequestTrace(start=0.0, chunks=[(0.1, 1), (0.2, 2), (0.3, 1)], end=0.3, accept_length=2.0)
    b = RequestTrace(start=0.1, chunks=[(0.3, 1), (0.5, 1)], end=0.6, accept_length=3.0)
    failed = RequestTrace(start=0.0, error="boom")
    s = stats.summarize_point([a, b, failed], wall_s=0.6)
    assert s["num_requests"] == 2 and s["num_errors"] == 1
    assert s["output_tokens"] == 6
    assert s["output_tok_s"] == pytest.approx(6 / 0.6)
    # a: 4 tokens / 0.3 s, b: 2 tokens / 0.5 s
    assert s["per_request_tok_s"] == pytest.approx((4 / 0.3 + 2 / 0.5) / 2)
    assert s["ttft_p50_ms"] == pytest.approx(150.0)  # ttfts 100 ms and 200 ms
    assert s["ttft_max_ms"] == pytest.approx(200.0)
    # ITLs: a -> 50, 50, 100 ms; b -> 200 ms
    assert s["itl_p50_ms"] == pytest.approx(75.0)
    assert s["itl_mean_ms"] == pytest.approx(100.0)
    assert s["accept_length"] == pytest.approx(2.5)


def test_summarize_point_without_spec_gives_null_accept_length():
    a = RequestTrace(start=0.0, chunks=[(0.1, 1), (0.2, 1)], end=0.2)
    assert stats.summarize_point([a], 0.2)["accept_length"] is None


# ---------------------------------------------------------------------------
# switches and gaps near them
# ---------------------------------------------------------------------------


def _sample(t, plain, spec, mode=None):
    return {"t": t, "switches_to_plain": plain, "switches_to_spec": spec, "mode": mode}


def test_detect_switches_from_counters():
    samples = [
        _sample(0.0, 0, 0),
        _sample(0.25, 0, 0),
        _sample(0.5, 1, 0),  # to plain between 0.25 and 0.5
        _sample(0.75, 1, 0),
        _sample(1.0, 2, 1),  # flapped: to spec and to plain within one poll
        _sample(1.25, 0, 0),  # counters went backwards: restart, no switch
        _sample(1.5, 0, 2),  # two switches to spec
    ]
    sw = stats.detect_switches(samples)
    assert [(s.t_lo, s.t_hi, s.to, s.count) for s in sw] == [
        (0.25, 0.5, "plain", 1),
        (0.75, 1.0, "plain", 1),
        (0.75, 1.0, "spec", 1),
        (1.25, 1.5, "spec", 2),
    ]


def test_detect_switches_falls_back_to_mode_gauge():
    samples = [
        {"t": 0.0, "mode": 1},
        {"t": 0.1, "mode": 1},
        {"t": 0.2, "mode": 0},
        {"t": 0.3, "mode": None},  # failed scrape: no information
        {"t": 0.4, "mode": 1},
    ]
    sw = stats.detect_switches(samples)
    assert [(s.t_hi, s.to) for s in sw] == [(0.2, "plain")]
    assert stats.detect_switches([{"t": 0.0, "mode": None}, {"t": 1.0, "mode": None}]) == []


def _steady(start, end, step, stall_at=None, stall=0.0):
    """Trace with a chunk every ``step`` s, one chunk delayed by ``stall``."""
    tr = RequestTrace(start=start - step)
    t, n = start, 0
    while t <= end:
        n += 1
        stats.add_chunk(tr, t, n)
        t += step
        if stall_at is not None and t - step < stall_at <= t:
            t += stall
    tr.end = t
    return tr


def test_gap_near_switch_found_and_ratio():
    step = 0.010
    stalled = [_steady(0.0, 3.0, step, stall_at=1.5, stall=0.090) for _ in range(3)]
    analysis = stats.analyze_switch(
        stalled,
        ObservedSwitch(1.45, 1.55, "plain"),
        pad_s=0.05,
        local_window_s=1.0,
        global_median_step_s=stats.median_step(stalled),
    )
    assert analysis["max_gap_ms_near_switch"] == pytest.approx(100.0, rel=1e-6)
    assert analysis["local_median_step_ms"] == pytest.approx(10.0, rel=1e-6)
    assert analysis["gap_ratio"] == pytest.approx(10.0, rel=1e-6)

    # the stall is not "near" a switch 1 s away
    far = stats.analyze_switch(
        stalled,
        ObservedSwitch(2.5, 2.6, "spec"),
        pad_s=0.05,
        local_window_s=1.0,
        global_median_step_s=0.01,
    )
    assert far["max_gap_ms_near_switch"] == pytest.approx(10.0, rel=1e-6)
    assert far["gap_ratio"] == pytest.approx(1.0, rel=1e-6)


def test_gaps_overlapping_uses_interval_overlap():
    tr = RequestTrace(start=0.0, chunks=[(1.0, 1), (2.0, 1), (2.1, 1)], end=2.1)
    assert stats.gaps_overlapping([tr], 1.5, 1.6) == pytest.approx([1.0])
    assert stats.gaps_overlapping([tr], 2.05, 3.0) == pytest.approx([0.1])
    assert stats.gaps_overlapping([tr], 3.0, 4.0) == []


# ---------------------------------------------------------------------------
# /metrics parsing
# ---------------------------------------------------------------------------


def test_parse_metrics_sums_over_ranks_and_keeps_mode_labels():
    fake = FakeSGLang(tp_ranks=2)
    fake._c_steps.labels(model_name="fake", tp_rank="0", mode="spec").inc(5)
    fake._c_steps.labels(model_name="fake", tp_rank="1", mode="spec").inc(5)
    fake._c_switch.labels(model_name="fake", tp_rank="0", to="plain").inc(1)
    fake._c_switch.labels(model_name="fake", tp_rank="1", to="plain").inc(1)
    snap = scrape.parse_metrics(fake.metrics_text())
    assert snap.mode == 1  # two ranks at 1: max, not sum
    assert snap.mode_consistent
    assert snap.steps_spec == 10.0 and snap.steps_plain == 0.0
    assert snap.switches_to_plain == 2.0 and snap.switches_to_spec == 0.0
    assert snap.num_running_reqs == 0.0


def test_fake_server_exports_the_plugins_names_and_help_texts():
    text = FakeSGLang(tp_ranks=1).metrics_text()
    names = metric_names
    for series, name in (
        (names.MODE_GAUGE, names.MODE_GAUGE),
        (names.total(names.STEPS_COUNTER), names.STEPS_COUNTER),
        (names.total(names.SWITCHES_COUNTER), names.SWITCHES_COUNTER),
    ):
        assert f"# HELP {series} {names.HELP[name]}" in text
    no_plugin = FakeSGLang(plugin_metrics=False).metrics_text()
    assert RUNNING in no_plugin and "spec_dynamic" not in no_plugin


def test_fmt_helpers():
    assert fmt.ms(None) is None and fmt.ms(0.25) == 250.0
    assert fmt.fmt(None) == "n/a" and fmt.fmt(1.234) == "1.23" and fmt.fmt(12.34, ".1f") == "12.3"


def test_parse_metrics_handwritten_text():
    text = f"""\
# TYPE {MODE} gauge
{MODE}{{model_name="m",tp_rank="0"}} 0.0
{MODE}{{model_name="m",tp_rank="1"}} 1.0
# TYPE {STEPS} counter
{STEPS}{{mode="plain",tp_rank="0"}} 7
{STEPS}{{mode="spec",tp_rank="0"}} 3
# TYPE {RUNNING} gauge
{RUNNING}{{model_name="m",engine_type="unified"}} 12
{RUNNING}{{model_name="m",engine_type="other"}} 4
# TYPE sglang:unrelated gauge
sglang:unrelated 99
"""
    snap = scrape.parse_metrics(text)
    assert snap.mode == 1 and not snap.mode_consistent
    assert (snap.steps_spec, snap.steps_plain) == (3.0, 7.0)
    assert snap.switches_to_plain == 0.0  # plugin present, counter untouched
    assert snap.num_running_reqs == 16.0


def test_parse_metrics_reads_catch_up_and_resume_series():
    text = f"""\
# TYPE {MODE} gauge
{MODE}{{model_name="m"}} 1.0
# TYPE {CATCH_UPS} counter
{CATCH_UPS}{{model_name="m",reason="resume"}} 2
{CATCH_UPS}{{model_name="m",reason="buffer_full"}} 5
# TYPE {CATCH_UP_TOKENS} counter
{CATCH_UP_TOKENS}{{model_name="m"}} 700
# TYPE {CATCH_UP_SECONDS} histogram
{CATCH_UP_SECONDS}_bucket{{le="+Inf",model_name="m"}} 7
{CATCH_UP_SECONDS}_count{{model_name="m"}} 7
{CATCH_UP_SECONDS}_sum{{model_name="m"}} 0.035
# TYPE {RESUME_ACCEPTED} counter
{RESUME_ACCEPTED}{{model_name="m"}} 9
# TYPE {RESUME_REQUESTS} counter
{RESUME_REQUESTS}{{model_name="m"}} 3
"""
    snap = scrape.parse_metrics(text)
    assert snap.catch_ups == {"resume": 2.0, "buffer_full": 5.0}
    assert (snap.catch_up_tokens, snap.catch_up_timed) == (700.0, 7.0)
    assert abs(snap.catch_up_seconds_sum - 0.035) < 1e-12
    assert snap.resume_accept_length == 3.0
    assert scrape.parse_metrics(f'{MODE}{{model_name="m"}} 1.0\n').resume_accept_length is None


def test_parse_metrics_without_plugin():
    snap = scrape.parse_metrics(f'{RUNNING}{{tp_rank="0"}} 3\n')
    assert snap.mode is None and snap.steps_spec is None and snap.switches_to_spec is None
    assert not snap.has_plugin_metrics
    assert snap.num_running_reqs == 3.0


# ---------------------------------------------------------------------------
# small helpers
# ---------------------------------------------------------------------------


def test_parse_tags():
    assert records.parse_tags(["hw=H200", "note=a=b"]) == {"hw": "H200", "note": "a=b"}
    with pytest.raises(ValueError):
        records.parse_tags(["novalue"])
    with pytest.raises(ValueError):
        records.parse_tags(["output_tok_s=1"])  # would overwrite a measurement


def test_normalize_base_url():
    assert client.normalize_base_url("http://h:30000/") == "http://h:30000"
    assert client.normalize_base_url("http://h:30000/generate") == "http://h:30000"
    with pytest.raises(ValueError):
        client.normalize_base_url("h:30000")


def test_payloads_are_reproducible_and_distinct_per_seed():
    a = client.make_payloads(3, 16, 8, False, (1000, 2000), "0/c4/r0")
    b = client.make_payloads(3, 16, 8, False, (1000, 2000), "0/c4/r0")
    c = client.make_payloads(3, 16, 8, False, (1000, 2000), "0/c4/r1")
    assert a == b and a != c
    p = a[0]
    assert len(p["input_ids"]) == 16 and all(1000 <= i < 2000 for i in p["input_ids"])
    assert p["sampling_params"] == {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
    assert p["stream"] is True
    t = client.make_payloads(1, 16, 8, True, (1000, 2000), "x")[0]
    assert isinstance(t["text"], str) and len(t["text"].split()) == 16


def test_first_tokens_never_repeat_within_a_run_and_follow_the_seed():
    span = (1000, 1010)
    run = client.FirstTokens("0", span)
    taken = [run.take() for _ in range(25)]
    assert all(1000 <= t < 1010 for t in taken)
    assert len(set(taken[:10])) == 10  # a whole span before any repeat
    assert taken[10:20] == taken[:10]  # then the same cycle
    again = client.FirstTokens("0", span)
    assert [again.take() for _ in range(25)] == taken
    others = {tuple(client.FirstTokens(str(s), span).take() for _ in range(3)) for s in range(20)}
    assert len(others) > 1  # the offset follows the seed


def test_first_tokens_change_only_the_first_token():
    plain = client.make_payloads(40, 16, 8, False, (1000, 32000), "0/c4/r0")
    first = client.FirstTokens("0", (1000, 32000))
    fixed = client.make_payloads(40, 16, 8, False, (1000, 32000), "0/c4/r0", first)
    assert [p["input_ids"][1:] for p in fixed] == [p["input_ids"][1:] for p in plain]
    same_run = client.FirstTokens("0", (1000, 32000))
    assert [p["input_ids"][0] for p in fixed] == [same_run.take() for _ in range(40)]
    text = client.make_payloads(2, 16, 8, True, (1000, 32000), "x", client.FirstTokens("0", (1000, 32000)))
    assert text == client.make_payloads(2, 16, 8, True, (1000, 32000), "x")


def test_sweep_prompts_never_share_a_first_token(tmp_path):
    # SGLang's radix cache matches a baseline server's prompts on one token (EAGLE
    # servers on token pairs): a shared first token would be cached prefill for the
    # baseline only (client.FirstTokens). Warmup and every point of a run included.
    def run(out):
        fake = FakeSGLang(step_s=0.002, spec_tokens=1, keep_prompts=True)
        with FakeServerThread(fake) as url:
            args = ("--concurrency", "4,8", "--warmup", "2", "--repeats", "2", "--token-range", "1000:1100")
            assert _sweep(url, out, *args) == 0
        return fake.prompts

    prompts = run(tmp_path / "a.jsonl")
    heads = [p[0] for p in prompts]
    assert len(prompts) == 2 + 2 * (8 + 16)
    assert len(set(heads)) == len(heads)
    # 50 prompts from 100 ids: without FirstTokens a shared first token is near certain
    # (1 - P(no pair) > 0.99), so this test can fail.
    assert sorted(heads) == sorted(p[0] for p in run(tmp_path / "b.jsonl"))


def test_fake_server_keeps_prompts_only_when_asked(tmp_path):
    fake = FakeSGLang(step_s=0.002, spec_tokens=1)
    with FakeServerThread(fake) as url:
        assert _sweep(url, tmp_path / "r.jsonl", "--concurrency", "2", "--warmup", "0") == 0
    assert fake.num_requests > 0 and fake.prompts == []


def test_jsonl_writer_never_writes_nan(tmp_path):
    path = tmp_path / "r.jsonl"
    with records.JsonlWriter(str(path)) as w:
        w.write({"a": float("nan"), "b": [float("inf"), 1.0]})
    assert list(read_jsonl(str(path))) == [{"a": None, "b": [None, 1.0]}]


# ---------------------------------------------------------------------------
# streaming client against the fake server
# ---------------------------------------------------------------------------


async def _one_request(url, output_len, **kw):
    async with client.create_session(30) as session:
        payload = client.make_payload([1, 2, 3], output_len)
        return await client.stream_generate(session, url + "/generate", payload)


def test_idle_connections_are_dropped_before_sglang_closes_them():
    """A pooled connection idle longer than SGLang's keep-alive is closed by the
    server; reusing one just then fails the request (a sweep ended so). The
    client must drop idle connections first, by a margin."""
    from sglang.srt.environ import envs

    server_keep_alive_s = envs.SGLANG_TIMEOUT_KEEP_ALIVE.get()
    assert client.IDLE_CONNECTION_S <= server_keep_alive_s / 2

    async def connector_keepalive():
        async with client.create_session(30) as session:
            return session.connector._keepalive_timeout

    assert asyncio.run(connector_keepalive()) == client.IDLE_CONNECTION_S


@pytest.mark.parametrize(
    "incremental,skip_tokenizer_init",
    [(False, False), (True, False), (False, True), (True, True)],
)
def test_stream_token_counts_for_every_server_flavour(incremental, skip_tokenizer_init):
    fake = FakeSGLang(
        step_s=0.005, spec_tokens=3, incremental=incremental, skip_tokenizer_init=skip_tokenizer_init
    )
    with FakeServerThread(fake) as url:
        tr = asyncio.run(_one_request(url, 20))
    assert tr.ok, tr.error
    assert tr.output_tokens == 20
    # prefill token, then 3 per step: 1 + 3*6 = 19, last step brings 1
    assert [n for _, n in tr.chunks] == [1, 3, 3, 3, 3, 3, 3, 1]
    assert tr.accept_length == pytest.approx(20 / 7)


def test_stream_error_event_is_a_failed_request():
    fake = FakeSGLang(step_s=0.005, error_every=1)
    with FakeServerThread(fake) as url:
        tr = asyncio.run(_one_request(url, 5))
    assert not tr.ok and "fake failure" in tr.error


# ---------------------------------------------------------------------------
# sweep end to end
# ---------------------------------------------------------------------------


def _sweep(url, out, *extra):
    return main(
        [
            "sweep",
            "--url",
            url,
            "--config",
            "fake",
            "--prompt-len",
            "8",
            "--output-len",
            "41",
            "--out",
            str(out),
            "--no-progress",
            *extra,
        ]
    )


def test_sweep_one_token_per_step_gives_step_itl(tmp_path):
    out = tmp_path / "sweep.jsonl"
    fake = FakeSGLang(step_s=STEP_S, spec_tokens=1)
    with FakeServerThread(fake) as url:
        rc = _sweep(
            url, out, "--concurrency", "2,8", "--warmup", "1", "--repeats", "2", "--tag", "hw=fake-cpu"
        )
    assert rc == 0
    recs = list(read_jsonl(str(out)))
    assert [(r["concurrency"], r["repeat"]) for r in recs] == [(2, 0), (8, 0), (2, 1), (8, 1)]
    for r in recs:
        assert missing_keys(r, SWEEP_POINT_KEYS) == []
        assert r["kind"] == "sweep_point" and r["config"] == "fake"
        assert r["hw"] == "fake-cpu" and r["sglang"] == "0.5.23"
        assert r["num_requests"] == max(2 * r["concurrency"], 4) and r["num_errors"] == 0
        assert r["output_tokens"] == r["num_requests"] * 41
        assert r["output_tok_s"] == pytest.approx(r["output_tokens"] / r["wall_s"])
        # a token every 10 ms
        assert r["itl_p50_ms"] == approx_rel(10.0, 0.25)
        assert r["itl_p99_ms"] >= r["itl_p50_ms"]
        # first token at the next step boundary after arrival (<= 1 step,
        # plus scheduling noise on a loaded machine)
        assert 0 < r["ttft_p50_ms"] < 3 * STEP_S * 1000
        # 41 tokens in ~41 steps
        assert r["per_request_tok_s"] == approx_rel(100.0, 0.25)
        # the fake speculates with one token per step: accept length 41/40
        assert r["accept_length"] == pytest.approx(41 / 40)
        assert r["decode_steps_spec"] > 0 and r["decode_steps_plain"] == 0
        assert r["spec_step_frac"] == 1.0
        assert isinstance(r["date"], str) and r["date"].endswith("Z")
    for c2, c8 in ((recs[0], recs[1]), (recs[2], recs[3])):
        # 8 requests share each step: ~4x the total throughput of 2
        assert c8["output_tok_s"] / c2["output_tok_s"] == approx_rel(4.0, 0.3)


def test_sweep_multi_token_chunks_split_itl(tmp_path):
    out = tmp_path / "sweep.jsonl"
    fake = FakeSGLang(
        step_s=STEP_S, spec_tokens=4, info_path="/get_server_info", version="0.5.17", skip_tokenizer_init=True
    )
    with FakeServerThread(fake) as url:
        assert _sweep(url, out, "--concurrency", "2", "--warmup", "0") == 0
    (r,) = read_jsonl(str(out))
    # 4 tokens per 10 ms chunk -> four ITLs of 2.5 ms each
    assert r["itl_p50_ms"] == approx_rel(2.5, 0.25)
    assert r["output_tokens"] == 4 * 41
    assert r["accept_length"] == pytest.approx(41 / 10)  # 1 + 4*10 tokens, 10 spec steps
    assert r["per_request_tok_s"] == approx_rel(41 / 0.11, 0.25)  # 11 steps
    assert r["sglang"] == "0.5.17"  # via the deprecated /get_server_info


def test_sweep_records_dynamic_mode_per_point(tmp_path):
    out = tmp_path / "sweep.jsonl"
    fake = FakeSGLang(step_s=STEP_S, spec_tokens=3, switch_above=2)
    with FakeServerThread(fake) as url:
        assert _sweep(url, out, "--concurrency", "1,8", "--warmup", "0", "--requests-per-point", "8") == 0
    c1, c8 = read_jsonl(str(out))
    assert c1["spec_step_frac"] == 1.0 and c1["itl_p50_ms"] == approx_rel(10 / 3, 0.3)
    # 8 in flight > 2: the fake stops speculating for most of the point
    assert c8["spec_step_frac"] < 0.5
    assert c8["itl_p50_ms"] == approx_rel(10.0, 0.3)


def test_sweep_without_server_info_and_with_errors(tmp_path):
    out = tmp_path / "sweep.jsonl"
    fake = FakeSGLang(step_s=STEP_S, info_path=None, metrics_endpoint=False, error_every=4)
    with FakeServerThread(fake) as url:
        assert (
            _sweep(
                url,
                out,
                "--concurrency",
                "2",
                "--warmup",
                "0",
                "--text",
                "--requests-per-point",
                "8",
                "--output-len",
                "5",
            )
            == 0
        )
    (r,) = read_jsonl(str(out))
    assert r["prompt_mode"] == "text"
    assert r["sglang"] is None
    assert r["num_errors"] == 2 and r["num_requests"] == 6
    assert r["decode_steps_spec"] is None and r["spec_step_frac"] is None


def test_sweep_all_requests_failing_is_an_error(tmp_path, capsys):
    fake = FakeSGLang(step_s=STEP_S, error_every=1)
    with FakeServerThread(fake) as url:
        rc = _sweep(url, tmp_path / "s.jsonl", "--concurrency", "1", "--warmup", "0")
    assert rc == 2
    err = capsys.readouterr().err
    assert "all 4 requests" in err and "fake failure" in err


def test_unreachable_server_is_one_line_error(tmp_path, capsys):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    rc = _sweep(url, tmp_path / "s.jsonl")
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: cannot reach SGLang server at " + url)
    assert len(err.splitlines()) == 1


# ---------------------------------------------------------------------------
# ramp end to end
# ---------------------------------------------------------------------------


def _ramp(url, out, *extra):
    return main(
        [
            "ramp",
            "--url",
            url,
            "--config",
            "dyn",
            "--prompt-len",
            "8",
            "--output-len",
            "30",
            "--steps",
            "1,6,1",
            "--hold-s",
            "0.6",
            "--poll-s",
            "0.05",
            "--switch-pad-s",
            "0.05",
            "--local-window-s",
            "1.0",
            "--out",
            str(out),
            "--no-progress",
            *extra,
        ]
    )


def _by_kind(path):
    out = {}
    for r in read_jsonl(str(path)):
        out.setdefault(r["kind"], []).append(r)
    return out


def test_ramp_detects_switches_and_stall(tmp_path):
    out = tmp_path / "ramp.jsonl"
    stall = 0.15
    fake = FakeSGLang(step_s=STEP_S, spec_tokens=2, switch_above=3, switch_stall_s=stall)
    with FakeServerThread(fake) as url:
        assert _ramp(url, out, "--tag", "hw=fake", "--requests-out", str(tmp_path / "req.jsonl")) == 0
    recs = _by_kind(out)
    samples, switches, (summary,) = recs["sample"], recs["switch"], recs["ramp_summary"]
    for s in samples:
        assert missing_keys(s, RAMP_SAMPLE_KEYS) == []
        assert s["mode"] in (0, 1)
    for s in switches:
        assert missing_keys(s, RAMP_SWITCH_KEYS) == []
    assert missing_keys(summary, RAMP_SUMMARY_KEYS) == []
    assert summary["hw"] == "fake" and summary["sglang"] == "0.5.23"
    assert len({r["run_id"] for rs in recs.values() for r in rs}) == 1

    # the timeline follows the load: concurrency 6 > 3 -> plain, then back
    assert {s["concurrency"] for s in samples} >= {1, 6}
    assert any(s["mode"] == 0 and s["concurrency"] == 6 for s in samples)
    assert samples[-1]["mode"] == 1
    # (on a loaded machine the fake may flap when a wave of requests ends
    # together, so count rather than expect exactly one switch each way)
    assert switches[0]["to"] == "plain" and switches[-1]["to"] == "spec"
    assert summary["num_switches"] == fake.num_switches >= 2
    assert summary["switches_to_plain"] == summary["switches_to_spec"] == fake.num_switches // 2
    assert summary["decode_steps_plain"] > 0 and summary["decode_steps_spec"] > 0

    # every switch stalls the running requests by 150 ms on top of a 10 ms step
    for s in switches:
        assert s["max_gap_ms_near_switch"] == approx_rel((STEP_S + stall) * 1000, 0.3)
        assert s["median_step_ms"] == approx_rel(10.0, 0.25)
        assert s["gap_ratio"] == approx_rel(16.0, 0.35)
        assert s["t_lo"] <= s["t"]
    assert summary["worst_gap_ratio"] == approx_rel(16.0, 0.35)
    assert summary["median_step_ms"] == approx_rel(10.0, 0.25)
    # spec steps bring 2 tokens each, so per-token ITLs are below the step
    assert 4.0 < summary["median_itl_ms"] < summary["median_step_ms"]

    steps = recs["ramp_step"]
    assert [s["concurrency"] for s in steps] == [1, 6, 1]
    assert steps[1]["output_tok_s"] > steps[0]["output_tok_s"]
    # the step to 6 triggered the switch to plain: its start saw the stall
    assert steps[1]["max_gap_ms_near_start"] == approx_rel((STEP_S + stall) * 1000, 0.3)
    assert summary["worst_step_start_gap_ms"] >= steps[1]["max_gap_ms_near_start"]

    reqs = list(read_jsonl(str(tmp_path / "req.jsonl")))
    assert len(reqs) == summary["num_requests"]
    assert all(sum(n for _, n in r["chunks"]) == 30 for r in reqs)


def test_ramp_seamless_switch_has_small_ratio(tmp_path):
    out = tmp_path / "ramp.jsonl"
    fake = FakeSGLang(step_s=STEP_S, spec_tokens=2, switch_above=3, switch_stall_s=0.0)
    with FakeServerThread(fake) as url:
        assert _ramp(url, out) == 0
    recs = _by_kind(out)
    assert len(recs["switch"]) >= 2
    (summary,) = recs["ramp_summary"]
    # ~1 on an idle machine; scheduling noise of a busy one stays well below
    # the ~16 of the stalled server above
    assert summary["worst_gap_ratio"] < 6.0
    assert summary["worst_step_start_gap_ms"] < 6 * STEP_S * 1000


@pytest.mark.parametrize("plugin_metrics,metrics_endpoint", [(False, True), (False, False)])
def test_ramp_without_plugin_metrics_records_null_mode(tmp_path, plugin_metrics, metrics_endpoint):
    out = tmp_path / "ramp.jsonl"
    fake = FakeSGLang(
        step_s=STEP_S, switch_above=3, plugin_metrics=plugin_metrics, metrics_endpoint=metrics_endpoint
    )
    with FakeServerThread(fake) as url:
        rc = main(
            [
                "ramp",
                "--url",
                url,
                "--config",
                "base",
                "--prompt-len",
                "4",
                "--output-len",
                "10",
                "--steps",
                "1,5",
                "--hold-requests",
                "3",
                "--poll-s",
                "0.05",
                "--out",
                str(out),
                "--no-progress",
            ]
        )
    assert rc == 0
    recs = _by_kind(out)
    assert recs["sample"] and all(s["mode"] is None for s in recs["sample"])
    assert "switch" not in recs
    (summary,) = recs["ramp_summary"]
    assert summary["plugin_metrics"] is False
    assert summary["metrics_endpoint"] is metrics_endpoint
    assert summary["num_switches"] == 0 and summary["worst_gap_ratio"] is None
    assert summary["num_requests"] >= 6 and summary["hold_requests"] == 3
    running = [s["num_running_reqs"] for s in recs["sample"]]
    if metrics_endpoint:
        assert max(running) >= 4
    else:
        assert all(r is None for r in running)


# ---------------------------------------------------------------------------
# plot
# ---------------------------------------------------------------------------


def _write(path, recs):
    with records.JsonlWriter(str(path), overwrite=True) as w:
        for r in recs:
            w.write(r)


def _point(config, c, repeat, tok_s):
    return {
        "kind": "sweep_point",
        "config": config,
        "concurrency": c,
        "repeat": repeat,
        "output_tok_s": tok_s,
        "per_request_tok_s": tok_s / c,
        "prompt_len": 256,
        "output_len": 256,
        "hw": "test",
    }


def test_ratio_to_baseline():
    from sglang_dynspec.bench import plot

    pts = [
        _point("baseline", 1, 0, 100.0),
        _point("baseline", 1, 1, 120.0),
        _point("baseline", 4, 0, 400.0),
        _point("dyn", 1, 0, 220.0),
        _point("dyn", 1, 1, 200.0),
        _point("dyn", 8, 0, 1.0),
    ]
    agg = plot.aggregate(pts, "output_tok_s")
    assert agg["baseline"][1] == (110.0, 100.0, 120.0)
    rat = plot.ratios(agg, "baseline")
    assert set(rat) == {"dyn"} and set(rat["dyn"]) == {1}  # only common concurrencies
    mean, lo, hi = rat["dyn"][1]
    assert mean == pytest.approx(210 / 110)
    assert lo == pytest.approx(200 / 120) and hi == pytest.approx(220 / 100)


def test_plot_writes_pngs(tmp_path):
    import matplotlib  # noqa: F401  (a test dependency: the plot command needs it)

    sweep = tmp_path / "sweep.jsonl"
    pts = []
    for cfg, speed in (("baseline", 1.0), ("dynspec", 1.3)):
        for c in (1, 4, 16, 64):
            for rep in range(2):
                pts.append(_point(cfg, c, rep, speed * c * 50 * (1 + 0.05 * rep)))
    _write(sweep, pts)
    ramp = tmp_path / "ramp.jsonl"
    ramp_recs = [
        {
            "kind": "sample",
            "config": "dynspec",
            "run_id": "r1",
            "t": i * 0.25,
            "mode": 0 if 8 <= i < 16 else 1,
            "num_running_reqs": 40 if 8 <= i < 16 else 2,
            "concurrency": 64 if 8 <= i < 16 else 2,
            "steps_spec": None,
            "steps_plain": None,
            "switches_to_plain": None,
            "switches_to_spec": None,
        }
        for i in range(24)
    ]
    ramp_recs += [
        {
            "kind": "switch",
            "config": "dynspec",
            "run_id": "r1",
            "t": 2.0,
            "to": "plain",
            "max_gap_ms_near_switch": 35.0,
            "median_step_ms": 12.0,
        },
        {
            "kind": "switch",
            "config": "dynspec",
            "run_id": "r1",
            "t": 4.0,
            "to": "spec",
            "max_gap_ms_near_switch": 15.0,
            "median_step_ms": 12.0,
        },
        {
            "kind": "ramp_step",
            "config": "dynspec",
            "run_id": "r1",
            "concurrency": 2,
            "t_start": 0.0,
            "t_end": 2.0,
            "output_tok_s": 300.0,
        },
        {
            "kind": "ramp_summary",
            "config": "dynspec",
            "run_id": "r1",
            "worst_gap_ratio": 2.9,
            "date": "2025-01-01T00:00:00Z",
        },
    ]
    _write(ramp, ramp_recs)
    out_dir = tmp_path / "plots"
    rc = main(["plot", str(sweep), str(ramp), "--out-dir", str(out_dir), "--baseline", "baseline"])
    assert rc == 0
    names = sorted(p.name for p in out_dir.iterdir())
    assert names == ["ramp_dynspec.png", "ratio_vs_baseline.png", "throughput.png"]
    for p in out_dir.iterdir():
        data = p.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_plot_rejects_files_without_records(tmp_path, capsys):
    empty = tmp_path / "e.jsonl"
    empty.write_text("\n")
    assert main(["plot", str(empty), "--out-dir", str(tmp_path / "p")]) == 2
    assert "no sweep or ramp records" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"kind": "sweep_point"}\nnot json\n')
    assert main(["plot", str(bad), "--out-dir", str(tmp_path / "p")]) == 2
    assert "bad.jsonl:2" in capsys.readouterr().err


def test_catch_up_fields_are_the_point_s_deltas():
    from sglang_dynspec.bench.sweep import catch_up_fields

    before = scrape.MetricsSnapshot(
        catch_ups={"buffer_full": 3.0}, catch_up_tokens=300.0, catch_up_seconds_sum=0.010, catch_up_timed=3.0
    )
    after = scrape.MetricsSnapshot(
        catch_ups={"buffer_full": 7.0, "resume": 1.0},
        catch_up_tokens=800.0,
        catch_up_seconds_sum=0.030,
        catch_up_timed=7.0,  # the last catch-up's time not read back yet
    )
    got = catch_up_fields(before, after, wall_s=2.0)
    assert got["catch_ups"] == 5.0 and got["catch_up_positions"] == 500.0
    assert got["catch_up_s"] == pytest.approx(0.020)
    assert got["catch_up_ms_mean"] == pytest.approx(5.0)  # per timed catch-up
    assert got["catch_up_share"] == pytest.approx(0.010)
    assert (
        catch_up_fields(None, after, 2.0) == {}
        and catch_up_fields(scrape.MetricsSnapshot(), scrape.MetricsSnapshot(), 1.0) == {}
    )


def test_sweep_point_size_is_waves_of_the_concurrency_unless_given():
    from sglang_dynspec.bench.sweep import requests_for

    assert [requests_for(c, None) for c in (1, 2, 64)] == [4, 4, 128]
    assert [requests_for(c, None, waves=1) for c in (1, 64)] == [4, 64]
    assert requests_for(64, 10, waves=3) == 10


def test_decision_ratio_is_dynamic_over_the_better_server_per_row():
    from sglang_dynspec.bench.plot import decision_ratios

    def point(cfg, c, tok_s, row="r1"):
        return {"kind": "sweep_point", "config": cfg, "concurrency": c, "output_tok_s": tok_s, "row": row}

    points = [
        *(point("baseline", 1, v) for v in (100, 100)),
        *(point("eagle3", 1, v) for v in (190, 210)),
        *(point("dynamic", 1, v) for v in (180, 200)),
        point("baseline", 64, 800),
        point("eagle3", 64, 500),
        point("dynamic", 64, 776),
        point("baseline", 4, 1, row="r2"),  # a row without all three configurations
    ]
    assert decision_ratios(points) == {"r1": {1: pytest.approx(0.95), 64: pytest.approx(0.97)}}
