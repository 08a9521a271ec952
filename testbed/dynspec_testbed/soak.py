"""A switching soak on the CPU test bed: many mode switches under concurrent, messy load.

    python -m dynspec_testbed.soak --switches 1000 --out soak.json [--models DIR]

Serves the random-weight pair with EAGLE3_DYNAMIC at thresholds N = 2, M = 1 and no
dwell (every burst above two requests switches to plain and back), under the overlap
scheduler, with SGLang's forced retractions (``SGLANG_TEST_RETRACT``), and sends rounds
of 1-6 concurrent requests mixing plain greedy, logprob, regex-constrained and streamed
requests, some streams dropped by the client after a few chunks (aborts), until the
server has switched ``--switches`` times. Then a non-speculative server answers every
completed request again, and the summary says: switches, requests, aborts,
retractions, mismatches (greedy outputs that differ), leaks (KV tokens still in use
once idle), crashes (a server that died or answered an error), duration. Exit 0 when
mismatches, leaks and crashes are all 0.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from dynspec_testbed.server import (
    OVERLAP_CI_ENV,
    CpuServer,
    baseline_server_args,
    dynamic_server_args,
    generate,
    kv_left_once_idle,
    retracting,
)
from dynspec_testbed.workload import Request, compare_outputs, plugin_counters

REGEX = "(the|quick|brown|fox|dog)( (the|quick|brown|fox|dog)){3,9}"
ENV = {**OVERLAP_CI_ENV, **retracting(every=25)}


def dynamic_args(models: dict) -> list:
    extra = ["--speculative-enable-batch-threshold", 1, "--max-running-requests", 8, "--enable-metrics"]
    return dynamic_server_args(models, disable_above=2, dwell=0, extra=extra)


def make_request(rng: random.Random, rid: str) -> tuple[Request, str]:
    """One request and its kind: greedy, logprob, regex, stream or abort."""
    kind = rng.choices(["greedy", "logprob", "regex", "stream", "abort"], weights=[4, 2, 1, 2, 1])[0]
    extra: dict = {}
    if kind == "logprob":
        extra = {"return_logprob": True, "top_logprobs_num": 2}
    elif kind == "regex":
        extra = {"sampling_params": {"regex": REGEX, "ignore_eos": False}}
    prompt = tuple(rng.randrange(3, 500) for _ in range(rng.randint(4, 24)))
    return Request(rid=rid, input_ids=prompt, max_new_tokens=rng.randint(8, 40), extra=extra), kind


def _stream(url: str, request: Request, drop_after: int | None) -> dict | None:
    """A streamed request; None if the client dropped it after ``drop_after`` chunks."""
    body = dict(request.kwargs())
    body["sampling_params"] = {
        "max_new_tokens": body.pop("max_new_tokens"),
        "temperature": 0.0,
        **body["sampling_params"],
    }
    body["stream"] = True
    last = None
    with httpx.Client(timeout=300) as client, client.stream("POST", f"{url}/generate", json=body) as response:
        response.raise_for_status()
        chunks = 0
        for line in response.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            last = json.loads(line[len("data:") :])
            chunks += 1
            if drop_after is not None and chunks >= drop_after:
                return None  # closing the stream aborts the request in SGLang
    return last


def send(url: str, request: Request, kind: str) -> dict | None:
    if kind == "stream":
        return _stream(url, request, None)
    if kind == "abort":
        return _stream(url, request, drop_after=3)
    return generate(url, **request.kwargs())


def soak(
    models: dict,
    work_dir: Path,
    switches: int,
    max_seconds: float,
    seed: int = 0,
    log=print,
    reference_url: Callable[[], str] | None = None,
) -> dict:
    """Run the soak; its summary. ``reference_url``: where a running non-speculative
    server on the random pair's target answers (the tests' shared reference); by
    default one is started for the comparison."""
    rng = random.Random(seed)
    completed: dict[str, dict] = {}
    sent: dict[str, tuple[Request, str]] = {}
    crashes, aborts, rounds = [], 0, 0
    started = time.monotonic()
    server_log = work_dir / "dynamic.log"
    with CpuServer(dynamic_args(models), log_path=server_log, env=ENV) as server:
        with ThreadPoolExecutor(max_workers=6) as pool:
            done_switching = False
            while not done_switching and time.monotonic() - started < max_seconds:
                burst = [make_request(rng, f"soak{rounds}-{i}") for i in range(rng.randint(1, 6))]
                futures = {pool.submit(send, server.url, r, k): (r, k) for r, k in burst}
                for future, (request, kind) in futures.items():
                    sent[request.rid] = (request, kind)
                    try:
                        result = future.result()
                    except Exception as e:  # noqa: BLE001 (any error is a finding)
                        crashes.append(f"{request.rid} ({kind}): {e}")
                        continue
                    if result is None:
                        aborts += 1
                    elif kind != "abort":
                        completed[request.rid] = result
                rounds += 1
                if rounds % 10 == 0:
                    c = plugin_counters(server.url)
                    total = (c.switches_to_plain or 0) + (c.switches_to_spec or 0)
                    log(f"round {rounds}: {total:.0f} switches, {len(completed)} completed, {aborts} aborted")
                    done_switching = total >= switches
        leaks = sum(kv_left_once_idle(server.url, timeout=120))
        counters = plugin_counters(server.url)
    text = server_log.read_text()
    retractions = sum(int(n) for n in re.findall(r"#retracted_reqs: (\d+)", text))
    # The reference: a non-speculative server answers every completed request again.
    greedy = {rid: sent[rid][0] for rid in completed}

    def answer_again(url: str) -> dict:
        with ThreadPoolExecutor(max_workers=8) as pool:
            return dict(zip(greedy, pool.map(lambda r: generate(url, **r.kwargs()), greedy.values())))

    if reference_url is not None:
        reference = answer_again(reference_url())
    else:
        with CpuServer(baseline_server_args(models), log_path=work_dir / "reference.log", env=ENV) as server:
            reference = answer_again(server.url)
    mismatches = compare_outputs(reference, completed)
    return {
        "switches": int((counters.switches_to_plain or 0) + (counters.switches_to_spec or 0)),
        "steps_spec": counters.steps_spec,
        "steps_plain": counters.steps_plain,
        "rounds": rounds,
        "requests": len(sent),
        "completed": len(completed),
        "aborts": aborts,
        "retractions": retractions,
        "mismatches": len(mismatches),
        "mismatch_examples": [str(m) for m in mismatches[:5]],
        "leaks": leaks,
        "crashes": len(crashes),
        "crash_examples": crashes[:5],
        "duration_s": round(time.monotonic() - started, 1),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dynspec_testbed.soak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--switches", type=int, default=1000)
    parser.add_argument("--max-seconds", type=float, default=3600)
    parser.add_argument("--models", type=Path, default=None, help="test-bed models (built there if missing)")
    parser.add_argument("--out", type=Path, default=None, help="write the summary JSON here")
    args = parser.parse_args(argv)
    from dynspec_testbed.models import build_models

    with tempfile.TemporaryDirectory(prefix="dynspec-soak-") as tmp:
        models = build_models(args.models or Path(tmp) / "models")
        summary = soak(models, Path(tmp), args.switches, args.max_seconds)
    summary["date"] = time.strftime("%Y-%m-%d")
    text = json.dumps(summary, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    ok = summary["mismatches"] == summary["leaks"] == summary["crashes"] == 0
    return 0 if ok and summary["switches"] >= args.switches else 1


if __name__ == "__main__":
    sys.exit(main())
