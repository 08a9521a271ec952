"""Step costs of both decode modes, measured on the device at start-up (issue 17).

After SGLang's CUDA graphs and the plugin's plain decode graph are captured, and
before the first request, :func:`measure_step_costs` times

* ``plain``: one plain decode step exactly as the plugin runs it
  (``plain_step.run_plain_decode`` on the plain decode graph, catch-up off), and
* ``spec``: one speculative decode step exactly as SGLang runs it when serving
  (``EAGLEWorkerV2.forward_batch_generation``: draft, verify, draft extend, on their
  CUDA graphs),

on synthetic decode batches (``compat.synthetic_decode_batch``) over a grid of batch
sizes and context lengths (:func:`default_grid`). Each point: ``warmup`` untimed
steps per mode, then the median of ``repeats`` steps queued back to back, each between
its own events (CUDA events on CUDA and one synchronize at the end: this is start-up,
not the hot path; the host clock elsewhere; :func:`pipelined_step_seconds`). Points are measured coarse-to-fine (:func:`measurement_order`) until the
time budget is spent (``SGLANG_DYNSPEC_CALIBRATE_SECONDS``, 15 s by default). Every TP rank runs the same steps in the same order (they
contain collectives): the grid and each go/stop decision are the first rank's.

Torch, ``compat`` and the plugin's own step code only; no SGLang import.
"""

from __future__ import annotations

import logging
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from sglang_dynspec import compat, config
from sglang_dynspec.device_timer import DeviceTimer
from sglang_dynspec.plain_step import PlainDecoder, run_plain_decode

logger = logging.getLogger("sglang_dynspec")

CALIBRATE_ENV = "SGLANG_DYNSPEC_CALIBRATE"
# Wall time the calibration may take (the first rank's clock); what is left of the
# grid when it is spent is not measured.
BUDGET_ENV = "SGLANG_DYNSPEC_CALIBRATE_SECONDS"
DEFAULT_BUDGET_SECONDS = 15.0
MODES = ("plain", "spec")
# Points measured whatever the budget: the grid's corners, first in measurement_order.
CORNERS = 4

# Batch sizes about 1.5-2x apart, and context lengths, before the limits cut them.
BATCH_LADDER = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
CONTEXT_LADDER = (128, 512, 2048, 8192)
# Without CUDA graphs (the CPU test bed, or graphs off) steps are slow and the grid is small.
EAGER_BATCH_LADDER = (1, 4, 16)
EAGER_CONTEXT_LADDER = (64, 256)


@dataclass(frozen=True)
class StepCostSample:
    """Median device time of one decode step of ``mode`` (``"spec"`` or ``"plain"``)
    for ``batch_size`` requests of ``context_len`` committed tokens each."""

    mode: str
    batch_size: int
    context_len: int
    seconds: float


@dataclass(frozen=True)
class StepLimits:
    """What a measured step may be: within these, it runs as serving runs it."""

    max_batch_size: int  # request rows, max running requests, largest captured graph
    max_context_len: int  # the model's context length (less the speculative reserve)
    graph_batch_sizes: tuple[int, ...] | None = None  # captured by every decode graph; None: eager

    def batch_sizes(self, wanted: Sequence[int]) -> list[int]:
        """``wanted`` within the limits, each as the size a graph replays it at (the
        next captured size: a smaller batch is padded to it), without duplicates."""
        out = set()
        for bs in wanted:
            if not 1 <= bs <= self.max_batch_size:
                continue
            if self.graph_batch_sizes is not None:
                bs = min((c for c in self.graph_batch_sizes if c >= bs), default=None)
                if bs is None or bs > self.max_batch_size:
                    continue
            out.add(bs)
        return sorted(out)

    def context_lens(self, wanted: Sequence[int]) -> list[int]:
        """``wanted``, each capped at the longest context, without duplicates."""
        return sorted({min(c, self.max_context_len) for c in wanted if c >= 1 and self.max_context_len >= 1})


