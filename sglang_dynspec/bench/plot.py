"""``plot``: PNG figures from sweep and ramp result files.

Figures (one set per prompt/output shape found in the sweep records):

* ``throughput[_pP_oO].png`` -- total output tok/s and per-request tok/s
  against concurrency (log2 axis), one line per config: the mean over
  repeats, with a min/max band when there are several repeats;
* ``ratio_vs_<baseline>[_pP_oO].png`` -- output tok/s of every other config
  divided by the baseline's at the same concurrency (ratio of means; the band
  is the most pessimistic/optimistic min/max combination);
* ``ramp_<config>[_N].png`` -- for every ramp run: target concurrency and
  ``num_running_reqs``, the mode as a step plot, and per-step output tok/s,
  with the switches marked.

matplotlib is imported only here, so ``sweep`` and ``ramp`` run without it.
"""

from __future__ import annotations

import os
import re
from collections import OrderedDict, defaultdict
from collections.abc import Iterable, Sequence

from .records import read_jsonl

Record = dict[str, object]


class PlotError(RuntimeError):
    """Nothing sensible to plot (bad input files, no records, no matplotlib)."""


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise PlotError("matplotlib is required for `plot` (pip install matplotlib)") from None
    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    return plt


def load(files: Sequence[str]) -> list[Record]:
    records: list[Record] = []
    for path in files:
        try:
            records.extend(read_jsonl(path))
        except OSError as e:
            raise PlotError(f"cannot read {path}: {e.strerror}") from None
        except ValueError as e:
            raise PlotError(str(e)) from None
    return records


def _is_sweep(r: Record) -> bool:
    return r.get("kind", "sweep_point") == "sweep_point" and "output_tok_s" in r and "concurrency" in r


def _safe(name: object) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", str(name)) or "_"


def aggregate(points: Iterable[Record], key: str) -> dict[str, dict[int, tuple[float, float, float]]]:
    """``{config: {concurrency: (mean, min, max)}}`` of ``key`` over repeats."""
    values: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in points:
        v = r.get(key)
        if isinstance(v, (int, float)):
            values[str(r.get("config"))][int(r["concurrency"])].append(float(v))
    return {
        cfg: {c: (sum(vs) / len(vs), min(vs), max(vs)) for c, vs in sorted(by_c.items())}
        for cfg, by_c in values.items()
    }


def ratios(
    agg: dict[str, dict[int, tuple[float, float, float]]], baseline: str
) -> dict[str, dict[int, tuple[float, float, float]]]:
    """``{config: {C: (ratio of means, low, high)}}`` relative to ``baseline``
    at the concurrencies both have; low/high divide the config's min by the
    baseline's max and vice versa."""
    base = agg.get(baseline, {})
    out: dict[str, dict[int, tuple[float, float, float]]] = {}
    for cfg, by_c in agg.items():
        if cfg == baseline:
            continue
        common = {}
        for c, (m, lo, hi) in by_c.items():
            if c in base and base[c][0] > 0 and base[c][1] > 0:
                bm, blo, bhi = base[c]
                common[c] = (m / bm, lo / bhi, hi / blo)
        if common:
            out[cfg] = common
    return out


def _log2_axis(ax, xs: Sequence[int]) -> None:
    ax.set_xscale("log", base=2)
    ticks = sorted(set(xs))
    ax.set_xticks(ticks)
    ax.set_xticklabels([str(t) for t in ticks])
    ax.minorticks_off()
    ax.grid(True, which="major", alpha=0.3)


def _line_with_band(ax, by_c, label) -> None:
    xs = list(by_c)
    mean = [by_c[c][0] for c in xs]
    (line,) = ax.plot(xs, mean, marker="o", label=label)
    lo = [by_c[c][1] for c in xs]
    hi = [by_c[c][2] for c in xs]
    if any(h > low for low, h in zip(lo, hi)):
        ax.fill_between(xs, lo, hi, alpha=0.2, color=line.get_color(), linewidth=0)


def _shape_title(shape) -> str:
    p, o = shape
    return f"prompt {p} / output {o} tokens"


