"""benchmarks/profiles/decode_log_rates.py on SGLang 0.5.17 log lines: the steady decode rate
per batch size (median and 90th percentile of the logged intervals) against the first log's,
and the prefill forwards, which issue 19's attribution splits the off state's gap with."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "profiles" / "decode_log_rates.py"


def load_script():
    spec = importlib.util.spec_from_file_location("decode_log_rates", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def decode(running: int, rate: float, accept: bool = False) -> str:
    spec = "accept len: 1.00, accept rate: 0.00, " if accept else ""
    return (
        f"[2026-12-08 01:04:16] Decode batch, #running-req: {running}, #token: 1192, token usage: 0.00, "
        f"{spec}cuda graph: True, gen throughput (token/s): {rate:.2f}, #queue-req: 0"
    )


def prefill(seqs: int, tokens: int) -> str:
    return (
        f"[2026-12-08 01:10:27] Prefill batch, #new-seq: {seqs}, #new-token: {tokens}, #cached-token: 0, "
        "token usage: 0.03, #running-req: 1, #queue-req: 0, #pending-token: 0, cuda graph: True"
    )


def test_rates_by_batch_size_and_prefills(tmp_path):
    m = load_script()
    base = [decode(64, r) for r in (8000, 8100, 3000, 8200, 8150)] + [prefill(32, 8192), prefill(10, 2560)]
    base += [decode(128, 12000), decode(127, 500)]
    dyn = [decode(64, r, accept=True) for r in (7900, 8000, 2900, 8100, 8050)] + [prefill(32, 8192)]
    (tmp_path / "server_baseline.log").write_text("\n".join(base))
    (tmp_path / "server_dynamic.log").write_text("\n".join(["noise"] + dyn))
    logs = [m.read_log(p.read_text().splitlines(), p.stem) for p in sorted(tmp_path.iterdir())]
    assert [log.name for log in logs] == ["server_baseline", "server_dynamic"]
    baseline, dynamic = logs
    assert baseline.median(64) == 8100 and dynamic.median(64) == 8000
    assert baseline.median(128) == 12000 and baseline.median(127) == 500 and dynamic.median(128) is None
    assert (baseline.prefill_forwards, baseline.prefill_tokens) == (2, 10752)
    assert (dynamic.prefill_forwards, dynamic.prefill_tokens) == (1, 8192)
    table = m.report(logs, [64, 128])
    # median 8000 / 8100; p90 (the highest of five) 8100 / 8200
    assert "| server_dynamic | 64 | 5 | 8000 | 2900 | 8100 | 0.988 | 0.988 |" in table
    assert "| server_dynamic | 128 | 0 | | | | | |" in table
    assert "| server_baseline | 2 | 10752 |" in table