def budget_from_environ(environ=os.environ) -> float:
    """``SGLANG_DYNSPEC_CALIBRATE_SECONDS``, or :data:`DEFAULT_BUDGET_SECONDS`."""
    raw = environ.get(BUDGET_ENV, "").strip()
    if not raw:
        return DEFAULT_BUDGET_SECONDS
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not (seconds >= 0 and math.isfinite(seconds)):
        raise config.ConfigError(f"{BUDGET_ENV}={raw!r}: expected a number of seconds >= 0")
    return seconds


def step_limits(spec_worker, plain_graph) -> StepLimits:
    max_batch, max_context = compat.synthetic_batch_limits(spec_worker)
    captured = compat.decode_graph_batch_sizes(
        spec_worker, plain_graph.runner if plain_graph is not None else None
    )
    if captured is not None:
        max_batch = min([max_batch, *captured[-1:]])
        captured = tuple(captured)
    return StepLimits(max_batch, max_context, captured)


def grid_for(limits: StepLimits) -> tuple[list[int], list[int]]:
    """The default grid under ``limits``: the batch ladder up to the largest batch
    (which is always included), and the context ladder capped at the longest
    context. Small when the steps run eagerly."""
    eager = limits.graph_batch_sizes is None
    ladder = EAGER_BATCH_LADDER if eager else BATCH_LADDER
    batch_sizes = limits.batch_sizes([*ladder, limits.max_batch_size])
    context_lens = limits.context_lens(EAGER_CONTEXT_LADDER if eager else CONTEXT_LADDER)
    return batch_sizes, context_lens


def default_grid(spec_worker, plain_graph) -> tuple[list[int], list[int]]:
    """``(batch_sizes, context_lens)`` to calibrate on this server (see :func:`grid_for`)."""
    return grid_for(step_limits(spec_worker, plain_graph))


def coarse_to_fine(n: int) -> list[int]:
    """Indices ``0..n-1``: both ends first, then midpoints of ever finer halvings."""
    if n <= 0:
        return []
    order, seen = [], set()

    def add(i: int) -> None:
        if i not in seen:
            seen.add(i)
            order.append(i)

    add(0)
    add(n - 1)
    spans = [(0, n - 1)]
    while spans:
        finer = []
        for lo, hi in spans:
            if hi - lo >= 2:
                mid = (lo + hi) // 2
                add(mid)
                finer += [(lo, mid), (mid, hi)]
        spans = finer
    return order


def measurement_order(batch_sizes: Sequence[int], context_lens: Sequence[int]) -> list[tuple[int, int]]:
    """The ``(batch_size, context_len)`` points of the grid, coarse first: the corners
    (smallest and largest batch at the shortest and longest context), then ever
    finer. A budget that stops early still leaves the grid covered end to end."""
    batch_sizes, context_lens = sorted(set(batch_sizes)), sorted(set(context_lens))
    b_rank = {b: r for r, b in enumerate(coarse_to_fine(len(batch_sizes)))}
    c_rank = {c: r for r, c in enumerate(coarse_to_fine(len(context_lens)))}
    points = [(batch_sizes[b], context_lens[c]) for b in b_rank for c in c_rank]

    def key(point):
        b, c = b_rank[batch_sizes.index(point[0])], c_rank[context_lens.index(point[1])]
        return max(b, c), b, c

    return sorted(points, key=key)


def run_within_budget(
    points: Sequence[tuple[int, int]],
    measure: Callable[[int, int], list[StepCostSample]],
    budget_seconds: float,
    *,
    clock: Callable[[], float] = time.monotonic,
    agree: Callable[[object], object] = lambda decision: decision,
    start: float | None = None,
    at_least: int = 0,
) -> list[StepCostSample]:
    """Measure ``points`` in order while the budget lasts; return what was measured.

    The budget counts from ``start`` (a ``clock()`` reading; None: now). The first
    ``at_least`` points are measured whatever the budget (a table needs some points).
    After them a point is started only if it is predicted to end within the budget:
    its cost is predicted by the cheapest measured point at least as large in both
    dimensions (the coarse order measures the largest corner early); a point with no
    such predictor is started while any budget is left. ``agree`` makes every rank
    take the first rank's decision.
    """
    samples: list[StepCostSample] = []
    took: dict[tuple[int, int], float] = {}
    start = clock() if start is None else start
    for i, (bs, ctx) in enumerate(points):
        elapsed = clock() - start
        larger = [t for (b, c), t in took.items() if b >= bs and c >= ctx]
        predicted = min(larger) if larger else 0.0
        if i >= at_least and not agree(elapsed < budget_seconds and elapsed + predicted <= budget_seconds):
            break
        began = clock()
        samples += measure(bs, ctx)
        took[(bs, ctx)] = clock() - began
    return samples


