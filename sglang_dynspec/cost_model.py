"""What one decode step costs in each mode: a table measured at start-up, corrected online.

Pure Python (no torch, no SGLang). The worker times both modes on the device after its
CUDA graphs are captured (``step_timing``), at several batch sizes and context lengths;
:class:`StepCostTable` interpolates between those points, so the decision knows both
modes' costs before the first request and at every batch it has not run yet. A
speculative step's verify attends over ``num_draft_tokens`` positions per request, so its
cost grows with context faster than a plain step's: the table is keyed by both.

Online, :class:`CostCorrections` scales the table per mode and batch-size bucket by the
ratio of measured to predicted step time (the device time of each step's forward, read
without a host sync, and where consecutive decode steps allow, the host time per step,
which bounds the step when the host is the bottleneck). A prefill between two steps does
not stop it: each decode step's device time is a sample on its own.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from sglang_dynspec.policy import Mode

# Upper edges of the batch-size buckets the corrections are kept in: about 1.5x apart.
BUCKET_EDGES = (1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)


def bucket_of(batch_size: int) -> int:
    """Index of the bucket holding ``batch_size`` (sizes above the last edge share the last)."""
    return min(bisect.bisect_left(BUCKET_EDGES, batch_size), len(BUCKET_EDGES) - 1)


@dataclass(frozen=True)
class StepCost:
    """One measured point: a decode step of ``mode`` at ``batch_size`` requests whose
    mean context is ``context_len`` took ``seconds`` on the device."""

    mode: Mode
    batch_size: int
    context_len: int
    seconds: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", Mode(self.mode))
        if (
            self.batch_size < 1
            or self.context_len < 0
            or not (self.seconds > 0 and math.isfinite(self.seconds))
        ):
            raise ValueError(f"not a step cost: {self}")


def _interpolate(xs: Sequence[float], ys: Sequence[float], x: float, below: bool = False) -> float:
    """Piecewise-linear through ``(xs, ys)`` (``xs`` ascending); linear beyond the last
    two points (costs keep growing with batch and context). Below the first point: flat,
    or with ``below`` linear through the first two (a context shorter than the shortest
    timed one still costs less), never under a quarter of the first value."""
    if len(xs) == 1 or (x <= xs[0] and not below):
        return ys[0]
    i = bisect.bisect_left(xs, x)
    if i < len(xs) and xs[i] == x:
        return ys[i]
    i = min(max(i, 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    y = y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    if x > xs[-1]:
        return max(y, ys[-1])
    return max(y, ys[0] / 4) if x < xs[0] else y


@dataclass(frozen=True)
class StepCostTable:
    """Measured step costs per mode, interpolated in batch size and context length."""

    points: tuple[StepCost, ...]

    def __post_init__(self) -> None:
        by_mode: dict[Mode, dict[int, dict[int, float]]] = {m: {} for m in Mode}
        for p in self.points:
            by_mode[p.mode].setdefault(p.context_len, {})[p.batch_size] = p.seconds
        object.__setattr__(self, "grid", by_mode)

    @classmethod
    def from_points(cls, points: Iterable[StepCost]) -> StepCostTable:
        return cls(tuple(sorted(points, key=lambda p: (p.mode.value, p.context_len, p.batch_size))))

    def covers(self, mode: Mode) -> bool:
        return bool(self.grid[mode])

    def seconds(self, mode: Mode, batch_size: int, context_len: float) -> float | None:
        """Predicted seconds of one ``mode`` step, or None if the table has no point of it."""
        grid = self.grid[mode]
        if not grid:
            return None
        contexts = sorted(grid)
        per_context = []
        for c in contexts:
            sizes = sorted(grid[c])
            per_context.append(_interpolate(sizes, [grid[c][b] for b in sizes], batch_size))
        return _interpolate(contexts, per_context, context_len, below=True)

    def as_rows(self) -> list[dict]:
        """JSON-ready rows (the on-disk cache, the start-up log, ``/metrics``)."""
        return [
            {
                "mode": p.mode.value,
                "batch_size": p.batch_size,
                "context_len": p.context_len,
                "seconds": p.seconds,
            }
            for p in self.points
        ]

    @classmethod
    def from_rows(cls, rows: Iterable[Mapping]) -> StepCostTable:
        return cls.from_points(
            StepCost(Mode(r["mode"]), int(r["batch_size"]), int(r["context_len"]), float(r["seconds"]))
            for r in rows
        )


@dataclass
class CostCorrections:
    """Rank-local running ratios of measured to predicted step time, per (mode, bucket).

    ``device``: the device time of each step's forward over the table's prediction
    (events, read once completed); ``host``: the host time between consecutive decode
    step starts of the same mode (no other step between) over the same prediction. The
    decision uses the larger of the two: a step cannot go faster than the host issues it.

    A bucket's correction starts as the median of its first ``first_samples`` ratios,
    not its first one: on the H200 the first plain steps at batch 128, right after 80
    requests were admitted, read 2x the table (clipped), the policy resumed speculation
    at R = 1.51 where the table gave 0.76, and switched back 55 steps later
    (benchmarks/results/h200-decision-20261202-81b196c/README.md).
    """

    alpha: float = 0.1
    first_samples: int = 3
    device: dict[tuple[Mode, int], float] = field(default_factory=dict)
    host: dict[tuple[Mode, int], float] = field(default_factory=dict)
    _first: dict[tuple[str, Mode, int], list[float]] = field(default_factory=dict, repr=False)

    def observe(self, kind: str, mode: Mode, batch_size: int, measured: float, predicted: float) -> None:
        if not (measured > 0 and predicted > 0 and math.isfinite(measured)):
            return
        table = self.device if kind == "device" else self.host
        key, ratio = (mode, bucket_of(batch_size)), measured / predicted
        old = table.get(key)
        # One sample moves the average by at most a factor of 2 before averaging, and
        # the first ones start it at most 2x from the table's 1: a step stalled by
        # something else (a compile, another process, an admission) is not a cost change.
        if old is None:
            first = self._first.setdefault((kind, *key), [])
            first.append(ratio)
            if len(first) >= self.first_samples:
                table[key] = min(max(statistics.median(first), 0.5), 2.0)
                del self._first[(kind, *key)]
            return
        ratio = min(max(ratio, old / 2), old * 2)
        table[key] = old + self.alpha * (ratio - old)

    def snapshot(self) -> dict:
        """A plain dict that every TP rank can be handed (``agree``)."""
        return {
            "device": {f"{m.value}:{b}": r for (m, b), r in self.device.items()},
            "host": {f"{m.value}:{b}": r for (m, b), r in self.host.items()},
        }


def _parse(ratios: Mapping[str, float]) -> dict[tuple[Mode, int], float]:
    out = {}
    for key, ratio in ratios.items():
        mode, bucket = key.split(":")
        out[(Mode(mode), int(bucket))] = float(ratio)
    return out


@dataclass(frozen=True)
class CostModel:
    """The table with an agreed snapshot of the corrections: what the decision reads."""

    table: StepCostTable
    device_ratio: Mapping[tuple[Mode, int], float] = field(default_factory=dict)
    host_ratio: Mapping[tuple[Mode, int], float] = field(default_factory=dict)

    @classmethod
    def with_snapshot(cls, table: StepCostTable, snapshot: Mapping | None) -> CostModel:
        if not snapshot:
            return cls(table)
        return cls(table, _parse(snapshot.get("device", {})), _parse(snapshot.get("host", {})))

    def ratio(self, ratios: Mapping[tuple[Mode, int], float], mode: Mode, batch_size: int) -> float | None:
        """The bucket's ratio; for a bucket not run yet, the mean of the mode's other
        buckets; for a mode not run yet, the other mode's mean. A table measured off by a
        factor common to both modes (other clocks, a host-bound server) is so corrected
        everywhere by what has run; None if nothing has."""
        ratio = ratios.get((mode, bucket_of(batch_size)))
        if ratio is not None:
            return ratio
        for m in (mode, Mode.PLAIN if mode is Mode.SPEC else Mode.SPEC):
            same = [r for (k, _), r in ratios.items() if k is m]
            if same:
                return sum(same) / len(same)
        return None

    def seconds(self, mode: Mode, batch_size: int, context_len: float) -> float | None:
        base = self.table.seconds(mode, batch_size, context_len)
        if base is None:
            return None
        device = self.ratio(self.device_ratio, mode, batch_size)
        host = self.ratio(self.host_ratio, mode, batch_size)
        return base * max(1.0 if device is None else device, 0.0 if host is None else host)
