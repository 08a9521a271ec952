"""Summarize torch-profiler traces of SGLang servers (``/start_profile``, CPU + GPU).

    python benchmarks/profiles/summarize_trace.py TRACE.json.gz [TRACE2.json.gz ...]
    python benchmarks/profiles/summarize_trace.py --diff BASELINE.json.gz DYNAMIC.json.gz

Per trace: for each GPU step annotation SGLang writes (``step[DECODE bs=..]``,
``draft_extend`` ...), how many, their mean span on the GPU timeline, the mean kernel
time inside them (span - kernel time = the GPU waiting for the host) and the mean
period between the starts of consecutive ones (what a step costs the server); the decode
steps' periods as a distribution (median, mean, p90, p99, the time above the median) and
what lies inside the longest ones (other annotations, kernel time, the GPU idle): where a
server's mean step exceeds its median, the slow steps say why; the prefill's kernel time per
prompt token, the target's forwards apart from the draft's (SGLang names each forward
``step[EXTEND bs=.. toks=..]``; the draft's run inside its ``draft_extend`` span); the GPU's
busy share of the traced window and the kernel time outside every step annotation
(work the plugin or SGLang queues between steps); the kernels that take the most time,
over the trace and inside each annotation kind (mean milliseconds per annotation: which
GEMMs, attention kernels and norms make up a verify, a draft or a draft extend); and the
host time of the plugin's own functions (``sglang_dynspec``) and the SGLang
calls it wraps. Host times come from Python tracing and are inflated by it (several
times): compare them with each other, not with the GPU timeline.

``--diff``: kernel time per decode step of each kernel name in both traces, largest
differences first (what the second server's decode steps run that the first's do not).
"""

from __future__ import annotations

import argparse
import bisect
import collections
import gzip
import json

HOST_KEYS = ("sglang_dynspec", "dynspec", "_draft_extend_for_prefill", "tp_worker.py", "init_new")


def load(path: str) -> list[dict]:
    with gzip.open(path) if path.endswith(".gz") else open(path) as f:
        return json.load(f)["traceEvents"]


def _kernels(events):
    return sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])


def _annotations(events):
    return sorted((e for e in events if e.get("cat") == "gpu_user_annotation"), key=lambda e: e["ts"])


def _kind(annotation: dict) -> str:
    return annotation["name"].split(" ")[0]


def _decode_steps(annotations):
    return [a for a in annotations if "DECODE" in a["name"] or "TARGET_VERIFY" in a["name"]]


def _kernel_time(kernels: list[dict], starts: list[float], lo: float, hi: float, clip: bool = False) -> float:
    """Kernel microseconds of the kernels that start in [lo, hi) (``starts``: their start
    times, sorted); ``clip``: only the part of each before ``hi``."""
    i, busy = bisect.bisect_left(starts, lo), 0.0
    while i < len(kernels) and kernels[i]["ts"] < hi:
        end = kernels[i]["ts"] + kernels[i]["dur"]
        busy += (min(end, hi) if clip else end) - kernels[i]["ts"]
        i += 1
    return busy


