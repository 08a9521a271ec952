"""Pure statistics for the benchmark: no I/O, no asyncio, no third-party imports.

Everything here works on :class:`RequestTrace` objects (what one streamed
request looked like on the client) and on plain lists of numbers, so it can be
unit-tested with hand-made inputs.

Conventions
-----------
*TTFT* is the time from sending the request to the first chunk that carries at
least one output token.

*Inter-token latency (ITL)* follows SGLang's own ``bench_serving``
(``sglang/benchmark/serving.py``, ``async_request_sglang_generate``, identical
in 0.5.17 and 0.5.23): tokens that arrive in the first chunk contribute to TTFT
only; every later chunk that brings ``n >= 1`` new tokens (``n`` is the
increase of the cumulative ``meta_info.completion_tokens``) contributes ``n``
ITL values, each equal to ``gap / n`` where ``gap`` is the time since the
previous token-carrying chunk.  Chunks that bring no new token are ignored and
do not reset the gap.  With speculative decoding a verify step that accepts 3
tokens arriving 30 ms after the previous chunk therefore yields three 10 ms
ITLs.  Percentiles are taken over the pooled ITLs of all requests, as
``bench_serving`` does.

*Chunk gap* is the raw time between two consecutive token-carrying chunks of
one request, not divided by the number of tokens.  With SGLang's default
``--stream-interval 1`` one chunk is sent per decode forward step, so the
chunk gap is what a user perceives as a stall; the ramp uses it to measure the
pause around a speculation on/off switch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from .fmt import ms


@dataclass
class RequestTrace:
    """Client-side record of one streamed ``/generate`` request.

    All times are seconds on one monotonic clock (``time.perf_counter``), or
    seconds since the start of a run once shifted with :meth:`shifted`.
    """

    start: float
    #: ``(arrival_time, new_tokens)`` for every chunk that carried >= 1 token.
    chunks: list[tuple[float, int]] = field(default_factory=list)
    end: float | None = None
    #: last ``meta_info.spec_accept_length`` seen in the stream, if any.
    accept_length: float | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.end is not None

    @property
    def output_tokens(self) -> int:
        return sum(n for _, n in self.chunks)

    @property
    def ttft(self) -> float | None:
        return self.chunks[0][0] - self.start if self.chunks else None

    @property
    def latency(self) -> float | None:
        return None if self.end is None else self.end - self.start

    def itls(self) -> list[float]:
        """Per-token ITLs of this request (see module docstring)."""
        out: list[float] = []
        for (t_prev, _), (t, n) in zip(self.chunks, self.chunks[1:]):
            out.extend([(t - t_prev) / n] * n)
        return out

    def chunk_gaps(self) -> list[tuple[float, float]]:
        """``(t_prev, t)`` intervals between consecutive token-carrying chunks."""
        return [(a[0], b[0]) for a, b in zip(self.chunks, self.chunks[1:])]

    def shifted(self, t0: float) -> RequestTrace:
        """Copy with every time expressed relative to ``t0``."""
        return RequestTrace(
            start=self.start - t0,
            chunks=[(t - t0, n) for t, n in self.chunks],
            end=None if self.end is None else self.end - t0,
            accept_length=self.accept_length,
            error=self.error,
        )


def add_chunk(trace: RequestTrace, t: float, completion_tokens: int) -> int:
    """Record a chunk whose cumulative token count is ``completion_tokens``.

    Returns the number of new tokens (0 if the chunk brought none, in which
    case nothing is recorded -- SGLang repeats the count on e.g. the final
    chunk of some code paths).
    """
    n = completion_tokens - trace.output_tokens
    if n > 0:
        trace.chunks.append((t, n))
        return n
    return 0


# ---------------------------------------------------------------------------
# Basic statistics
# ---------------------------------------------------------------------------


def percentile(values: Iterable[float], q: float) -> float | None:
    """``q``-th percentile (0..100) with linear interpolation between closest
    ranks -- the same definition as ``numpy.percentile``'s default, so numbers
    agree with ``bench_serving``.  Returns ``None`` for no values."""
    xs = sorted(values)
    if not xs:
        return None
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be within [0, 100], got {q}")
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def median(values: Iterable[float]) -> float | None:
    return percentile(values, 50.0)


def mean(values: Iterable[float]) -> float | None:
    xs = list(values)
    return sum(xs) / len(xs) if xs else None


# ---------------------------------------------------------------------------
# Sweep point summary
# ---------------------------------------------------------------------------


def summarize_point(traces: Sequence[RequestTrace], wall_s: float) -> dict[str, object]:
    """Throughput and latency statistics of one closed-loop sweep point.

    ``wall_s`` is the time from the first request sent to the last one
    finished.  Only successful requests enter the statistics; failed ones are
    counted in ``num_errors``.
    """
    ok = [t for t in traces if t.ok]
    output_tokens = sum(t.output_tokens for t in ok)
    itls = [x for t in ok for x in t.itls()]
    ttfts = [t.ttft for t in ok if t.ttft is not None]
    per_req = [t.output_tokens / t.latency for t in ok if t.latency and t.latency > 0]
    accept = [t.accept_length for t in ok if t.accept_length is not None]
    return {
        "num_requests": len(ok),
        "num_errors": len(traces) - len(ok),
        "output_tokens": output_tokens,
        "wall_s": wall_s,
        "output_tok_s": output_tokens / wall_s if wall_s > 0 else None,
        "per_request_tok_s": mean(per_req),
        "ttft_p50_ms": ms(percentile(ttfts, 50)),
        "ttft_p99_ms": ms(percentile(ttfts, 99)),
        # One request the server left queued for a whole wave shows here and
        # nowhere else (1 of 512 is below p99): benchmarks/results/h100-20261207d-d03009e.
        "ttft_max_ms": ms(max(ttfts, default=None)),
        "itl_p50_ms": ms(percentile(itls, 50)),
        "itl_p99_ms": ms(percentile(itls, 99)),
        "itl_mean_ms": ms(mean(itls)),
        "accept_length": mean(accept),
    }


# ---------------------------------------------------------------------------
# Ramp: switches and the gaps around them
# ---------------------------------------------------------------------------


@dataclass
class ObservedSwitch:
    """A mode switch located between two metric polls.

    The plugin switched at some instant in ``[t_lo, t_hi]`` (the times of the
    two polls whose counters differ); ``count`` is how many switches towards
    ``to`` happened in that interval (normally 1).
    """

    t_lo: float
    t_hi: float
    to: str
    count: int = 1


def detect_switches(samples: Sequence[dict[str, object]]) -> list[ObservedSwitch]:
    """Switches from consecutive metric samples.

    Each sample is a dict with ``t`` and optionally ``switches_to_plain``,
    ``switches_to_spec`` (cumulative counters) and ``mode``.  A switch is
    reported when a counter increments between two samples.  If a server does
    not export the counters but does export the mode gauge, a change of
    ``mode`` is used instead.  A counter that goes backwards (server restart)
    is treated as a reset, not as a switch.
    """
    out: list[ObservedSwitch] = []
    prev = None
    for s in samples:
        if prev is not None:
            found = False
            for key, to in (("switches_to_plain", "plain"), ("switches_to_spec", "spec")):
                a, b = prev.get(key), s.get(key)
                if a is not None and b is not None:
                    found = True
                    d = int(round(float(b) - float(a)))
                    if d > 0:
                        out.append(ObservedSwitch(prev["t"], s["t"], to, d))
            if not found:
                a, b = prev.get("mode"), s.get("mode")
                if a is not None and b is not None and a != b:
                    out.append(ObservedSwitch(prev["t"], s["t"], "spec" if b else "plain"))
        prev = s
    return out


def gaps_overlapping(traces: Iterable[RequestTrace], lo: float, hi: float) -> list[float]:
    """Chunk gaps (seconds) of all requests whose interval overlaps [lo, hi].

    A gap ``(a, b)`` overlaps when ``a < hi`` and ``b > lo``: the request was
    waiting for its next chunk at some time in the window.  This is what
    catches a stall caused by a switch: whichever requests were in flight
    while the switch happened have one long gap that spans it.
    """
    return [b - a for tr in traces for a, b in tr.chunk_gaps() if a < hi and b > lo]


def gaps_ending_within(traces: Iterable[RequestTrace], lo: float, hi: float) -> list[float]:
    """Chunk gaps whose end time lies in [lo, hi] (for local step medians)."""
    return [b - a for tr in traces for a, b in tr.chunk_gaps() if lo <= b <= hi]


def analyze_switch(
    traces: Sequence[RequestTrace],
    sw: ObservedSwitch,
    pad_s: float,
    local_window_s: float,
    global_median_step_s: float | None,
) -> dict[str, object]:
    """Gap statistics around one switch.

    * ``max_gap_ms_near_switch``: the longest chunk gap overlapping
      ``[t_lo - pad_s, t_hi + pad_s]``.
    * ``local_median_step_ms``: median chunk gap ending within
      ``local_window_s`` of the switch.  The step time itself changes with
      the batch size, and switches happen exactly when the batch size
      changes, so the local median is the fairer yardstick.
    * ``gap_ratio`` = max gap / local median (global median if no local gap).
    """
    near = gaps_overlapping(traces, sw.t_lo - pad_s, sw.t_hi + pad_s)
    local = gaps_ending_within(traces, sw.t_lo - local_window_s, sw.t_hi + local_window_s)
    max_gap = max(near) if near else None
    local_med = median(local)
    ref = local_med if local_med else global_median_step_s
    return {
        "max_gap_ms_near_switch": ms(max_gap),
        "num_gaps_near_switch": len(near),
        "local_median_step_ms": ms(local_med),
        "median_step_ms": ms(global_median_step_s),
        "gap_ratio": (max_gap / ref) if (max_gap is not None and ref) else None,
        "gap_ratio_global": (
            max_gap / global_median_step_s if (max_gap is not None and global_median_step_s) else None
        ),
    }


def median_step(traces: Iterable[RequestTrace]) -> float | None:
    """Median chunk gap over all requests (seconds): the typical decode step
    as seen by a client when one chunk is streamed per forward step."""
    return median(b - a for tr in traces for a, b in tr.chunk_gaps())