def pipelined_step_seconds(step: Callable[[], object], device, *, warmup: int, repeats: int) -> float:
    """Median time of ``repeats`` runs of ``step`` queued back to back on ``device``,
    after ``warmup`` untimed ones: each run is bracketed by its own events, with no
    sync between runs (one at the end: start-up only).

    Serving overlaps a step's host work with the previous step's device work (the
    overlap scheduler), so a step costs the larger of the two, not their sum; queued
    back to back, each run's events measure just that. Steps timed one by one between
    syncs add the host's launch work to each: on the H200 that put the plain step
    11-14% above what a server without speculation took per step, the speculative one
    0-5% (benchmarks/results/h200-decision-20261202-logs/), and the policy speculated
    where plain decode was faster. The median drops a stalled run (on a loaded CPU one
    run of three took 14x the others and the table sent an agreeing pair plain)."""
    for _ in range(warmup):
        step()
    timers = []
    for _ in range(max(1, repeats)):
        timer = DeviceTimer.start(device)  # runs on the device once the work before it has
        step()
        timer.stop()
        timers.append(timer)
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return statistics.median(t.seconds() for t in timers)


def _mode_steps(spec_worker, plain_graph, synthetic, last: dict) -> dict[str, Callable[[], None]]:
    """One step of each mode on ``synthetic``'s batch; each keeps its result in ``last``."""

    decoder = PlainDecoder.of(spec_worker)

    def plain():
        last["plain"] = run_plain_decode(decoder, synthetic.next_batch(), plain_graph).result

    def spec():
        last["spec"] = compat.run_speculative_decode(spec_worker, synthetic.next_batch())

    return {"plain": plain, "spec": spec}


def measure_point(
    spec_worker,
    plain_graph,
    batch_size: int,
    context_len: int,
    *,
    warmup: int,
    repeats: int,
    eager_steps: list | None = None,
) -> list[StepCostSample]:
    """Both modes at one point, on one synthetic batch (built, then put back).
    ``eager_steps`` collects ``(mode, batch_size, context_len)`` of the modes whose
    last step replayed no CUDA graph where one was expected (the plain graph, when
    given, for ``plain``; the target's verify graph for ``spec``)."""
    last = {}
    samples = []
    with compat.synthetic_decode_batch(spec_worker, batch_size, context_len) as synthetic:
        steps = _mode_steps(spec_worker, plain_graph, synthetic, last)
        for mode in MODES:
            seconds = pipelined_step_seconds(steps[mode], spec_worker.device, warmup=warmup, repeats=repeats)
            samples.append(StepCostSample(mode, batch_size, context_len, seconds))
    if eager_steps is not None:
        expected = ("plain", "spec") if plain_graph is not None else ("spec",)
        eager_steps += [(m, batch_size, context_len) for m in expected if not last[m].can_run_cuda_graph]
    return samples


def warm_up(spec_worker, plain_graph, points: Sequence[tuple[int, int]], steps: int) -> None:
    """``steps`` (at least one) untimed steps of both modes at each point, before any
    point is timed.

    The first steps of a new batch shape build what SGLang builds lazily: Triton
    kernels on CUDA (its graphs replay kernels already built), and on the CPU the
    ``torch.compile``'d draft helpers, compiled again when a batch of several requests
    follows one of a single request (size 1 is specialised), seconds each on a small
    machine. Warming up every batch size of the grid once, at the shortest context,
    keeps those compilations out of the timed steps of every point.
    """
    last = {}
    for bs, ctx in points:
        with compat.synthetic_decode_batch(spec_worker, bs, ctx) as synthetic:
            for step in _mode_steps(spec_worker, plain_graph, synthetic, last).values():
                for _ in range(max(1, steps)):
                    step()