def _quantile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def step_periods(events: list[dict], top: int = 5) -> list[str]:
    """The decode steps' periods (start to next start) as a distribution, and the
    ``top`` longest with what runs inside them: the other annotations that start in
    the period (a prefill, a flush, a draft extend), the kernel time and the GPU idle."""
    annotations = _annotations(events)
    decode = _decode_steps(annotations)
    if len(decode) < 3:
        return []
    kernels = _kernels(events)
    starts = [k["ts"] for k in kernels]
    decode_ids = {id(a) for a in decode}
    others = [a for a in annotations if id(a) not in decode_ids and not a["name"].startswith("scheduler.")]
    periods = [(b["ts"] - a["ts"], a["ts"], b["ts"]) for a, b in zip(decode, decode[1:])]
    values = sorted(p for p, _, _ in periods)
    median = _quantile(values, 0.5)
    excess = sum(v - median for v in values if v > median)
    slow = [v for v in values if v > 2 * median]
    lines = [
        "",
        f"Decode-step periods ({len(values)}): median {median / 1e3:.2f} ms, mean "
        f"{sum(values) / len(values) / 1e3:.2f}, p90 {_quantile(values, 0.9) / 1e3:.2f}, p99 "
        f"{_quantile(values, 0.99) / 1e3:.2f}, max {values[-1] / 1e3:.2f}; time above the median "
        f"{excess / 1e3:.1f} ms ({excess / sum(values):.1%} of the steps' time), "
        f"{len(slow)} periods over twice the median ({sum(v - median for v in slow) / 1e3:.1f} ms above it).",
        "",
        "| period (ms) | at (ms) | annotations starting inside | kernel time (ms) | GPU idle (ms) |",
        "|---|---|---|---|---|",
    ]
    origin = decode[0]["ts"]
    for period, lo, hi in sorted(periods, key=lambda p: -p[0])[:top]:  # ties: earliest first
        busy = _kernel_time(kernels, starts, lo, hi, clip=True)
        inside = collections.Counter(_kind(a) for a in others if lo < a["ts"] < hi)
        names = ", ".join(f"`{k}` x{n}" for k, n in sorted(inside.items())) or "-"
        lines.append(
            f"| {period / 1e3:.2f} | {(lo - origin) / 1e3:.1f} | {names} | {busy / 1e3:.2f} | "
            f"{max(period - busy, 0) / 1e3:.2f} |"
        )
    return lines


def _toks(annotation: dict) -> int:
    for part in annotation["name"].rstrip("]").split():
        if part.startswith("toks="):
            return int(part[5:])
    return 0


def extend_per_token(events: list[dict]) -> list[str]:
    """Kernel time per prompt token of the EXTEND forwards: the target's, and the draft's
    (an EXTEND forward inside a ``draft_extend`` span: EAGLE-3's draft pass over a prompt,
    or a catch-up), so that two servers' prefill paths compare per token whatever part of
    a wave their profiles caught."""
    annotations = _annotations(events)
    extends = [a for a in annotations if a["name"].startswith("step[EXTEND") and _toks(a)]
    if not extends:
        return []
    spans = [(a["ts"], a["ts"] + a["dur"]) for a in annotations if _kind(a) == "draft_extend"]
    kernels = _kernels(events)
    starts = [k["ts"] for k in kernels]
    totals = {"target": [0, 0, 0.0], "draft": [0, 0, 0.0]}  # forwards, tokens, kernel µs
    for a in extends:
        lo, hi = a["ts"], a["ts"] + a["dur"]
        role = "draft" if any(s <= lo and hi <= e for s, e in spans) else "target"
        busy = _kernel_time(kernels, starts, lo, hi)
        t = totals[role]
        t[0], t[1], t[2] = t[0] + 1, t[1] + _toks(a), t[2] + busy
    lines = [
        "",
        "| EXTEND forwards | n | prompt tokens | kernel time (ms) | µs per token |",
        "|---|---|---|---|---|",
    ]
    for role, (n, toks, busy) in totals.items():
        if n:
            lines.append(f"| {role} | {n} | {toks} | {busy / 1e3:.2f} | {busy / toks:.2f} |")
    return lines


