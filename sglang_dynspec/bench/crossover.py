"""``crossover``: where does speculation stop paying on this server, for each acceptance?

Reads a running EAGLE3_DYNAMIC server's start-up step-cost table from ``/metrics``
(``--enable-metrics``; the table is there before the server has served anything) and
prints, for acceptances 1.5 to 5 and each timed context length, the smallest decode
batch size at which plain decode beats speculation: the "where does my GPU cross over"
answer, without a sweep. The ratio is the goodput policy's own
(``goodput.crossover_batch_size`` on ``goodput.Estimates``), not a copy. ``--plot FILE``
also draws it (needs matplotlib).
"""

from __future__ import annotations

from collections.abc import Sequence

from sglang_dynspec.cost_model import CostModel, StepCostTable
from sglang_dynspec.goodput import Estimates, crossover_batch_size
from sglang_dynspec.policy import Mode

from .scrape import MetricsSnapshot

DEFAULT_ACCEPTANCES = (1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0)


def crossover_table(
    table: StepCostTable, acceptances: Sequence[float]
) -> tuple[list[int], int, dict[tuple[float, int], int | None]]:
    """(contexts, largest timed batch size, {(acceptance, context): crossover batch size or None})."""
    contexts = sorted({p.context_len for p in table.points})
    max_batch = max(p.batch_size for p in table.points)
    estimates = Estimates(costs=CostModel(table))
    cells = {(a, c): crossover_batch_size(estimates, a, c, max_batch) for a in acceptances for c in contexts}
    return contexts, max_batch, cells


def report(snap: MetricsSnapshot, acceptances: Sequence[float] = DEFAULT_ACCEPTANCES) -> str:
    if not snap.step_costs:
        return (
            "no step-cost table in /metrics: start the server with --speculative-algorithm "
            "EAGLE3_DYNAMIC --enable-metrics (the table is timed at start-up)"
        )
    table = StepCostTable.from_rows(snap.step_costs)
    contexts, max_batch, cells = crossover_table(table, acceptances)
    lines = []
    if snap.acceptance is not None:
        lines.append(f"server's acceptance estimate: {snap.acceptance:.2f} ({snap.acceptance_source})")
    sizes = sorted({p.batch_size for p in table.points})
    for c in contexts:
        lines.append(f"context {c}: batch size   " + " ".join(f"{b:>6}" for b in sizes))
        for mode in Mode:
            row = [table.seconds(mode, b, c) for b in sizes]
            lines.append(f"  {mode.value:>5} step (ms)      " + " ".join(f"{t * 1e3:6.2f}" for t in row))
    lines.append("plain decode beats speculation from batch size (by acceptance and context):")
    lines.append("acceptance " + " ".join(f"{'ctx ' + str(c):>10}" for c in contexts))
    for a in acceptances:
        row = [cells[(a, c)] for c in contexts]
        lines.append(
            f"{a:10.1f} " + " ".join(f"{'> ' + str(max_batch) if b is None else str(b):>10}" for b in row)
        )
    return "\n".join(lines)


def plot(table: StepCostTable, acceptances: Sequence[float], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts, max_batch, cells = crossover_table(table, acceptances)
    fig, ax = plt.subplots(figsize=(6, 4))
    for c in contexts:
        ys = [cells[(a, c)] or max_batch for a in acceptances]
        ax.plot(acceptances, ys, marker="o", label=f"context {c}")
    ax.set_xlabel("acceptance (tokens per speculative step)")
    ax.set_ylabel("crossover decode batch size")
    ax.set_title("plain decode beats speculation above the line")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


async def run_crossover(args) -> int:
    import aiohttp

    from .client import ServerUnreachable
    from .scrape import fetch_metrics

    try:
        async with aiohttp.ClientSession() as session:
            snap = await fetch_metrics(session, args.url)
    except aiohttp.ClientError as e:
        raise ServerUnreachable(f"cannot read {args.url}/metrics: {e}") from e
    if snap is None:
        print("the server has no /metrics (start it with --enable-metrics)")
        return 2
    print(report(snap, args.acceptance))
    if snap.step_costs and getattr(args, "plot", None):
        plot(StepCostTable.from_rows(snap.step_costs), args.acceptance, args.plot)
        print(f"wrote {args.plot}")
    return 0 if snap.step_costs else 1
