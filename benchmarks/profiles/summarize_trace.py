"""Summarize a torch-profiler trace of an SGLang server (``/start_profile``, CPU + GPU).

    python benchmarks/profiles/summarize_trace.py TRACE.json.gz [TRACE2.json.gz ...]

Per trace: for each GPU step annotation SGLang writes (``step[DECODE bs=..]``,
``draft_extend`` ...), how many, their mean span on the GPU timeline and the mean
kernel time inside them (span - kernel time = the GPU waiting for the host); the
kernels that take the most time; and the host time of the plugin's own functions
(``sglang_dynspec``) and the SGLang calls it wraps. Host times come from Python
tracing and are inflated by it (several times): compare them with each other, not
with the GPU timeline.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import gzip
import json

HOST_KEYS = ("sglang_dynspec", "dynspec", "_draft_extend_for_prefill", "tp_worker.py", "init_new")


def summarize(path: str, top: int = 8) -> str:
    with gzip.open(path) if path.endswith(".gz") else open(path) as f:
        events = json.load(f)["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    starts = [k["ts"] for k in kernels]
    steps = collections.defaultdict(list)
    for a in (e for e in events if e.get("cat") == "gpu_user_annotation"):
        lo, hi = a["ts"], a["ts"] + a["dur"]
        i, busy = bisect.bisect_left(starts, lo), 0.0
        while i < len(kernels) and kernels[i]["ts"] < hi:
            busy += kernels[i]["dur"]
            i += 1
        steps[a["name"].split(" ")[0]].append((a["dur"], busy))
    lines = [
        f"## {path}",
        "",
        "| GPU annotation | n | mean span (ms) | mean kernel time (ms) |",
        "|---|---|---|---|",
    ]
    for name, values in sorted(steps.items()):
        n = len(values)
        lines.append(
            f"| `{name}` | {n} | {sum(v[0] for v in values) / n / 1e3:.2f} | {sum(v[1] for v in values) / n / 1e3:.2f} |"
        )
    by_kernel = collections.Counter()
    for k in kernels:
        by_kernel[k["name"][:60]] += k["dur"]
    lines += ["", f"Kernels, total {sum(by_kernel.values()) / 1e3:.1f} ms:", ""]
    lines += [f"- {dur / 1e3:.2f} ms `{name}`" for name, dur in by_kernel.most_common(top)]
    host, calls = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("cat") == "python_function" and any(key in e["name"] for key in HOST_KEYS):
            name = e["name"].split("/")[-1][:80]
            host[name] += e["dur"]
            calls[name] += 1
    if host:
        lines += ["", "Host (Python-traced, inflated) time of the plugin and the calls it wraps:", ""]
        lines += [
            f"- {dur / 1e3:.2f} ms, {calls[name]} calls: `{name}`" for name, dur in host.most_common(2 * top)
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("traces", nargs="+")
    parser.add_argument("--top", type=int, default=8)
    args = parser.parse_args()
    for path in args.traces:
        print(summarize(path, args.top))


if __name__ == "__main__":
    main()
