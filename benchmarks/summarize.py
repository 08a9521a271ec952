"""Print the Markdown tables of BENCHMARKS.md from a sweep results file.

    python benchmarks/summarize.py benchmarks/results/h200-20261129.jsonl [--where KEY=VALUE ...]

``--where plugin_commit=2eab7dc`` keeps the rows of one measurement (the file holds
several); ``KEY=none`` matches rows without the key. ``--dynamic dynamic-splitkv`` puts that
configuration in the dynamic column (default ``dynamic``).

For each concurrency: mean output tok/s of each configuration with its spread over
repeats (min-max), the ratios to the baseline, and dynamic / max(baseline, EAGLE-3),
all from the same run. Then latency percentiles (median over repeats). Then, for every other
configuration (the off-state runs: ``dynamic-t384``, ``dynamic-plain``, or ``dynamic`` without an
EAGLE-3 server), each repeat's output tok/s over the baseline's in the same repeat, their median,
and each repeat's ITL p99 over the baseline's: issue 19's targets. Last, the speculative step
(issue 20): ITL p50 × accepted tokens per step of each point that speculated on every decode step,
over the plain step (the baseline's ITL p50) in the same repeat. And the points where a
request waited for its first token at least half as long as a request takes in all
(``ttft_max_ms``, recorded since 4bcd007): a server that left a request queued for a whole
wave (a C=128 baseline of 2026-12-07) looks slower than its steps are.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict


def matches(record, where):
    return all(str(record.get(key, "none")) == value for key, value in where)


def load(path, where=()):
    points = defaultdict(list)
    for line in open(path):
        record = json.loads(line)
        if record.get("kind") == "sweep_point" and matches(record, where):
            points[(record["config"], record["concurrency"])].append(record)
    return points


def mean(rows, key):
    return statistics.mean(r[key] for r in rows)


def spread(rows, key):
    values = [r[key] for r in rows]
    return f"{min(values):,.0f}–{max(values):,.0f}"


def main(path, where=(), dynamic="dynamic"):
    configs = ("baseline", "eagle3", dynamic)
    points = load(path, where)
    concurrencies = sorted({c for (_, c) in points})
    print(
        "| C | baseline tok/s | EAGLE-3 tok/s | dynamic tok/s | EAGLE-3 / base | dynamic / base "
        "| dynamic / max(base, EAGLE-3) | dynamic steps in spec mode |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for c in concurrencies:
        b, e, d = (points[(cfg, c)] for cfg in configs)
        if not (b and e and d):
            continue
        best = max(mean(b, "output_tok_s"), mean(e, "output_tok_s"))
        spec = [r.get("spec_step_frac") for r in d]
        spec_text = "/".join("–" if s is None else f"{s:.0%}" for s in spec)
        print(
            f"| {c} | {mean(b, 'output_tok_s'):,.0f} ({spread(b, 'output_tok_s')}) "
            f"| {mean(e, 'output_tok_s'):,.0f} ({spread(e, 'output_tok_s')}) "
            f"| {mean(d, 'output_tok_s'):,.0f} ({spread(d, 'output_tok_s')}) "
            f"| {mean(e, 'output_tok_s') / mean(b, 'output_tok_s'):.2f} "
            f"| {mean(d, 'output_tok_s') / mean(b, 'output_tok_s'):.2f} "
            f"| {mean(d, 'output_tok_s') / best:.3f} | {spec_text} |"
        )
    print()
    print("| C | ITL p50 ms (base / EAGLE-3 / dynamic) | ITL p99 ms | TTFT p50 ms | per-request tok/s |")
    print("|---|---|---|---|---|")
    for c in concurrencies:
        if not all(points[(cfg, c)] for cfg in configs):
            continue
        cells = []
        for key, fmt in (
            ("itl_p50_ms", ".1f"),
            ("itl_p99_ms", ".1f"),
            ("ttft_p50_ms", ".0f"),
            ("per_request_tok_s", ".0f"),
        ):
            cells.append(
                " / ".join(
                    format(statistics.median(r[key] for r in points[(cfg, c)]), fmt) for cfg in configs
                )
            )
        print(f"| {c} | " + " | ".join(cells) + " |")
    print_against_baseline(points, concurrencies)
    print_step_cost(points, concurrencies)
    print_late_first_tokens(points, concurrencies)


def speculative_step_ms(record):
    """ITL p50 × accepted tokens per step: one speculative step's time, for a point that
    speculated on every decode step (stock EAGLE-3's, or a dynamic server's with all of its
    steps speculative); None for a point that ran plain steps or reports no acceptance."""
    if record.get("accept_length") is None or record.get("spec_step_frac") not in (None, 1.0):
        return None
    return record["itl_p50_ms"] * record["accept_length"]


def print_step_cost(points, concurrencies):
    rows = []
    for cfg in sorted({cfg for (cfg, _) in points} - {"baseline"}):
        for c in concurrencies:
            pairs = [
                (step, b["itl_p50_ms"])
                for r, b in paired_with_baseline(points, cfg, c)
                if (step := speculative_step_ms(r)) is not None
            ]
            if pairs:
                rows.append(
                    f"| {cfg} | {c} | {', '.join(f'{step:.2f}' for step, _ in pairs)} "
                    f"| {', '.join(f'{plain:.2f}' for _, plain in pairs)} "
                    f"| {', '.join(f'{step / plain:.2f}' for step, plain in pairs)} |"
                )
    if rows:
        print()
        print("| config | C | speculative step ms, per repeat | plain step ms (baseline ITL p50) | ratio |")
        print("|---|---|---|---|---|")
        print("\n".join(rows))


def late_first_token(record):
    """The longest wait for a first token over a request's whole time (output_len over the
    mean per-request tok/s), when it is at least half of it; None otherwise or unrecorded.
    A request the server left queued for a wave of same-length requests waits about one
    request's time; the slowest 1% of first tokens at C=128 waited about a quarter of it
    (the baseline's TTFT p99 over output_len / per-request tok/s, 2026-12-07)."""
    ttft_max, rate = record.get("ttft_max_ms"), record.get("per_request_tok_s")
    if ttft_max is None or not rate or not record.get("output_len"):
        return None
    share = ttft_max / (1000.0 * record["output_len"] / rate)
    return share if share >= 0.5 else None


def print_late_first_tokens(points, concurrencies):
    rows = [
        f"| {cfg} | {c} | {r['repeat']} | {r['ttft_max_ms']:,.0f} | {r['ttft_p99_ms']:,.0f} | {share:.2f} |"
        for (cfg, c), records in sorted(points.items())
        for r in sorted(records, key=lambda r: r["repeat"])
        if (share := late_first_token(r)) is not None
    ]
    if rows:
        print()
        print("| config | C | repeat | TTFT max ms | TTFT p99 ms | TTFT max ÷ a request's time |")
        print("|---|---|---|---|---|---|")
        print("\n".join(rows))


def paired_with_baseline(points, cfg, concurrency):
    """Each repeat of ``cfg`` at ``concurrency`` with the baseline's repeat of the same index
    (run in the same call), for the repeats both have."""
    base = {r["repeat"]: r for r in points[("baseline", concurrency)]}
    return [(r, base[r["repeat"]]) for r in points[(cfg, concurrency)] if r["repeat"] in base]


def print_against_baseline(points, concurrencies):
    """Per repeat, paired with the baseline's repeat of the same index (run in the same call)."""
    others = sorted({cfg for (cfg, _) in points} - {"baseline", "eagle3"})
    rows = []
    for cfg in others:
        for c in concurrencies:
            pairs = paired_with_baseline(points, cfg, c)
            if not pairs:
                continue
            ratios = [r["output_tok_s"] / b["output_tok_s"] for r, b in pairs]
            p99 = [r["itl_p99_ms"] / b["itl_p99_ms"] for r, b in pairs]
            spec = [r.get("spec_step_frac") for r, _ in pairs]
            rows.append(
                f"| {cfg} | {c} | {', '.join(f'{x:.3f}' for x in ratios)} | **{statistics.median(ratios):.3f}** "
                f"| {', '.join(f'{x:.2f}' for x in p99)} "
                f"| {'/'.join('–' if x is None else f'{x:.0%}' for x in spec)} |"
            )
    if rows:
        print()
        print("| config | C | ÷ baseline, per repeat | median | ITL p99 ÷ baseline's | steps in spec mode |")
        print("|---|---|---|---|---|---|")
        print("\n".join(rows))


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results")
    parser.add_argument("--where", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--dynamic", default="dynamic", help="the configuration in the dynamic column")
    args = parser.parse_args()
    main(args.results, [tuple(w.split("=", 1)) for w in args.where], args.dynamic)
