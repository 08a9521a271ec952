"""JSON-lines result files: the record kinds, their required keys, reading and
writing.

Every line of a results file is one JSON object with a ``kind``:

``sweep_point``
    one closed-loop measurement (``sweep``), see :data:`SWEEP_POINT_KEYS`;
``sample`` / ``switch`` / ``ramp_step`` / ``ramp_summary``
    the timeline of a load ramp (``ramp``), see the ``RAMP_*_KEYS`` below.

Files are appended to by default so that several server configurations can be
collected into one file and plotted together.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
from collections.abc import Iterator, Sequence
from typing import IO

SWEEP_POINT_KEYS = (
    "kind",
    "config",
    "concurrency",
    "repeat",
    "output_tok_s",
    "per_request_tok_s",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "ttft_max_ms",
    "itl_p50_ms",
    "itl_p99_ms",
    "num_requests",
    "output_tokens",
    "wall_s",
    "accept_length",
    "sglang",
    "date",
    "prompt_len",
    "output_len",
)

RAMP_SAMPLE_KEYS = (
    "kind",
    "t",
    "mode",
    "steps_spec",
    "steps_plain",
    "switches_to_plain",
    "switches_to_spec",
    "num_running_reqs",
    "concurrency",
)

RAMP_SWITCH_KEYS = ("kind", "t", "to", "max_gap_ms_near_switch", "median_step_ms")

RAMP_SUMMARY_KEYS = (
    "kind",
    "config",
    "sglang",
    "date",
    "num_switches",
    "worst_gap_ratio",
    "median_step_ms",
)

#: Keys a ``--tag`` may not overwrite.
RESERVED_KEYS = frozenset(
    SWEEP_POINT_KEYS
    + RAMP_SAMPLE_KEYS
    + RAMP_SWITCH_KEYS
    + RAMP_SUMMARY_KEYS
    + ("run_id", "url", "model", "speculative_algorithm", "prompt_mode", "num_errors")
)


def utc_now_iso() -> str:
    """Current UTC time as ``2025-01-31T12:34:56Z``."""
    now = _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0)
    return now.strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_tags(items: Sequence[str] | None) -> dict[str, str]:
    """``["hw=H200", "tp=1"]`` -> ``{"hw": "H200", "tp": "1"}``.

    Values stay strings so a tag round-trips exactly as typed.
    """
    tags: dict[str, str] = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"--tag expects KEY=VALUE, got {item!r}")
        if key in RESERVED_KEYS:
            raise ValueError(f"--tag {key}=... would overwrite a measured field")
        tags[key] = value
    return tags


def _clean(v):
    # JSON has no NaN/inf; write null instead of producing an invalid file.
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    return v


class JsonlWriter:
    """Append-or-truncate JSONL writer that flushes after every record, so a
    crashed or interrupted run keeps everything measured so far."""

    def __init__(self, path: str, overwrite: bool = False):
        self.path = path
        parent = os.path.dirname(os.path.abspath(path))
        os.makedirs(parent, exist_ok=True)
        self._f: IO[str] = open(path, "w" if overwrite else "a", encoding="utf-8")

    def write(self, record: dict[str, object]) -> None:
        self._f.write(json.dumps(_clean(record), allow_nan=False) + "\n")
        self._f.flush()

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()

    def __enter__(self) -> JsonlWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_jsonl(path: str) -> Iterator[dict[str, object]]:
    """Yield the objects of a JSONL file; blank lines are skipped, a malformed
    line raises ``ValueError`` naming the file and line number."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object")
            yield obj
