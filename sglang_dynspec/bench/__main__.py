"""Command line: ``python -m sglang_dynspec.bench {sweep,ramp,crossover,plot} ...``.

Examples::

    # throughput/latency at several concurrencies, 3 repeats, appended to a file
    python -m sglang_dynspec.bench sweep --url http://127.0.0.1:30000 \\
        --config dynspec --concurrency 1,4,16,32,64,128 --repeats 3 \\
        --out results.jsonl --tag hw=H200

    # load ramp 1 -> 128 -> 1 while watching the plugin's mode switches
    python -m sglang_dynspec.bench ramp --url http://127.0.0.1:30000 \\
        --config dynspec --hold-s 10 --out ramp.jsonl

    # where speculation stops paying on this server (goodput policy), per acceptance
    python -m sglang_dynspec.bench crossover --url http://127.0.0.1:30000

    # plots from one or more result files
    python -m sglang_dynspec.bench plot results.jsonl ramp.jsonl \\
        --baseline baseline --out-dir plots/
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence

from .records import parse_tags

EPILOG = """\
Servers: launch SGLang as usual; add --enable-metrics so that `ramp` (and
`sweep`'s per-mode step counts) can read the plugin's mode from /metrics.
Requests use random token ids by default, which also works with
--skip-tokenizer-init; pass --text for word prompts instead.
"""


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _bounded(cast, minimum, what: str):
    """An argparse ``type`` that parses with ``cast`` and requires ``value >= minimum``."""

    def parse(text: str):
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not value >= minimum:  # also rejects NaN
            raise argparse.ArgumentTypeError(f"expected {what} >= {minimum}, got {text!r}")
        return value

    return parse


_positive_int = _bounded(int, 1, "an integer")
_non_negative_int = _bounded(int, 0, "an integer")
_non_negative_float = _bounded(float, 0, "a number")


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return v


def _token_range(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition(":")
    try:
        lo_i, hi_i = int(lo), int(hi)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO:HI, got {text!r}") from None
    if not sep or not 0 <= lo_i < hi_i:
        raise argparse.ArgumentTypeError(f"expected LO:HI with 0 <= LO < HI, got {text!r}")
    return lo_i, hi_i


def _add_load_options(p: argparse.ArgumentParser) -> None:
    """Options shared by sweep and ramp."""
    p.add_argument("--url", required=True, help="base URL of the SGLang server, e.g. http://127.0.0.1:30000")
    p.add_argument(
        "--config",
        required=True,
        metavar="LABEL",
        help="name of the server configuration under test (e.g. baseline, "
        "eagle3, dynspec); stored in every record and used as the "
        "line label in plots",
    )
    p.add_argument(
        "--prompt-len",
        type=_positive_int,
        default=256,
        metavar="N",
        help="prompt length in tokens (default: %(default)s)",
    )
    p.add_argument(
        "--output-len",
        type=_positive_int,
        default=256,
        metavar="N",
        help="tokens generated per request; EOS is ignored so every "
        "request generates exactly this many (default: %(default)s)",
    )
    prompt = p.add_mutually_exclusive_group()
    prompt.add_argument(
        "--input-ids",
        dest="text",
        action="store_false",
        help="send random token ids as `input_ids` (default; works with --skip-tokenizer-init)",
    )
    prompt.add_argument(
        "--text",
        dest="text",
        action="store_true",
        help="send `text` made of random common English words, one word "
        "per requested prompt token (token count approximate; needs "
        "a server with a tokenizer)",
    )
    p.set_defaults(text=False)
    p.add_argument(
        "--token-range",
        type=_token_range,
        default=(1000, 32000),
        metavar="LO:HI",
        help="random token ids are drawn from [LO, HI); keep HI <= the "
        "model's vocabulary size (default: 1000:32000, valid for "
        "any vocabulary of 32k tokens or more)",
    )
    p.add_argument(
        "--seed",
        default="0",
        help="seed for the random prompts; the same seed gives the same "
        "prompts on every server (default: %(default)s)",
    )
    p.add_argument(
        "--out",
        required=True,
        metavar="FILE.jsonl",
        help="results file; records are appended (see --overwrite)",
    )
    p.add_argument("--overwrite", action="store_true", help="truncate --out instead of appending to it")
    p.add_argument(
        "--tag",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra field stored in every record, e.g. --tag hw=H200 "
        "--tag tp=1 (repeatable; values are strings)",
    )
    p.add_argument(
        "--read-timeout-s",
        type=_positive_float,
        default=600.0,
        metavar="S",
        help="fail a request whose stream stays silent this long (default: %(default)s)",
    )
    p.add_argument(
        "--no-progress", dest="progress", action="store_false", help="disable the tqdm progress bars"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m sglang_dynspec.bench",
        description="Benchmark SGLang servers with and without dynamic EAGLE-3 "
        "speculative decoding (EAGLE3_DYNAMIC).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="{sweep,ramp,plot}")
    sub.required = True

    sw = sub.add_parser(
        "sweep",
        help="closed-loop concurrency sweep against one server",
        description="Closed-loop concurrency sweep: at each concurrency C keep exactly "
        "C streamed requests in flight and write one JSON line with output "
        "tok/s, per-request tok/s, TTFT and ITL percentiles. ITL follows "
        "SGLang's bench_serving: a chunk carrying n tokens after a gap g "
        "counts as n ITLs of g/n.",
    )
    _add_load_options(sw)
    sw.add_argument(
        "--concurrency",
        type=_int_list,
        default=[1, 4, 16, 32, 64, 128],
        metavar="C1,C2,...",
        help="concurrency levels to measure (default: 1,4,16,32,64,128)",
    )
    sw.add_argument(
        "--requests-per-point",
        type=_positive_int,
        default=None,
        metavar="N",
        help="requests per measurement (default: max(W*C, 4), W from --waves)",
    )
    sw.add_argument(
        "--waves",
        type=_positive_int,
        default=2,
        metavar="W",
        help="without --requests-per-point: W waves of C requests per measurement (default: %(default)s)",
    )
    sw.add_argument(
        "--repeats",
        type=_positive_int,
        default=1,
        metavar="N",
        help="measure every concurrency N times, repeats as the outer loop (default: %(default)s)",
    )
    sw.add_argument(
        "--warmup",
        type=_non_negative_int,
        default=4,
        metavar="N",
        help="untimed requests (N in parallel) before the first point, to "
        "trigger lazy initialisation on the server (default: %(default)s)",
    )

    rp = sub.add_parser(
        "ramp",
        help="load ramp up and down, recording the mode timeline from /metrics",
        description="Step the concurrency up and down while polling /metrics, then "
        "report every speculation on/off switch with the longest "
        "inter-chunk gap of requests in flight across it.",
    )
    _add_load_options(rp)
    rp.add_argument(
        "--steps",
        type=_int_list,
        default=[1, 2, 4, 8, 16, 32, 64, 128, 64, 32, 16, 8, 4, 2, 1],
        metavar="C1,C2,...",
        help="concurrency at each step of the ramp (default: 1,2,4,...,128,...,2,1)",
    )
    hold = rp.add_mutually_exclusive_group()
    hold.add_argument(
        "--hold-s",
        type=_positive_float,
        default=10.0,
        metavar="S",
        help="seconds to hold each step (default: %(default)s)",
    )
    hold.add_argument(
        "--hold-requests",
        type=_positive_int,
        default=None,
        metavar="N",
        help="hold each step until N requests finished during it, instead of for a fixed time",
    )
    rp.add_argument(
        "--poll-s",
        type=_positive_float,
        default=0.25,
        metavar="S",
        help="/metrics polling period (default: %(default)s)",
    )
    rp.add_argument(
        "--switch-pad-s",
        type=_non_negative_float,
        default=0.5,
        metavar="S",
        help="a chunk gap counts as 'near' a switch if it overlaps the "
        "interval between the two polls that bracket the switch, "
        "widened by S on both sides (default: %(default)s)",
    )
    rp.add_argument(
        "--local-window-s",
        type=_positive_float,
        default=5.0,
        metavar="S",
        help="the local median step time of a switch is taken over chunk "
        "gaps ending within S of it (default: %(default)s)",
    )
    rp.add_argument(
        "--requests-out",
        default=None,
        metavar="FILE.jsonl",
        help="also write every request's chunk arrival times (seconds since "
        "ramp start, new tokens) to this file (overwritten)",
    )

    cr = sub.add_parser(
        "crossover",
        help="predicted crossover batch size per acceptance and context, from a server's /metrics",
        description="Read the step costs a running EAGLE3_DYNAMIC server (--enable-metrics) timed at "
        "start-up and print, per acceptance and context length, the batch size from which plain "
        "decode beats speculation (the goodput policy's own ratio).",
    )
    cr.add_argument("--plot", default=None, metavar="FILE.png", help="also draw it (needs matplotlib)")
    cr.add_argument("--url", default="http://127.0.0.1:30000", help="server base URL (default: %(default)s)")
    cr.add_argument(
        "--acceptance",
        type=lambda t: [float(x) for x in t.split(",")],
        default=[1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0],
        help="comma-separated acceptances (tokens per speculative step) to report",
    )
    cr.set_defaults(tag=[])

    pl = sub.add_parser(
        "plot",
        help="PNG plots from results files (needs matplotlib)",
        description="Write PNG plots from sweep and ramp result files: output tok/s vs "
        "concurrency per config (min/max band over repeats), the ratio to a "
        "baseline config, and one timeline per ramp config.",
    )
    pl.add_argument(
        "files", nargs="+", metavar="RESULTS.jsonl", help="results files written by sweep and/or ramp"
    )
    pl.add_argument(
        "--out-dir", default="plots", metavar="DIR", help="directory for the PNG files (default: %(default)s)"
    )
    pl.add_argument(
        "--baseline",
        default="baseline",
        metavar="LABEL",
        help="config label the ratio plot divides by (default: %(default)s); "
        "skipped if no such config is in the files",
    )
    pl.add_argument("--dpi", type=_positive_int, default=120, help="PNG resolution")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)

    if args.command == "plot":
        from .plot import PlotError, run_plot

        try:
            written = run_plot(args.files, args.out_dir, baseline=args.baseline, dpi=args.dpi)
        except PlotError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        for path in written:
            print(path)
        return 0

    # Imported here so that `plot` works without aiohttp installed.
    from .client import BenchmarkError, ServerUnreachable, normalize_base_url

    try:
        args.tags = parse_tags(args.tag)
        args.url = normalize_base_url(args.url)
    except ValueError as e:
        parser.error(str(e))

    if args.command == "crossover":
        from .crossover import run_crossover as run
    elif args.command == "sweep":
        if args.requests_per_point is not None and args.requests_per_point < max(args.concurrency):
            parser.error(
                f"--requests-per-point {args.requests_per_point} is below concurrency "
                f"{max(args.concurrency)}: that point could never have all its requests "
                "in flight"
            )
        from .sweep import run_sweep as run
    else:
        from .ramp import run_ramp as run
    try:
        return asyncio.run(run(args))
    except (ServerUnreachable, BenchmarkError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; records written so far are kept", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