def plot_sweeps(plt, points: list[Record], out_dir: str, baseline: str, dpi: int) -> list[str]:
    written = []
    shapes: dict[tuple, list[Record]] = OrderedDict()
    for r in points:
        shapes.setdefault((r.get("prompt_len"), r.get("output_len")), []).append(r)
    for shape, pts in shapes.items():
        suffix = "" if len(shapes) == 1 else f"_p{shape[0]}_o{shape[1]}"
        all_c = [int(r["concurrency"]) for r in pts]
        hw = sorted({str(r["hw"]) for r in pts if "hw" in r})
        title_extra = f" -- {', '.join(hw)}" if hw else ""

        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        for ax, key, ylabel in (
            (axes[0], "output_tok_s", "output tokens/s (all requests)"),
            (axes[1], "per_request_tok_s", "tokens/s per request"),
        ):
            for cfg, by_c in aggregate(pts, key).items():
                _line_with_band(ax, by_c, cfg)
            _log2_axis(ax, all_c)
            ax.set_xlabel("concurrency")
            ax.set_ylabel(ylabel)
            ax.legend()
        fig.suptitle(f"Throughput vs concurrency ({_shape_title(shape)}){title_extra}")
        fig.tight_layout()
        path = os.path.join(out_dir, f"throughput{suffix}.png")
        fig.savefig(path, dpi=dpi)
        plt.close(fig)
        written.append(path)

        rat = ratios(aggregate(pts, "output_tok_s"), baseline)
        if rat:
            fig, ax = plt.subplots(figsize=(7, 4.5))
            for cfg, by_c in rat.items():
                _line_with_band(ax, by_c, cfg)
            ax.axhline(1.0, color="black", linewidth=1, linestyle="--", label=baseline)
            _log2_axis(ax, all_c)
            ax.set_xlabel("concurrency")
            ax.set_ylabel(f"output tok/s relative to {baseline}")
            ax.set_title(f"Speed-up over {baseline} ({_shape_title(shape)}){title_extra}")
            ax.legend()
            fig.tight_layout()
            path = os.path.join(out_dir, f"ratio_vs_{_safe(baseline)}{suffix}.png")
            fig.savefig(path, dpi=dpi)
            plt.close(fig)
            written.append(path)
    return written


def ramp_runs(records: list[Record]) -> OrderedDict[tuple, list[Record]]:
    """Ramp records grouped by (config, run_id); files appended to several
    times hold several runs whose times all start at 0."""
    runs: OrderedDict[tuple, list[Record]] = OrderedDict()
    for r in records:
        if r.get("kind") in ("sample", "switch", "ramp_step", "ramp_summary"):
            runs.setdefault((str(r.get("config")), r.get("run_id")), []).append(r)
    return runs