def summarize(path: str, top: int = 8) -> str:
    events = load(path)
    kernels = _kernels(events)
    starts = [k["ts"] for k in kernels]
    annotations = _annotations(events)
    steps = collections.defaultdict(list)
    starts_by_kind = collections.defaultdict(list)
    kernels_by_kind = collections.defaultdict(collections.Counter)
    inside = [False] * len(kernels)
    for a in annotations:
        lo, hi = a["ts"], a["ts"] + a["dur"]
        i, busy = bisect.bisect_left(starts, lo), 0.0
        while i < len(kernels) and kernels[i]["ts"] < hi:
            busy += kernels[i]["dur"]
            inside[i] = True
            kernels_by_kind[_kind(a)][kernels[i]["name"][:60]] += kernels[i]["dur"]
            i += 1
        steps[_kind(a)].append((a["dur"], busy))
        starts_by_kind[_kind(a)].append(lo)
    lines = [
        f"## {path}",
        "",
        "| GPU annotation | n | mean span (ms) | mean kernel time (ms) | mean period (ms) |",
        "|---|---|---|---|---|",
    ]
    for name, values in sorted(steps.items()):
        n = len(values)
        s = starts_by_kind[name]
        period = f"{(s[-1] - s[0]) / (n - 1) / 1e3:.2f}" if n > 1 else "-"
        lines.append(
            f"| `{name}` | {n} | {sum(v[0] for v in values) / n / 1e3:.2f} | "
            f"{sum(v[1] for v in values) / n / 1e3:.2f} | {period} |"
        )
    lines += step_periods(events, top=max(top // 2, 3))
    lines += extend_per_token(events)
    if kernels:
        window = kernels[-1]["ts"] + kernels[-1]["dur"] - kernels[0]["ts"]
        total = sum(k["dur"] for k in kernels)
        outside = [k for k, is_in in zip(kernels, inside) if not is_in]
        lines += [
            "",
            f"GPU busy {total / window:.1%} of the {window / 1e3:.1f} ms from the first kernel to the last; "
            f"kernel time outside every step annotation: {sum(k['dur'] for k in outside) / 1e3:.2f} ms "
            f"in {len(outside)} kernels.",
        ]
        by_outside = collections.Counter()
        for k in outside:
            by_outside[k["name"][:60]] += k["dur"]
        lines += [
            f"- {dur / 1e3:.2f} ms `{name}` (outside)" for name, dur in by_outside.most_common(top // 2)
        ]
    by_kernel = collections.Counter()
    for k in kernels:
        by_kernel[k["name"][:60]] += k["dur"]
    lines += ["", f"Kernels, total {sum(by_kernel.values()) / 1e3:.1f} ms:", ""]
    lines += [f"- {dur / 1e3:.2f} ms `{name}`" for name, dur in by_kernel.most_common(top)]
    for name, values in sorted(steps.items()):
        by_name = kernels_by_kind[name]
        if not by_name or name.startswith("scheduler."):  # the scheduler's spans hold the steps
            continue
        lines += ["", f"Inside `{name}`, mean ms per annotation ({len(values)}):", ""]
        lines += [
            f"- {dur / len(values) / 1e3:.3f} ms `{kernel}`" for kernel, dur in by_name.most_common(top)
        ]
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


def per_decode_step_kernels(path: str) -> tuple[int, collections.Counter]:
    """Decode-step count and kernel microseconds per decode step by kernel name, over the
    whole trace (kernels between steps included: they are what a step costs)."""
    events = load(path)
    n = len(_decode_steps(_annotations(events)))
    by_kernel = collections.Counter()
    for k in _kernels(events):
        by_kernel[k["name"][:60]] += k["dur"]
    return n, collections.Counter({name: dur / max(n, 1) for name, dur in by_kernel.items()})


def diff(first: str, second: str, top: int = 12) -> str:
    n1, k1 = per_decode_step_kernels(first)
    n2, k2 = per_decode_step_kernels(second)
    names = set(k1) | set(k2)
    rows = sorted(names, key=lambda name: abs(k2[name] - k1[name]), reverse=True)[:top]
    lines = [
        f"## kernel time per decode step: {second} ({n2} steps) minus {first} ({n1} steps)",
        "",
        f"Total: {sum(k2.values()) / 1e3:.3f} ms against {sum(k1.values()) / 1e3:.3f} ms per decode step.",
        "",
        "| kernel | first (µs/step) | second (µs/step) | difference |",
        "|---|---|---|---|",
    ]
    lines += [f"| `{name}` | {k1[name]:.1f} | {k2[name]:.1f} | {k2[name] - k1[name]:+.1f} |" for name in rows]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("traces", nargs="+")
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--diff", action="store_true", help="compare two traces' kernels per decode step")
    args = parser.parse_args()
    if args.diff:
        if len(args.traces) != 2:
            parser.error("--diff takes exactly two traces")
        print(diff(*args.traces, top=args.top))
        return
    for path in args.traces:
        print(summarize(path, args.top))


if __name__ == "__main__":
    main()