def measure_step_costs(
    spec_worker,
    plain_graph,
    batch_sizes: Sequence[int],
    context_lens: Sequence[int],
    *,
    warmup: int = 2,
    repeats: int = 3,
    budget_seconds: float | None = None,
    agree: Callable[[object], object] = compat.agree_across_tensor_parallel_ranks,
) -> list[StepCostSample]:
    """Time a plain and a speculative decode step at each grid point, coarse to fine,
    until ``budget_seconds`` is spent (None: ``SGLANG_DYNSPEC_CALIBRATE_SECONDS``, else
    15 s; the first rank's clock decides); return the samples measured (two per point).

    ``plain_graph``: the plain decode graph (``PlainGraph``) the plain steps
    replay, or None (eager, as the worker runs them then). Batch sizes beyond the
    request pool, the max running requests or the largest captured decode graph are
    left out, and contexts are capped at the model's (:class:`StepLimits`): such steps
    would not run as serving runs them. Every batch size is warmed up first
    (:func:`warm_up`, inside the budget: on the H200 the warm-up outside it took the
    start-up timing to 24.7 s against 15, benchmarks/results/h200-20261202-decision-smoke/).
    The four corners of the grid are measured even when the warm-up spent the budget.
    Every TP rank must call this at the same point.
    """
    if budget_seconds is None:
        budget_seconds = budget_from_environ()
    started = time.monotonic()  # the budget covers the warm-up too
    limits = step_limits(spec_worker, plain_graph)
    points = agree(measurement_order(limits.batch_sizes(batch_sizes), limits.context_lens(context_lens)))
    if points:
        shortest = min(ctx for _, ctx in points)
        warm_up(spec_worker, plain_graph, [(bs, shortest) for bs in sorted({bs for bs, _ in points})], warmup)
    eager_steps = []
    samples = run_within_budget(
        points,
        lambda bs, ctx: measure_point(
            spec_worker, plain_graph, bs, ctx, warmup=warmup, repeats=repeats, eager_steps=eager_steps
        ),
        budget_seconds,
        agree=agree,
        start=started,
        at_least=CORNERS,
    )
    if limits.graph_batch_sizes is not None and eager_steps:
        # Serving would replay a graph at these sizes: the costs measured are not serving's.
        logger.warning(
            "[sglang-dynspec] step-cost calibration: %d steps ran without their CUDA graph (mode, batch, "
            "context): %s",
            len(eager_steps),
            eager_steps[:8],
        )
    return samples


def format_step_costs(samples: Sequence[StepCostSample], seconds: float) -> str:
    """The samples as one log block: per context length, the plain and spec
    milliseconds per batch size (``-`` where the budget left a point out)."""
    by_point = {(s.mode, s.batch_size, s.context_len): s.seconds for s in samples}
    batch_sizes = sorted({s.batch_size for s in samples})
    context_lens = sorted({s.context_len for s in samples})
    points = len({(s.batch_size, s.context_len) for s in samples})
    lines = [
        f"[sglang-dynspec] step costs, ms per decode step ({points} points, calibrated in {seconds:.1f} s):"
    ]
    for ctx in context_lens:
        lines.append(f"  context {ctx:>6} | batch {''.join(f'{bs:>9}' for bs in batch_sizes)}")
        for mode in MODES:
            cells = "".join(
                f"{by_point[(mode, bs, ctx)] * 1e3:>9.3f}" if (mode, bs, ctx) in by_point else f"{'-':>9}"
                for bs in batch_sizes
            )
            lines.append(f"  {'':14} | {mode:<5} {cells}")
    return "\n".join(lines)
