"""``ramp``: step the offered concurrency up and down while watching the mode.

The load follows ``--steps`` (default 1,2,4,...,128,...,2,1).  Each step is
held for ``--hold-s`` seconds or, with ``--hold-requests N``, until N requests
finished during the step.  When the target concurrency drops, surplus workers
finish their current request and stop (nothing is cancelled), so the number of
requests in flight follows the target closely.

Meanwhile ``/metrics`` is polled every ``--poll-s`` seconds.  Every poll
becomes a ``sample`` line (written immediately, so an interrupted ramp keeps
its timeline).  Afterwards the tool locates the mode switches (a
``switches_total`` counter incremented between two polls; a change of the
mode gauge if the server has no counters) and, for each, reports the longest
chunk gap of any request in flight across it:

* ``max_gap_ms_near_switch``: longest gap between two consecutive
  token-carrying chunks of one request whose interval overlaps
  ``[t_lo - pad, t_hi + pad]`` (``t_lo``/``t_hi`` = the bracketing polls,
  ``pad`` = ``--switch-pad-s``);
* ``median_step_ms``: median chunk gap over the whole ramp.  With SGLang's
  default ``--stream-interval 1`` one chunk is streamed per decode forward
  step, so the chunk gap is the step time as the client sees it.  (The
  per-token ITL would divide a speculative step by the accept length and
  exaggerate ratios; ``median_itl_ms`` is still reported in the summary.)
* ``local_median_step_ms``: median chunk gap within ``--local-window-s`` of
  the switch -- step time depends on batch size, which is changing at that
  very moment, so ``gap_ratio`` uses this local median when available.

The summary's ``worst_gap_ratio`` is the largest ``gap_ratio`` of all
switches: ~1-2 means switching is seamless, much larger means requests
stalled while the server switched.  Switches coincide with load steps, and a
step up stalls running requests on any server (prefill of the newcomers), so
each ``ramp_step`` also reports ``max_gap_ms_near_start``; compare with the
same ramp against a baseline server before blaming the switch.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
import uuid

from tqdm import tqdm

from . import client
from .fmt import fmt, ms
from .records import JsonlWriter, utc_now_iso
from .scrape import MetricsPoller, MetricsSnapshot
from .stats import (
    RequestTrace,
    analyze_switch,
    detect_switches,
    gaps_overlapping,
    median,
    median_step,
    percentile,
)


class RampLoad:
    """A pool of closed-loop workers whose size can be changed at any time.

    Worker ``i`` keeps sending requests while ``i < target``; raising the
    target starts the missing workers, lowering it lets the surplus ones exit
    after their current request.
    """

    ERROR_BACKOFF_S = 0.2

    def __init__(self, session, generate_url: str, payload_factory, on_done=None):
        self.session = session
        self.generate_url = generate_url
        self.payload_factory = payload_factory
        self.on_done = on_done
        self.target = 0
        self.in_flight = 0
        self.completed = 0
        self.traces: list[RequestTrace] = []
        self._workers: dict[int, asyncio.Task] = {}
        self._progress = asyncio.Condition()

    def set_target(self, concurrency: int) -> None:
        self.target = concurrency
        for i in range(concurrency):
            task = self._workers.get(i)
            if task is None or task.done():
                self._workers[i] = asyncio.ensure_future(self._worker(i))

    async def _worker(self, i: int) -> None:
        while i < self.target:
            self.in_flight += 1
            try:
                tr = await client.stream_generate(self.session, self.generate_url, self.payload_factory())
            finally:
                self.in_flight -= 1
            self.traces.append(tr)
            self.completed += 1
            if self.on_done is not None:
                self.on_done(tr)
            async with self._progress:
                self._progress.notify_all()
            if not tr.ok:
                # A failing server answers at once; don't spin thousands of
                # doomed requests through a time-held step.
                await asyncio.sleep(self.ERROR_BACKOFF_S)

    async def wait_completed(self, count: int) -> None:
        """Wait until ``count`` requests have finished in total."""
        async with self._progress:
            await self._progress.wait_for(lambda: self.completed >= count)

    def cancel(self) -> None:
        for task in self._workers.values():
            task.cancel()

    async def drain(self) -> None:
        """Stop starting requests and wait for the ones in flight."""
        self.target = 0
        tasks = [t for t in self._workers.values() if not t.done()]
        if tasks:
            await asyncio.gather(*tasks)


def sample_record(
    t: float, snap: MetricsSnapshot | None, concurrency: int, in_flight: int
) -> dict[str, object]:
    values = snap.as_dict() if snap is not None else MetricsSnapshot().as_dict()
    rec: dict[str, object] = {
        "kind": "sample",
        "t": round(t, 4),
        **values,
        "concurrency": concurrency,
        "in_flight": in_flight,
    }
    if snap is not None and not snap.mode_consistent:
        rec["mode_consistent"] = False
    return rec


def step_records(
    steps: list[tuple[int, float, float]],
    traces: list[RequestTrace],
    samples: list[dict[str, object]],
    pad_s: float,
) -> list[dict[str, object]]:
    """Per-step throughput, ITL and mode occupancy (one ``ramp_step`` each).

    ``max_gap_ms_near_start`` is the longest chunk gap overlapping
    ``[t_start - pad_s, t_start + pad_s]``.  Every server shows some gap when
    the load steps up (the new requests' prefill delays the running ones), so
    this is the control to compare switch gaps against -- in particular on a
    baseline or stock EAGLE-3 ramp, which has no switches.
    """
    out = []
    for conc, a, b in steps:
        near = gaps_overlapping(traces, a - pad_s, a + pad_s)
        toks = sum(n for tr in traces for t, n in tr.chunks if a <= t < b)
        itls = [
            (t - tp) / n
            for tr in traces
            for (tp, _), (t, n) in zip(tr.chunks, tr.chunks[1:])
            if a <= t < b
            for _ in range(n)
        ]
        modes = [s["mode"] for s in samples if a <= s["t"] < b and s.get("mode") is not None]
        out.append(
            {
                "kind": "ramp_step",
                "concurrency": conc,
                "t_start": round(a, 4),
                "t_end": round(b, 4),
                "output_tok_s": toks / (b - a) if b > a else None,
                "itl_p50_ms": ms(percentile(itls, 50)),
                "itl_p99_ms": ms(percentile(itls, 99)),
                "spec_sample_frac": (sum(modes) / len(modes)) if modes else None,
                "max_gap_ms_near_start": ms(max(near)) if near else None,
            }
        )
    return out


def analyze_ramp(
    samples: list[dict[str, object]],
    traces: list[RequestTrace],
    steps: list[tuple[int, float, float]],
    switch_pad_s: float,
    local_window_s: float,
) -> tuple[list[dict[str, object]], list[dict[str, object]], dict[str, object]]:
    """Turn a recorded ramp into ``ramp_step`` and ``switch`` records and the
    measured part of the ``ramp_summary``.

    ``samples`` are ``sample`` records and ``traces`` request traces, both
    with times in seconds since the ramp started; ``steps`` are
    ``(concurrency, t_start, t_end)``.  Failed requests are ignored.
    """
    ok = [tr for tr in traces if tr.ok]
    step_s = median_step(ok)
    itl_med = median(x for tr in ok for x in tr.itls())

    switch_recs = []
    for sw in detect_switches(samples):
        analysis = analyze_switch(ok, sw, switch_pad_s, local_window_s, step_s)
        at = next((s for s in samples if s["t"] >= sw.t_hi), samples[-1])
        switch_recs.append(
            {
                "kind": "switch",
                "t": round(sw.t_hi, 4),
                "t_lo": round(sw.t_lo, 4),
                "to": sw.to,
                "count": sw.count,
                **analysis,
                "concurrency": at.get("concurrency"),
                "num_running_reqs": at.get("num_running_reqs"),
            }
        )

    with_metrics = [s for s in samples if s.get("steps_spec") is not None]
    first = with_metrics[0] if with_metrics else {}
    last = with_metrics[-1] if with_metrics else {}

    def delta(key):
        a, b = first.get(key), last.get(key)
        return None if a is None or b is None else b - a

    ratios = [r for r in switch_recs if r["gap_ratio"] is not None]
    worst = max(ratios, key=lambda r: r["gap_ratio"]) if ratios else None
    summary = {
        "num_requests": len(ok),
        "num_errors": len(traces) - len(ok),
        "output_tokens": sum(tr.output_tokens for tr in ok),
        "plugin_metrics": any(s.get("mode") is not None for s in samples),
        "num_samples": len(samples),
        "num_switches": sum(r["count"] for r in switch_recs),
        "switches_to_plain": sum(r["count"] for r in switch_recs if r["to"] == "plain"),
        "switches_to_spec": sum(r["count"] for r in switch_recs if r["to"] == "spec"),
        "decode_steps_spec": delta("steps_spec"),
        "decode_steps_plain": delta("steps_plain"),
        "median_step_ms": ms(step_s),
        "median_itl_ms": ms(itl_med),
        "worst_gap_ratio": worst["gap_ratio"] if worst else None,
        "worst_gap_ratio_global": max(
            (r["gap_ratio_global"] for r in switch_recs if r["gap_ratio_global"] is not None),
            default=None,
        ),
        "worst_switch_t": worst["t"] if worst else None,
        "worst_max_gap_ms": worst["max_gap_ms_near_switch"] if worst else None,
    }
    step_recs = step_records(steps, ok, samples, switch_pad_s)
    summary["worst_step_start_gap_ms"] = max(
        (r["max_gap_ms_near_start"] for r in step_recs if r["max_gap_ms_near_start"] is not None),
        default=None,
    )
    return step_recs, switch_recs, summary


async def _drive(args, session, generate_url: str, base: str, out: JsonlWriter):
    """Run the load steps while polling; returns samples, traces (seconds
    since start), steps, poller and duration."""
    rng = random.Random(f"{args.seed}/ramp")
    first_tokens = client.FirstTokens(f"{args.seed}/ramp", args.token_range)

    def next_payload():
        return client.make_payload(
            client.make_prompt(rng, args.prompt_len, args.text, args.token_range, first_tokens),
            args.output_len,
        )

    samples: list[dict[str, object]] = []
    t0 = time.perf_counter()
    bar = tqdm(desc=f"ramp [{args.config}]", unit="req", disable=not args.progress, file=sys.stderr)
    load = RampLoad(session, generate_url, next_payload, on_done=lambda _t: bar.update(1))

    def on_sample(t: float, snap: MetricsSnapshot | None) -> None:
        rec = sample_record(t - t0, snap, load.target, load.in_flight)
        rec["config"] = args.config
        rec["run_id"] = args.run_id
        samples.append(rec)
        out.write(rec)  # written live: an interrupted ramp keeps its timeline

    poller = MetricsPoller(session, base, args.poll_s, on_sample=on_sample)
    stop = asyncio.Event()
    steps: list[tuple[int, float, float]] = []
    poll_task = asyncio.ensure_future(poller.run(stop))
    try:
        for conc in args.steps:
            a = time.perf_counter()
            bar.set_postfix(concurrency=conc)
            load.set_target(conc)
            if args.hold_requests:
                await load.wait_completed(load.completed + args.hold_requests)
            else:
                await asyncio.sleep(args.hold_s)
            steps.append((conc, a - t0, time.perf_counter() - t0))
        await load.drain()
        stop.set()
        await poll_task
    except BaseException:
        # Ctrl-C or an unexpected error: don't leave tasks running.
        poll_task.cancel()
        load.cancel()
        raise
    finally:
        bar.close()
    duration = time.perf_counter() - t0
    traces = [tr.shifted(t0) for tr in load.traces]
    return samples, traces, steps, poller, duration


async def run_ramp(args: argparse.Namespace) -> int:
    base = client.normalize_base_url(args.url)
    generate_url = base + "/generate"
    log = lambda msg: tqdm.write(msg, file=sys.stderr)  # noqa: E731
    # Ties the records of one ramp together: files are appended to, and every
    # ramp's times start at 0.
    args.run_id = uuid.uuid4().hex[:12]

    async with client.create_session(args.read_timeout_s) as session:
        info = await client.fetch_server_info(session, base)
        server = client.server_fields(info)
        with JsonlWriter(args.out, overwrite=args.overwrite) as out:
            samples, traces, steps, poller, duration = await _drive(args, session, generate_url, base, out)
            client.check_errors(traces, "the ramp", generate_url)
            step_recs, switch_recs, measured = analyze_ramp(
                samples, traces, steps, args.switch_pad_s, args.local_window_s
            )
            for rec in step_recs + switch_recs:
                out.write({"config": args.config, "run_id": args.run_id, **rec})
            summary = {
                "kind": "ramp_summary",
                "config": args.config,
                "run_id": args.run_id,
                **server,
                "date": utc_now_iso(),
                "url": base,
                "steps": list(args.steps),
                "hold_s": None if args.hold_requests else args.hold_s,
                "hold_requests": args.hold_requests,
                "poll_s": args.poll_s,
                "prompt_len": args.prompt_len,
                "output_len": args.output_len,
                "prompt_mode": "text" if args.text else "input_ids",
                "duration_s": duration,
                "metrics_endpoint": bool(poller.available),
                "num_failed_polls": poller.errors,
                **measured,
                "switch_pad_s": args.switch_pad_s,
                "local_window_s": args.local_window_s,
                **args.tags,
            }
            out.write(summary)

    if args.requests_out:
        with JsonlWriter(args.requests_out, overwrite=True) as rw:
            for tr in traces:
                rw.write(
                    {
                        "kind": "request",
                        "config": args.config,
                        "run_id": args.run_id,
                        "start": round(tr.start, 6),
                        "end": None if tr.end is None else round(tr.end, 6),
                        "chunks": [[round(t, 6), n] for t, n in tr.chunks],
                        "accept_length": tr.accept_length,
                        "error": tr.error,
                    }
                )

    if not summary["metrics_endpoint"]:
        log(f"note: {base}/metrics not available (start the server with --enable-metrics); mode: null")
    elif not summary["plugin_metrics"]:
        log("note: no sglang:spec_dynamic_* metrics (not an EAGLE3_DYNAMIC server); mode: null")
    log(
        f"[{args.config}] ramp done in {duration:.1f} s: {summary['num_requests']} requests, "
        f"{summary['num_switches']} switches, median step {fmt(summary['median_step_ms'])} ms, "
        f"worst gap/step ratio {fmt(summary['worst_gap_ratio'])}"
        f" (at t={fmt(summary['worst_switch_t'])} s)"
    )
    if summary["num_errors"]:
        first_err = next(tr.error for tr in traces if tr.error)
        log(f"  {summary['num_errors']} requests FAILED; first error: {first_err}")
    log(f"timeline written to {args.out}")
    return 0
