"""``crossover``: where does speculation stop paying on this server, for each acceptance?

Reads a running EAGLE3_DYNAMIC server's goodput step-time table and acceptance
estimate from ``/metrics`` (``--speculative-dynamic-policy goodput``, ``--enable-metrics``)
and prints, for acceptances 1.5 to 5, the ratio of predicted speculative to plain
tokens/s at every measured batch-size bucket and the largest bucket where
speculation still wins: the "where does my GPU cross over" answer, without a sweep.
Buckets where one mode has not been measured yet are left out (drive some load first).
"""

from __future__ import annotations

from collections.abc import Sequence

from .scrape import MetricsSnapshot

DEFAULT_ACCEPTANCES = (1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0)


def ratios(step_seconds: dict[tuple[str, int], float], acceptance: float) -> dict[int, float]:
    """{bucket's largest batch size: R = acceptance * t_plain / t_spec} where both are measured."""
    out = {}
    for (mode, batch_max), t_spec in step_seconds.items():
        t_plain = step_seconds.get(("plain", batch_max))
        if mode == "spec" and t_plain and t_spec:
            out[batch_max] = acceptance * t_plain / t_spec
    return dict(sorted(out.items()))


def crossover(step_seconds: dict[tuple[str, int], float], acceptance: float) -> int | None:
    """The largest measured bucket edge at which speculation wins (R > 1), or None."""
    winning = [b for b, r in ratios(step_seconds, acceptance).items() if r > 1]
    return max(winning) if winning else None


def report(snap: MetricsSnapshot, acceptances: Sequence[float] = DEFAULT_ACCEPTANCES) -> str:
    if not snap.step_seconds:
        return (
            "no goodput step-time table in /metrics: start the server with "
            "--speculative-dynamic-policy goodput --enable-metrics and drive some load first"
        )
    buckets = sorted({b for (_, b) in snap.step_seconds})
    lines = []
    if snap.acceptance is not None:
        lines.append(f"server's acceptance estimate: {snap.acceptance:.2f} ({snap.acceptance_source})")
    lines.append("batch size up to: " + " ".join(f"{b:>6}" for b in buckets))
    for mode in ("plain", "spec"):
        row = [snap.step_seconds.get((mode, b)) for b in buckets]
        lines.append(
            f"{mode} step (ms):    " + " ".join("     -" if t is None else f"{t * 1e3:6.2f}" for t in row)
        )
    for acc in acceptances:
        r = ratios(snap.step_seconds, acc)
        cells = " ".join("     -" if b not in r else f"{r[b]:6.2f}" for b in buckets)
        cross = crossover(snap.step_seconds, acc)
        lines.append(f"R at acceptance {acc:3.1f}: {cells}   speculation wins up to: {cross or 'never'}")
    return "\n".join(lines)


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
    return 0 if snap.step_seconds else 1
