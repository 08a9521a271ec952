"""The draft KV after the catch-up on the GPU, against an always-speculating EAGLE-3 server.

The CPU test bed checks this with float32 tolerance (``tests/test_catch_up_e2e.py``); the
GPU adds CUDA graphs, the eager flush and, with ``SGLANG_DYNSPEC_FLUSH_STREAM=1``, a flush
on a second stream that the plain steps run beside. Each server runs with the test bed's
draft-KV dumps (``dynspec_testbed.draft_kv``: every finished request's draft K and V rows
at its committed positions).

``run URL`` sends the workload: a wave of two long and four short requests (six
requests decode plain above a threshold of 3; once the short ones finish, the two long
ones speculate again, so the catch-up resumes them; a 4-position buffer flushes every
4 plain steps). ``compare REFERENCE_DIR DIR --label L`` matches each request with the
reference server's (same prompt) and compares the draft K/V rows at every position whose row
reads only tokens before their token sequences first differ (speculative numerics may change a
bf16 token; the row at p reads the token at p + 1). The
target's hidden states come from a verify forward on one server and from a plain decode
on the other, so rows differ by rounding; a row that was never written, or written from
the wrong state, differs by its own size. Per position: max |a - b| / max |b| over the
row. Prints one JSON line: positions compared, how many exceed ``--tolerance`` (0.1),
the worst ratio, and the positions over it by request, with those in the stale tail of a
short request (its last ``--stale-tail`` positions: it finished while plain, and those were
never replayed) apart; per request (``by_request``) the rows compared, the prompt's rows
among them and the worst ratio outside the stale tail. The first run (2026-12-04, before both
rules) found 8 rows over: three in short0's tail and one at each other request's position
before its tokens first differed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from dynspec_testbed.draft_kv import load_dumps
from dynspec_testbed.workload import random_requests, run_waves

LONG = random_requests(2, seed=21, prefix="long", prompt_len=(40, 60), new_tokens=(120, 120))
SHORT = random_requests(4, seed=22, prefix="short", prompt_len=(40, 60), new_tokens=(40, 40))
PROMPTS = {r.rid: list(r.input_ids) for r in LONG + SHORT}


def run(url: str) -> None:
    results = run_waves(url, [LONG + SHORT])
    print(
        json.dumps({"requests": len(results), "tokens": sum(len(r["output_ids"]) for r in results.values())})
    )


def _by_prompt(directory: Path) -> dict[str, dict]:
    out = {}
    for record in load_dumps(directory).values():
        for rid, prompt in PROMPTS.items():
            if record["token_ids"][: len(prompt)] == prompt:
                out[rid] = record
    return out


def compare(reference: Path, candidate: Path, label: str, tolerance: float, stale_tail: int) -> dict:
    ref, got = _by_prompt(reference), _by_prompt(candidate)
    positions, over, tails, worst, per_request = 0, {}, {}, 0.0, {}
    for rid in sorted(set(ref) & set(got)):
        a, b = got[rid], ref[rid]
        same = 0
        for x, y in zip(a["token_ids"], b["token_ids"]):
            if x != y:
                break
            same += 1
        # The draft's K/V at position p come from the target's hidden state at p and the
        # token at p + 1 (EAGLE's shifted input): where the tokens first differ, at s, the
        # row at s - 1 differs too, for a reason that is not the catch-up's.
        diverged = same < min(len(a["token_ids"]), len(b["token_ids"]))
        n = min(same - 1 if diverged else same, a["k"].shape[1], b["k"].shape[1])
        rows_a = torch.cat([a["k"][:, :n], a["v"][:, :n]], dim=-1).float()  # [layers, n, heads, 2 dim]
        rows_b = torch.cat([b["k"][:, :n], b["v"][:, :n]], dim=-1).float()
        diff = (rows_a - rows_b).abs().amax(dim=(0, 2, 3))
        scale = rows_b.abs().amax(dim=(0, 2, 3)).clamp_min(1e-6)
        ratio = diff / scale
        positions += n
        worst = max(worst, float(ratio.max()) if n else 0.0)
        bad = (ratio > tolerance).nonzero().flatten().tolist()
        # A request that finished while plain keeps its last positions in the catch-up's
        # buffer, never replayed (the documented stale tail; tests/test_catch_up_e2e.py).
        tail_from = a["k"].shape[1] - stale_tail if rid.startswith("short") else a["k"].shape[1]
        body = ratio[: min(n, tail_from)]
        per_request[rid] = {
            "rows": n,
            "prompt_rows": len(PROMPTS[rid]),
            "worst_outside_stale_tail": round(float(body.max()), 4) if len(body) else 0.0,
        }
        if [p for p in bad if p >= tail_from]:
            tails[rid] = [p for p in bad if p >= tail_from]
        if [p for p in bad if p < tail_from]:
            over[rid] = [p for p in bad if p < tail_from]
    return {
        "label": label,
        "requests": len(set(ref) & set(got)),
        "requests_missing": sorted(set(ref) ^ set(got)),
        "positions": positions,
        "positions_over_tolerance": sum(len(v) for v in over.values()),
        "tolerance": tolerance,
        "worst_ratio": round(worst, 4),
        "over_by_request": {rid: v[:20] for rid, v in over.items()},
        "stale_tail_over_tolerance": {rid: v for rid, v in tails.items()},
        # Rows compared per request (prompt rows, written by the prefill, among them) and the
        # worst ratio outside the stale tail: how many decode rows the check reached (which of
        # them ran plain, the server log's switches say).
        "by_request": per_request,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p_run = sub.add_parser("run")
    p_run.add_argument("url")
    p_cmp = sub.add_parser("compare")
    p_cmp.add_argument("reference", type=Path)
    p_cmp.add_argument("candidate", type=Path)
    p_cmp.add_argument("--label", required=True)
    p_cmp.add_argument("--tolerance", type=float, default=0.1)
    p_cmp.add_argument(
        "--stale-tail",
        type=int,
        default=4,
        help="the catch-up buffer (positions) of the short requests' stale tail",
    )
    args = parser.parse_args()
    if args.command == "run":
        run(args.url)
    else:
        print(
            json.dumps(compare(args.reference, args.candidate, args.label, args.tolerance, args.stale_tail))
        )


if __name__ == "__main__":
    main()
