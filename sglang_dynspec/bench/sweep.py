"""``sweep``: closed-loop throughput/latency at a list of concurrency levels.

For every repeat and every concurrency ``C`` the sweep sends
``--requests-per-point`` requests (default ``max(2*C, 4)``) keeping exactly
``C`` in flight, then writes one ``sweep_point`` JSON line.  Repeats form the
outer loop, so slow drift of the machine (clocks, thermals, other tenants)
spreads over all points instead of biasing the last ones.

If the server exports the EAGLE3_DYNAMIC metrics, the decode steps taken in
each mode during the point are recorded too (``decode_steps_spec``,
``decode_steps_plain``, ``spec_step_frac``), which shows directly at which
concurrency the plugin stopped speculating.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import uuid

import aiohttp
from tqdm import tqdm

from . import client
from .fmt import fmt
from .records import JsonlWriter, utc_now_iso
from .scrape import MetricsSnapshot, fetch_metrics
from .stats import summarize_point


def requests_for(concurrency: int, requests_per_point: int | None, waves: int = 2) -> int:
    """Default: ``waves`` full waves of ``C`` requests, at least 4 requests."""
    if requests_per_point is not None:
        return requests_per_point
    return max(waves * concurrency, 4)


def _delta(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else b - a


def mode_fields(before: MetricsSnapshot | None, after: MetricsSnapshot | None) -> dict[str, object]:
    """Decode steps per mode taken during one point (``None`` without metrics)."""
    if before is None or after is None:
        spec = plain = None
    else:
        spec = _delta(before.steps_spec, after.steps_spec)
        plain = _delta(before.steps_plain, after.steps_plain)
    total = (spec or 0) + (plain or 0)
    return {
        "decode_steps_spec": spec,
        "decode_steps_plain": plain,
        "spec_step_frac": (spec / total) if spec is not None and total > 0 else None,
    }


def catch_up_fields(before: MetricsSnapshot | None, after: MetricsSnapshot | None, wall_s: float) -> dict:
    """The draft catch-ups of one point, from the plugin's metrics: how many, the
    positions replayed, their device time and its share of the point's wall time (an
    upper bound on their share of plain-decode time when every step ran plain)."""
    if before is None or after is None or after.catch_up_seconds_sum is None:
        return {}
    seconds = _delta(before.catch_up_seconds_sum, after.catch_up_seconds_sum)
    timed = _delta(before.catch_up_timed, after.catch_up_timed)
    return {
        "catch_ups": _delta(sum((before.catch_ups or {}).values()), sum((after.catch_ups or {}).values())),
        "catch_up_positions": _delta(before.catch_up_tokens, after.catch_up_tokens),
        "catch_up_s": seconds,
        "catch_up_ms_mean": 1e3 * seconds / timed if seconds is not None and timed else None,
        "catch_up_share": seconds / wall_s if seconds is not None and wall_s > 0 else None,
    }


async def _metrics_or_none(session, base_url) -> MetricsSnapshot | None:
    try:
        snap = await fetch_metrics(session, base_url)
    except (asyncio.TimeoutError, aiohttp.ClientError, ValueError):
        return None  # metrics are a bonus here; never fail a sweep for them
    return snap if snap is not None and snap.steps_spec is not None else None


async def run_sweep(args: argparse.Namespace) -> int:
    base = client.normalize_base_url(args.url)
    generate_url = base + "/generate"
    prompt_mode = "text" if args.text else "input_ids"
    log = lambda msg: tqdm.write(msg, file=sys.stderr)  # noqa: E731
    run_id = uuid.uuid4().hex[:12]  # groups the points of one invocation

    async with client.create_session(args.read_timeout_s) as session:
        info = await client.fetch_server_info(session, base)
        server = client.server_fields(info)
        if info is None:
            log(f"note: {base} has no /server_info; 'sglang' will be null")
        use_metrics = await _metrics_or_none(session, base) is not None
        # One sequence of first tokens for the whole run (warmup and every point):
        # no prompt of the run shares a first token with another (client.FirstTokens).
        first_tokens = client.FirstTokens(args.seed, args.token_range)

        if args.warmup > 0:
            payloads = client.make_payloads(
                args.warmup,
                args.prompt_len,
                args.output_len,
                args.text,
                args.token_range,
                f"{args.seed}/warmup",
                first_tokens,
            )
            with tqdm(
                total=len(payloads), desc="warmup", leave=False, disable=not args.progress, file=sys.stderr
            ) as bar:
                traces, _ = await client.run_closed_loop(
                    session,
                    generate_url,
                    payloads,
                    args.warmup,
                    on_done=lambda _t: bar.update(1),
                )
            client.check_errors(traces, "the warmup", generate_url)

        with JsonlWriter(args.out, overwrite=args.overwrite) as out:
            for repeat in range(args.repeats):
                for conc in args.concurrency:
                    n = requests_for(conc, args.requests_per_point, args.waves)
                    # Seed per (point, repeat): identical across configs so
                    # servers are compared on the same prompts, distinct
                    # across points so no point reuses another's KV cache.
                    payloads = client.make_payloads(
                        n,
                        args.prompt_len,
                        args.output_len,
                        args.text,
                        args.token_range,
                        f"{args.seed}/c{conc}/r{repeat}",
                        first_tokens,
                    )
                    before = await _metrics_or_none(session, base) if use_metrics else None
                    with tqdm(
                        total=n,
                        desc=f"C={conc} repeat {repeat}",
                        leave=False,
                        disable=not args.progress,
                        file=sys.stderr,
                    ) as bar:
                        traces, wall = await client.run_closed_loop(
                            session,
                            generate_url,
                            payloads,
                            conc,
                            on_done=lambda _t: bar.update(1),
                        )
                    after = await _metrics_or_none(session, base) if use_metrics else None
                    client.check_errors(traces, f"concurrency {conc}", generate_url)

                    stats = summarize_point(traces, wall)
                    record = {
                        "kind": "sweep_point",
                        "config": args.config,
                        "run_id": run_id,
                        "concurrency": conc,
                        "repeat": repeat,
                        **stats,
                        **server,
                        **mode_fields(before, after),
                        **catch_up_fields(before, after, wall),
                        "date": utc_now_iso(),
                        "prompt_len": args.prompt_len,
                        "output_len": args.output_len,
                        "prompt_mode": prompt_mode,
                        "url": base,
                        **args.tags,
                    }
                    out.write(record)
                    errors = f", {stats['num_errors']} FAILED" if stats["num_errors"] else ""
                    log(
                        f"[{args.config}] C={conc:<4d} repeat {repeat}: "
                        f"{fmt(stats['output_tok_s'], '.1f')} tok/s, "
                        f"{fmt(stats['per_request_tok_s'], '.1f')} tok/s/req, "
                        f"ITL p50 {fmt(stats['itl_p50_ms'], '.2f')} ms, "
                        f"TTFT p50 {fmt(stats['ttft_p50_ms'], '.1f')} ms, "
                        f"accept {fmt(stats['accept_length'], '.2f')}{errors}"
                    )
                    if stats["num_errors"]:
                        first = next(t.error for t in traces if t.error)
                        log(f"  first error: {first}")
    log(f"results appended to {args.out}" if not args.overwrite else f"results written to {args.out}")
    return 0
