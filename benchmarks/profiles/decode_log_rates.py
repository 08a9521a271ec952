"""Steady decode rate against the whole load, from SGLang server logs (issue 19's attribution).

SGLang logs a ``Decode batch`` line every ``--decode-log-interval`` decode steps (40 by default)
with the running batch size and the generated tokens per second over those steps; an
interval that holds a prefill forward (or a buffer-full flush of the catch-up) shows a lower
rate. The median rate over the intervals at one batch size is therefore the steady decode
rate at that size, and a server's throughput over a whole load, divided by the baseline's,
splits into

    whole-load ratio = steady-decode ratio x the rest (prefills, flushes, admission)

so a gap that the steady ratio does not explain lies outside the decode steps.

Usage::

    python benchmarks/profiles/decode_log_rates.py server_baseline.log server_dynamic-plain.log \
        [--batch 64 --batch 128]

Prints, per log and batch size, the intervals counted and their median, 10th and 90th
percentile rates, and each log's median and 90th percentile over the first log's (the 90th
percentile: intervals with neither a prefill nor a flush in them, where those take more than
a tenth of the intervals; the median includes flushes one interval in three when a 128-position
catch-up buffer fills every 128 steps); and the prefill lines per
log (forwards and prompt tokens). Timestamps in these logs have whole seconds only, so they
cannot time the transitions themselves.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

DECODE = re.compile(r"Decode batch, #running-req: (\d+),.*gen throughput \(token/s\): ([0-9.]+)")
PREFILL = re.compile(r"Prefill batch, #new-seq: (\d+), #new-token: (\d+)")


@dataclass
class LogRates:
    """What one server log says about its decode intervals and prefill forwards."""

    name: str
    rates: dict[int, list[float]] = field(default_factory=lambda: defaultdict(list))
    prefill_forwards: int = 0
    prefill_tokens: int = 0

    def median(self, batch: int) -> float | None:
        values = self.rates.get(batch)
        return statistics.median(values) if values else None


def read_log(lines, name: str = "") -> LogRates:
    out = LogRates(name)
    for line in lines:
        if (m := DECODE.search(line)) is not None:
            out.rates[int(m.group(1))].append(float(m.group(2)))
        elif (m := PREFILL.search(line)) is not None:
            out.prefill_forwards += 1
            out.prefill_tokens += int(m.group(2))
    return out


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def report(logs: list[LogRates], batches: list[int]) -> str:
    reference = logs[0]
    rows = [
        "| log | batch | intervals | median tok/s | p10 | p90 | median / first log's | p90 / first log's |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for batch in batches:
        base = reference.median(batch)
        base_p90 = _quantile(reference.rates[batch], 0.9) if reference.rates.get(batch) else None
        for log in logs:
            values = log.rates.get(batch, [])
            if not values:
                rows.append(f"| {log.name} | {batch} | 0 | | | | | |")
                continue
            med, p90 = statistics.median(values), _quantile(values, 0.9)
            ratio = f"{med / base:.3f}" if base else ""
            ratio_p90 = f"{p90 / base_p90:.3f}" if base_p90 else ""
            rows.append(
                f"| {log.name} | {batch} | {len(values)} | {med:.0f} | {_quantile(values, 0.1):.0f} | "
                f"{p90:.0f} | {ratio} | {ratio_p90} |"
            )
    rows += ["", "| log | prefill forwards | prompt tokens |", "|---|---|---|"]
    rows += [f"| {log.name} | {log.prefill_forwards} | {log.prefill_tokens} |" for log in logs]
    return "\n".join(rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "logs", nargs="+", type=Path, help="server logs; the first is the reference (baseline)"
    )
    parser.add_argument("--batch", type=int, action="append", help="running batch sizes (default 64 and 128)")
    args = parser.parse_args(argv)
    logs = [read_log(path.read_text(errors="replace").splitlines(), path.stem) for path in args.logs]
    print(report(logs, args.batch or [64, 128]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
