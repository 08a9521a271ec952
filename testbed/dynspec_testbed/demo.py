"""CPU demo: EAGLE3_DYNAMIC switching under a load ramp, checked against a plain server.

    python -m dynspec_testbed.demo [--work-dir DIR] [--threshold N]

On any machine with a few CPU cores and no GPU, in a few minutes, it:

1. builds the test bed's tiny models (a random-weight Llama target and an EAGLE-3 draft);
2. serves the target without speculation and records greedy outputs for a load ramp;
3. serves the same target with ``--speculative-algorithm EAGLE3_DYNAMIC`` and drives the
   same ramp, whose concurrency climbs past the disable threshold and falls back;
4. prints the mode timeline (decode steps per mode in each wave, and the switches);
5. checks every output token against the non-speculative server's.

Exit status 0 when the mode switched both ways and all outputs are identical, 1 otherwise. The servers run one at a
time (an idle SGLang scheduler keeps a core busy) and bind to 127.0.0.1.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

RAMP = (1, 2, 4, 8, 12, 8, 4, 2, 1)


def _say(message: str) -> None:
    tqdm.write(f"[{time.strftime('%H:%M:%S')}] {message}")


def _run_ramp(url: str, waves, label: str, on_wave=None):
    from dynspec_testbed.workload import run_waves

    with tqdm(total=len(waves), desc=f"{label}: ramp", unit="wave", leave=False) as bar:

        def step(index, wave):
            if on_wave is not None:
                on_wave(index, wave)
            bar.update(1)

        return run_waves(url, waves, on_wave=step)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dynspec_testbed.demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--work-dir",
        type=Path,
        default=None,
        help="where models and server logs go (default: a new temporary directory)",
    )
    parser.add_argument(
        "--threshold",
        type=int,
        default=4,
        help="--speculative-disable-batch-threshold for the demo server (default 4)",
    )
    parser.add_argument("--seed", type=int, default=7, help="seed of the random prompts")
    args = parser.parse_args(argv)

    work = args.work_dir or Path(tempfile.mkdtemp(prefix="sglang-dynspec-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()

    from dynspec_testbed.models import build_models
    from dynspec_testbed.server import CpuServer, baseline_server_args, dynamic_server_args
    from dynspec_testbed.workload import compare_outputs, count_tokens, plugin_counters, waves_of

    _say(f"building the tiny test-bed models in {work / 'models'}")
    models = build_models(work / "models")
    waves = waves_of(RAMP, seed=args.seed, prefix="demo", new_tokens=(16, 48))
    n_requests = sum(len(w) for w in waves)

    _say("starting a non-speculative SGLang server on the CPU (about a minute)")
    with CpuServer(baseline_server_args(models), log_path=work / "reference.log") as server:
        _say(f"  up in {server.startup_seconds:.0f} s; running the ramp {list(RAMP)} ({n_requests} requests)")
        reference = _run_ramp(server.url, waves, "reference")

    n = args.threshold
    dyn_args = dynamic_server_args(
        models,
        disable_above=n,
        dwell=2,
        extra=["--max-running-requests", 16, "--enable-metrics", "--log-level", "info"],
    )
    _say(f"starting an EAGLE3_DYNAMIC server (plain decode above {n} running requests)")
    timeline = []
    log_path = work / "dynamic.log"
    with CpuServer(dyn_args, log_path=log_path) as server:
        _say(f"  up in {server.startup_seconds:.0f} s; running the same ramp")
        before = plugin_counters(server.url)

        def record(index, wave):
            nonlocal before
            now = plugin_counters(server.url)
            timeline.append(
                (
                    index,
                    len(wave),
                    now.steps_spec - before.steps_spec,
                    now.steps_plain - before.steps_plain,
                    now.mode,
                )
            )
            before = now

        dynamic = _run_ramp(server.url, waves, "EAGLE3_DYNAMIC", on_wave=record)
        totals = plugin_counters(server.url)

    print()
    print("Mode timeline (decode steps per wave, from the plugin's /metrics counters):")
    print(f"  {'wave':>4}  {'requests':>8}  {'spec steps':>10}  {'plain steps':>11}  mode after")
    for index, size, spec, plain, mode in timeline:
        after = "spec" if mode == 1 else "plain"
        print(f"  {index + 1:>4}  {size:>8}  {spec:>10.0f}  {plain:>11.0f}  {after}")
    print(
        f"  total: {totals.steps_spec:.0f} speculative and {totals.steps_plain:.0f} plain decode steps; "
        f"{totals.switches_to_plain:.0f} switches to plain, {totals.switches_to_spec:.0f} back to EAGLE-3"
    )
    if totals.catch_ups is not None:
        print(
            f"  draft catch-up: {sum(totals.catch_ups.values()):.0f} replays "
            f"({', '.join(f'{k} {v:.0f}' for k, v in totals.catch_ups.items())}) "
            f"of {totals.catch_up_tokens:.0f} positions decoded plain"
        )
    switches = [
        line.split("] ", 1)[-1]
        for line in log_path.read_text().splitlines()
        if re.search(
            r"\[sglang-dynspec\] (spec -> plain|plain -> spec|draft catch-up \(resume|first spec)", line
        )
    ]
    if switches:
        print("Switches and resumes, as the server logged them:")
        for line in switches:
            print(f"  {line}")
        print("  (the demo's draft has random weights, so it almost never proposes the target's token:")
        print("  1.00 accepted token per step, the target's own, is its steady state too; with a draft")
        print("  that agrees, tests/test_catch_up_e2e.py shows full acceptance right after a resume)")

    mismatches = compare_outputs(reference, dynamic)
    print()
    elapsed = time.monotonic() - started
    if not (totals.switches_to_plain and totals.switches_to_spec):
        print(
            "NO SWITCH: the ramp did not move EAGLE3_DYNAMIC into plain mode and back "
            f"(logs in {work}); the comparison would show nothing."
        )
        return 1
    if mismatches:
        print(f"MISMATCH: {len(mismatches)} of {n_requests} outputs differ from the non-speculative server:")
        for mm in mismatches[:10]:
            print(f"  {mm}")
        print(f"(logs in {work}; {elapsed:.0f} s)")
        return 1
    print(
        f"All {n_requests} outputs ({count_tokens(dynamic)} tokens) are identical to the "
        f"non-speculative server's, token for token. ({elapsed:.0f} s; logs in {work})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
