"""``benchmarks/summarize.py``: the tables BENCHMARKS.md is written from, on a results file
built here with known values (issue 20's speculative step: ITL p50 × accepted tokens over the
baseline's ITL p50, only for points that speculated on every decode step)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "summarize.py"


@pytest.fixture(scope="module")
def summarize():
    spec = importlib.util.spec_from_file_location("summarize", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def point(config, concurrency, repeat, tok_s, itl_p50, accept=None, spec_frac=None):
    return {
        "kind": "sweep_point",
        "config": config,
        "concurrency": concurrency,
        "repeat": repeat,
        "output_tok_s": tok_s,
        "per_request_tok_s": tok_s / concurrency,
        "itl_p50_ms": itl_p50,
        "itl_p99_ms": 2 * itl_p50,
        "ttft_p50_ms": 20.0,
        "accept_length": accept,
        "spec_step_frac": spec_frac,
    }


def step_rows(text):
    table = text.split("| config | C | speculative step ms")[1]
    return [line for line in table.splitlines() if line.startswith("| ") and "---" not in line]


def test_the_speculative_step_is_itl_times_acceptance_over_the_plain_step(tmp_path, summarize, capsys):
    rows = [
        point("baseline", 64, 0, 9000, 6.5),
        point("baseline", 64, 1, 9100, 6.4),
        point("eagle3", 64, 0, 7000, 8.4, accept=3.0),
        point("eagle3", 64, 1, 7100, 8.0, accept=3.0),
        point("dynamic", 64, 0, 12000, 4.4, accept=3.0, spec_frac=1.0),
        point("dynamic", 64, 1, 12100, 4.3, accept=3.0, spec_frac=1.0),
        # Plain for some steps: its ITL mixes both modes, so it is no speculative step.
        point("baseline", 128, 0, 14000, 9.0),
        point("eagle3", 128, 0, 9000, 15.0, accept=3.0),
        point("dynamic", 128, 0, 14100, 9.1, accept=3.0, spec_frac=0.25),
    ]
    results = tmp_path / "row.jsonl"
    results.write_text("".join(json.dumps(r) + "\n" for r in rows))
    summarize.main(str(results))
    steps = step_rows(capsys.readouterr().out)
    assert steps == [
        "| dynamic | 64 | 13.20, 12.90 | 6.50, 6.40 | 2.03, 2.02 |",
        "| eagle3 | 64 | 25.20, 24.00 | 6.50, 6.40 | 3.88, 3.75 |",
        "| eagle3 | 128 | 45.00 | 9.00 | 5.00 |",
    ]


def test_points_without_acceptance_or_with_plain_steps_have_no_step(summarize):
    assert summarize.speculative_step_ms(point("baseline", 1, 0, 100, 5.0)) is None
    assert summarize.speculative_step_ms(point("dynamic", 1, 0, 100, 5.0, accept=2.0, spec_frac=0.99)) is None
    assert summarize.speculative_step_ms(point("dynamic", 1, 0, 100, 5.0, accept=2.0, spec_frac=1.0)) == 10.0


def test_a_first_token_that_waited_half_a_request_is_listed(tmp_path, summarize, capsys):
    # 256 tokens at 100 tok/s per request: 2.56 s a request.
    late = {**point("baseline", 128, 1, 8000, 10.0), "per_request_tok_s": 100.0, "output_len": 256}
    queued = {**late, "ttft_p99_ms": 750.0, "ttft_max_ms": 2400.0}  # waited a whole wave
    busy = {**late, "repeat": 0, "ttft_p99_ms": 750.0, "ttft_max_ms": 800.0}  # a prefill queue
    old = point("dynamic", 128, 0, 9000, 10.0)  # written before ttft_max_ms existed
    assert summarize.late_first_token(queued) == pytest.approx(2400 / 2560)
    assert summarize.late_first_token(busy) is None and summarize.late_first_token(old) is None
    results = tmp_path / "row.jsonl"
    results.write_text("".join(json.dumps(r) + "\n" for r in (busy, queued, old)))
    summarize.main(str(results))
    table = capsys.readouterr().out.split("| config | C | repeat | TTFT max ms")[1]
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    assert rows == ["| baseline | 128 | 1 | 2,400 | 750 | 0.94 |"]
