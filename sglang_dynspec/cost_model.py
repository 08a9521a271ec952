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
    (benchmarks/results/h200-decision-20261202-81b196c/README.md). ``samples`` counts
    what each bucket has seen, so that ``CostModel`` can weigh a bucket measured a few
    times against its neighbours (``PRIOR_SAMPLES``).
    """

    alpha: float = 0.1
    first_samples: int = 3
    device: dict[tuple[Mode, int], float] = field(default_factory=dict)
    host: dict[tuple[Mode, int], float] = field(default_factory=dict)
    samples: dict[tuple[str, Mode, int], int] = field(default_factory=dict)
    _first: dict[tuple[str, Mode, int], list[float]] = field(default_factory=dict, repr=False)

    def observe(self, kind: str, mode: Mode, batch_size: int, measured: float, predicted: float) -> None:
        if not (measured > 0 and predicted > 0 and math.isfinite(measured)):
            return
        table = self.device if kind == "device" else self.host
        key, ratio = (mode, bucket_of(batch_size)), measured / predicted
        self.samples[(kind, *key)] = self.samples.get((kind, *key), 0) + 1
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
            "samples": {f"{k}:{m.value}:{b}": n for (k, m, b), n in self.samples.items()},
        }


def _parse(entries: Mapping[str, float | int], kind: str | None = None, convert=float) -> dict:
    """A snapshot's ``"mode:bucket"`` keys (``"kind:mode:bucket"`` where ``kind`` is
    given: only that kind's) as ``(Mode, bucket)``, values through ``convert``."""
    out = {}
    for key, value in entries.items():
        *prefix, mode, bucket = key.split(":")
        if prefix == ([] if kind is None else [kind]):
            out[(Mode(mode), int(bucket))] = convert(value)
    return out


# How many samples the neighbours' view of a bucket counts for: a bucket's correction is
# its own ratio weighed against the mean of the mode's other buckets (the table, where
# nothing else has run) as n : PRIOR_SAMPLES. Step cost is smooth in the batch size, so
# a bucket measured a few times far from its neighbours is more likely a transient than
# a cost. On the H200 (3B shape, C=48) 11 plain steps taken while 48 requests were
# admitted read 1.40x the table where the neighbouring buckets read 0.99; as the
# bucket's whole correction it made plain 40% dearer, and since the policy then
# speculated, plain at that size was never measured again
# (benchmarks/results/h200-20261203-d79b2bd/README.md).
PRIOR_SAMPLES = 64


@dataclass(frozen=True)
class CostModel:
    """The table with an agreed snapshot of the corrections: what the decision reads."""

    table: StepCostTable
    device_ratio: Mapping[tuple[Mode, int], float] = field(default_factory=dict)
    host_ratio: Mapping[tuple[Mode, int], float] = field(default_factory=dict)
    # Samples behind each ratio; a ratio without a count is taken as fully measured.
    device_samples: Mapping[tuple[Mode, int], int] = field(default_factory=dict)
    host_samples: Mapping[tuple[Mode, int], int] = field(default_factory=dict)
    prior_samples: int = PRIOR_SAMPLES
    # The decision reads every step and the model changes once per agreement: the
    # weighed ratio of each (mode, bucket), worked out once (``seconds``).
    _weighed: dict[tuple[Mode, int], float] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    @classmethod
    def with_snapshot(cls, table: StepCostTable, snapshot: Mapping | None) -> CostModel:
        if not snapshot:
            return cls(table)
        samples = snapshot.get("samples", {})
        return cls(
            table,
            _parse(snapshot.get("device", {})),
            _parse(snapshot.get("host", {})),
            _parse(samples, "device", int),
            _parse(samples, "host", int),
        )

    def ratio(
        self,
        ratios: Mapping[tuple[Mode, int], float],
        mode: Mode,
        batch_size: int,
        samples: Mapping[tuple[Mode, int], int] | None = None,
    ) -> float | None:
        """The bucket's ratio, weighed against its prior by the samples behind it
        (``PRIOR_SAMPLES``). The prior: the mean of the mode's other buckets; for a mode
        with no other bucket, the other mode's mean; else the table (1). A table measured
        off by a factor common to both modes (other clocks, a host-bound server) is so
        corrected everywhere by what has run; None if nothing has."""
        key = (mode, bucket_of(batch_size))
        prior = None
        for m in (mode, Mode.PLAIN if mode is Mode.SPEC else Mode.SPEC):
            others = [r for k, r in ratios.items() if k[0] is m and k != key]
            if others:
                prior = sum(others) / len(others)
                break
        own = ratios.get(key)
        if own is None:
            return prior
        n = (samples or {}).get(key)
        if n is None:
            return own
        weight = self.prior_samples
        return (n * own + weight * (1.0 if prior is None else prior)) / (n + weight)

    def ratios(self) -> dict[tuple[str, Mode, int], float]:
        """``(kind, mode, bucket) -> ratio`` as the decision uses it, for every measured
        bucket (``/metrics``)."""
        out = {}
        for kind, ratios, samples in (
            ("device", self.device_ratio, self.device_samples),
            ("host", self.host_ratio, self.host_samples),
        ):
            for mode, bucket in ratios:
                out[(kind, mode, bucket)] = self.ratio(ratios, mode, BUCKET_EDGES[bucket], samples)
        return out

    def seconds(self, mode: Mode, batch_size: int, context_len: float) -> float | None:
        base = self.table.seconds(mode, batch_size, context_len)
        if base is None:
            return None
        key = (mode, bucket_of(batch_size))
        weighed = self._weighed.get(key)
        if weighed is None:
            device = self.ratio(self.device_ratio, mode, batch_size, self.device_samples)
            host = self.ratio(self.host_ratio, mode, batch_size, self.host_samples)
            weighed = self._weighed[key] = max(
                1.0 if device is None else device, 0.0 if host is None else host
            )
        return base * weighed
