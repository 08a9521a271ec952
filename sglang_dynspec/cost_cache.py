"""The start-up step-cost table: measured once per setup, cached on disk, agreed across ranks.

Pure Python (no torch, no SGLang): the measurement and the agreement are injected.
A table is valid for one GPU, target and draft model configuration, SGLang and plugin
version, speculative configuration and parallel layout: ``key`` names them (the worker
builds it, ``compat.step_cost_key``), and the file is ``<cache dir>/<sha256 of key>.json``
with the key inside, so a stale or foreign file is never used. The cache directory is
``SGLANG_DYNSPEC_COST_CACHE`` (``config.COST_CACHE_ENV``; ``off`` disables it).

With tensor parallelism every rank must run the same forwards (they hold collectives),
so the first rank alone reads the cache and its answer is handed to every rank; if it
has no table, every rank measures, and the first rank's table is handed to all and
written.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from sglang_dynspec.cost_model import StepCost, StepCostTable

logger = logging.getLogger("sglang_dynspec")

FORMAT = 1


def cache_file(directory: Path, key: Mapping) -> Path:
    digest = hashlib.sha256(json.dumps({"format": FORMAT, **key}, sort_keys=True).encode()).hexdigest()
    return Path(directory) / f"step-costs-{digest[:24]}.json"


def read_cached(directory: Path | None, key: Mapping) -> StepCostTable | None:
    """The cached table for ``key``, or None (no cache, no file, another key, unreadable)."""
    if directory is None:
        return None
    path = cache_file(directory, key)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        logger.warning("[sglang-dynspec] ignoring unreadable step-cost cache %s (%s)", path, e)
        return None
    if data.get("format") != FORMAT or data.get("key") != json.loads(json.dumps(dict(key))):
        return None
    try:
        return StepCostTable.from_rows(data["rows"])
    except (KeyError, TypeError, ValueError) as e:
        logger.warning("[sglang-dynspec] ignoring malformed step-cost cache %s (%s)", path, e)
        return None


def write_cached(directory: Path | None, key: Mapping, table: StepCostTable) -> Path | None:
    """Write atomically (a temporary file renamed into place); None if there is no cache
    or it cannot be written (logged: the server runs on, it measures again next time)."""
    if directory is None:
        return None
    path = cache_file(directory, key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            json.dump({"format": FORMAT, "key": dict(key), "rows": table.as_rows()}, f, indent=1)
        os.replace(f.name, path)
    except OSError as e:
        logger.warning("[sglang-dynspec] cannot write the step-cost cache %s (%s)", path, e)
        return None
    return path


@dataclass(frozen=True)
class StartupCosts:
    table: StepCostTable
    cache_hit: bool
    seconds: float  # time spent getting it (reading, or measuring)


def startup_costs(
    key: Mapping,
    directory: Path | None,
    measure: Callable[[], Iterable[StepCost]],
    agree: Callable[[object], object],
    first_rank: bool,
    clock: Callable[[], float] = time.perf_counter,
) -> StartupCosts:
    """The step-cost table for ``key``: cached, else measured; the same on every rank."""
    start = clock()
    cached = read_cached(directory, key) if first_rank else None
    rows = agree(None if cached is None else cached.as_rows())
    if rows is not None:
        return StartupCosts(StepCostTable.from_rows(rows), True, clock() - start)
    measured = StepCostTable.from_points(measure())
    table = StepCostTable.from_rows(agree(measured.as_rows()))
    # A table the time budget cut short is cached too: the cost model interpolates the
    # points left out, and a restart must not pay the timing again (on the H200 the
    # 15 s budget measures 37 of 40 points).
    if first_rank:
        write_cached(directory, key, table)
    return StartupCosts(table, False, clock() - start)


def format_table(table: StepCostTable) -> str:
    """The table as log lines: per context length, milliseconds per batch size and mode."""
    lines = []
    for context in sorted({p.context_len for p in table.points}):
        points = [p for p in table.points if p.context_len == context]
        sizes = sorted({p.batch_size for p in points})
        lines.append(f"  context {context:>6}  batch " + " ".join(f"{b:>7}" for b in sizes))
        for mode in sorted({p.mode for p in points}, key=lambda m: m.value):
            by_size = {p.batch_size: p.seconds for p in points if p.mode is mode}
            cells = " ".join(f"{by_size[b] * 1e3:7.2f}" if b in by_size else "      -" for b in sizes)
            lines.append(f"  {mode.value:>14} ms " + cells)
    return "\n".join(lines)