def plot_ramp(plt, recs: list[Record], title: str, path: str, dpi: int) -> None:
    samples = sorted((r for r in recs if r.get("kind") == "sample"), key=lambda r: r["t"])
    switches = [r for r in recs if r.get("kind") == "switch"]
    steps = sorted((r for r in recs if r.get("kind") == "ramp_step"), key=lambda r: r["t_start"])

    fig, (ax_load, ax_mode, ax_tput) = plt.subplots(
        3, 1, figsize=(11, 7.5), sharex=True, gridspec_kw={"height_ratios": [3, 1.2, 2]}
    )
    t = [s["t"] for s in samples]
    ax_load.step(
        t, [s.get("concurrency") for s in samples], where="post", label="target concurrency", color="tab:gray"
    )
    running = [(s["t"], s["num_running_reqs"]) for s in samples if s.get("num_running_reqs") is not None]
    if running:
        ax_load.plot(*zip(*running), label="sglang:num_running_reqs", color="tab:blue")
    ax_load.set_ylabel("requests")
    ax_load.grid(True, alpha=0.3)

    modes = [(s["t"], s["mode"]) for s in samples if s.get("mode") is not None]
    if modes:
        ax_mode.step(*zip(*modes), where="post", color="tab:purple")
        ax_mode.set_ylim(-0.2, 1.2)
        ax_mode.set_yticks([0, 1])
        ax_mode.set_yticklabels(["plain", "spec"])
    else:
        ax_mode.text(
            0.5,
            0.5,
            "no sglang:spec_dynamic_mode metric",
            ha="center",
            va="center",
            transform=ax_mode.transAxes,
            color="gray",
        )
        ax_mode.set_yticks([])
    ax_mode.set_ylabel("mode")

    if steps:
        xs, ys = [], []
        for s in steps:
            if s.get("output_tok_s") is not None:
                xs += [s["t_start"], s["t_end"]]
                ys += [s["output_tok_s"]] * 2
        ax_tput.plot(xs, ys, color="tab:green")
    ax_tput.set_ylabel("output tok/s\n(per step)")
    ax_tput.set_xlabel("time since ramp start (s)")
    ax_tput.grid(True, alpha=0.3)

    labelled = set()
    for sw in switches:
        color = "tab:red" if sw.get("to") == "plain" else "tab:green"
        label = f"switch to {sw.get('to')}"
        for ax in (ax_load, ax_mode, ax_tput):
            ax.axvline(
                sw["t"],
                color=color,
                linestyle=":",
                linewidth=1.2,
                label=label if (ax is ax_load and label not in labelled) else None,
            )
        labelled.add(label)
        if sw.get("max_gap_ms_near_switch") is not None:
            ax_load.annotate(
                f"{sw['max_gap_ms_near_switch']:.0f} ms",
                (sw["t"], 1),
                xycoords=("data", "axes fraction"),
                rotation=90,
                va="top",
                ha="right",
                fontsize=7,
                color=color,
            )
    ax_load.legend(loc="upper left", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


DECISION_CONFIGS = ("baseline", "eagle3", "dynamic")


def decision_ratios(points: Iterable[Record]) -> dict[str, dict[int, float]]:
    """``{row: {C: dynamic / max(baseline, eagle3)}}`` (means over repeats) of the
    records that carry all three configurations at a concurrency; rows by their ``row``
    tag (the decision grid's), else by shape, prompt and acceptance."""
    rows: dict[str, list[Record]] = OrderedDict()
    for r in points:
        label = r.get("row") or f"{r.get('shape')} p{r.get('prompt_len')} acc {r.get('acc_len')}"
        rows.setdefault(str(label), []).append(r)
    out: dict[str, dict[int, float]] = OrderedDict()
    for label, pts in rows.items():
        agg = aggregate(pts, "output_tok_s")
        if not all(cfg in agg for cfg in DECISION_CONFIGS):
            continue
        common = set.intersection(*(set(agg[cfg]) for cfg in DECISION_CONFIGS))
        best = {c: max(agg["baseline"][c][0], agg["eagle3"][c][0]) for c in common}
        ratio = {c: agg["dynamic"][c][0] / best[c] for c in sorted(common) if best[c] > 0}
        if ratio:
            out[label] = ratio
    return out


def plot_decision(plt, points: list[Record], path: str, dpi: int) -> bool:
    """EAGLE3_DYNAMIC over the better of the baseline and EAGLE-3, one line per row
    (issue 17's target: 0.97 at every point). False if no row has all three."""
    rows = decision_ratios(points)
    if not rows:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, by_c in rows.items():
        ax.plot(list(by_c), list(by_c.values()), marker="o", label=label)
    ax.axhline(1.0, color="black", linewidth=1, linestyle="--")
    ax.axhline(0.97, color="gray", linewidth=1, linestyle=":", label="0.97")
    _log2_axis(ax, [c for by_c in rows.values() for c in by_c])
    ax.set_xlabel("concurrency")
    ax.set_ylabel("dynamic / max(baseline, EAGLE-3), output tok/s")
    ax.set_title("EAGLE3_DYNAMIC against the better server")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return True


def run_plot(files: Sequence[str], out_dir: str, baseline: str = "baseline", dpi: int = 120) -> list[str]:
    """Write all figures for ``files`` into ``out_dir``; returns the paths."""
    records = load(files)
    points = [r for r in records if _is_sweep(r)]
    runs = ramp_runs(records)
    if not points and not runs:
        raise PlotError(f"no sweep or ramp records in {', '.join(files)}")
    plt = _pyplot()
    os.makedirs(out_dir, exist_ok=True)
    written = plot_sweeps(plt, points, out_dir, baseline, dpi) if points else []
    decision = os.path.join(out_dir, "decision_ratio.png")
    if points and plot_decision(plt, points, decision, dpi):
        written.append(decision)

    per_config: dict[str, int] = defaultdict(int)
    for cfg, _run in runs:
        per_config[cfg] += 1
    seen: dict[str, int] = defaultdict(int)
    for (cfg, _run), recs in runs.items():
        seen[cfg] += 1
        suffix = f"_{seen[cfg]}" if per_config[cfg] > 1 else ""
        summary = next((r for r in recs if r.get("kind") == "ramp_summary"), {})
        ratio = summary.get("worst_gap_ratio")
        title = f"Load ramp -- {cfg}"
        if summary.get("date"):
            title += f" ({summary['date']})"
        if ratio is not None:
            title += f"; worst switch gap = {ratio:.1f} x step"
        path = os.path.join(out_dir, f"ramp_{_safe(cfg)}{suffix}.png")
        plot_ramp(plt, recs, title, path, dpi)
        written.append(path)
    return written
