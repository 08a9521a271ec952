"""benchmarks/profiles/summarize_trace.py on a small synthetic torch-profiler trace: the
per-annotation spans, kernel times and periods, and the kernels inside each annotation
kind, which the speculative-step profiles (issue 20) read phase by phase."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "profiles" / "summarize_trace.py"


def load_script():
    spec = importlib.util.spec_from_file_location("summarize_trace", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def annotation(name, ts, dur):
    return {"cat": "gpu_user_annotation", "name": name, "ts": ts, "dur": dur}


def kernel(name, ts, dur):
    return {"cat": "kernel", "name": name, "ts": ts, "dur": dur}


def two_steps(period_us: float) -> list[dict]:
    """Two speculative steps, each a draft (2 kernels), a verify (a GEMM and an attention
    kernel) and a draft extend (one kernel), plus one kernel outside every annotation."""
    events = []
    for step in range(2):
        t = step * period_us
        events += [
            annotation("draft", t, 1000),
            kernel("draft_gemm", t + 100, 300),
            kernel("draft_norm", t + 500, 100),
            annotation("step[TARGET_VERIFY bs=64]", t + 1000, 5000),
            kernel("nvjet_gemm", t + 1100, 3000),
            kernel("_verify_prefix_stage1", t + 4200, 1000),
            annotation("draft_extend", t + 6000, 1000),
            kernel("_fwd_kernel", t + 6100, 800),
        ]
    events.append(kernel("stray_copy", 2 * period_us + 10, 50))
    return events


def test_summary_reads_each_phase_and_the_kernels_inside_it(tmp_path):
    trace = tmp_path / "trace.json.gz"
    with gzip.open(trace, "wt") as f:
        json.dump({"traceEvents": two_steps(period_us=10_000)}, f)

    text = load_script().summarize(str(trace))

    assert "| `step[TARGET_VERIFY` | 2 | 5.00 | 4.00 | 10.00 |" in text
    assert "| `draft` | 2 | 1.00 | 0.40 | 10.00 |" in text
    assert "| `draft_extend` | 2 | 1.00 | 0.80 | 10.00 |" in text
    assert "kernel time outside every step annotation: 0.05 ms in 1 kernels" in text
    verify = text.split("Inside `step[TARGET_VERIFY`, mean ms per annotation (2):")[1].split("Inside")[0]
    assert verify.index("3.000 ms `nvjet_gemm`") < verify.index("1.000 ms `_verify_prefix_stage1`")
    assert "_fwd_kernel" not in verify  # the draft extend's kernel stays in its own phase
    draft = text.split("Inside `draft`, mean ms per annotation (2):")[1].split("Inside")[0]
    assert "0.300 ms `draft_gemm`" in draft and "0.100 ms `draft_norm`" in draft
    assert "0.800 ms `_fwd_kernel`" in text.split("Inside `draft_extend`")[1]


def test_step_periods_name_what_the_slow_steps_hold():
    """Nine plain decode steps 10 ms apart and one 30 ms period that holds a prefill:
    the median stays 10 ms, the time above it is the prefill's period, and the longest
    period's row names the prefill, its kernel time and the GPU's idle time."""
    events, t = [], 0
    for step in range(11):
        events += [annotation("step[DECODE bs=128]", t, 8000), kernel("decode_gemm", t + 500, 7000)]
        if step == 4:
            events += [
                annotation("step[EXTEND bs=8]", t + 9000, 15000),
                kernel("extend_gemm", t + 9500, 14000),
            ]
            t += 30_000
        else:
            t += 10_000

    lines = load_script().step_periods(events, top=2)
    text = "\n".join(lines)

    assert "Decode-step periods (10): median 10.00 ms, mean 12.00, p90 30.00, p99 30.00, max 30.00" in text
    assert "time above the median 20.0 ms (16.7% of the steps' time), 1 periods over twice the median" in text
    longest = lines[lines.index("|---|---|---|---|---|") + 1]
    assert longest == "| 30.00 | 40.0 | `step[EXTEND` x1 | 21.00 | 9.00 |", longest
    # The next row is the first ordinary step: no annotation inside, 7 ms of kernels, 3 ms idle.
    assert lines[lines.index("|---|---|---|---|---|") + 2] == "| 10.00 | 0.0 | - | 7.00 | 3.00 |"


def test_extend_per_token_keeps_the_draft_pass_apart():
    """A target prefill of 512 tokens (5 ms of kernels) and the draft's pass over the same
    prompts inside a ``draft_extend`` span (0.2 ms): the target's row reads 9.77 µs per
    token, the draft's 0.39, and a decode step counts in neither."""
    events = [
        annotation("step[EXTEND bs=2 toks=512]", 0, 6000),
        kernel("extend_gemm", 100, 5000),
        annotation("draft_extend", 6000, 400),
        annotation("step[EXTEND bs=2 toks=512]", 6050, 300),
        kernel("draft_gemm", 6100, 200),
        annotation("step[DECODE bs=2]", 7000, 1000),
        kernel("decode_gemm", 7100, 800),
    ]

    text = "\n".join(load_script().extend_per_token(events))

    assert "| target | 1 | 512 | 5.00 | 9.77 |" in text
    assert "| draft | 1 | 512 | 0.20 | 0.39 |" in text
