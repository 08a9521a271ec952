"""GPU output parity of EAGLE3_DYNAMIC against the non-speculative server (issue 11).

``run URL OUT.json [--waves ...]`` sends a fixed set of greedy requests (the test
bed's seeded random prompts, every request 48 new tokens) in waves whose sizes cross
the dynamic server's threshold both ways, and saves each response's output tokens
and ``meta_info``. ``compare REFERENCE.json CANDIDATE.json`` then sorts the
candidate's requests by the modes of their decode steps (the plugin's
``meta_info["spec_dynamic_step_modes"]``, from ``SGLANG_DYNSPEC_REQUEST_MODES=1``)
and counts, in each group, the requests whose tokens equal the reference's:

* ``plain_only``: no speculative decode step. These ran exactly the baseline's
  computation (a target prefill, then plain target decodes), so under
  ``--enable-deterministic-inference`` every one must match;
* ``mixed`` and ``spec_only``: some or all steps verified a draft; SGLang's verify
  numerics differ from its decode's, so these may differ (stock EAGLE-3 does too).

Prints one JSON line per comparison; exit status 1 if a ``plain_only`` request
differs or fewer than half the requests are ``plain_only`` (the workload would then
not test what it claims), or if the candidate carries no step modes.
``update URL PATH [--recapture]`` loads new weights with SGLang's
``/update_weights_from_disk`` (the test bed's ``target-update``), so that the same
comparison can show that plain steps after an update use the new weights.
``update-tensor URL PATH`` sends the same weights through ``/update_weights_from_tensor``
(issue 21 §4): this process reads PATH's safetensors onto the GPU and serializes them
the way SGLang's ``Engine.update_weights_from_tensor`` does (CUDA IPC handles, one
payload per tensor-parallel rank); the server copies them into its parameters.
``graph-steps BEFORE AFTER`` reads two dumps of the server's ``/metrics`` and fails
unless plain steps replayed the plain CUDA graph between them (an update that wrote the
weights in place must leave the graph in use).
``benchmarks/h200/parity.sh`` runs the servers and these commands on the H200.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dynspec_testbed.server import update_weights_from_disk, update_weights_from_tensor
from dynspec_testbed.workload import run_waves, waves_of
from sglang_dynspec.bench.scrape import parse_metrics

MODES_KEY = "spec_dynamic_step_modes"
# Small waves speculate; large ones (threshold 8) run plain from their first decode
# step to their last, since every request of a wave has the same length.
DEFAULT_WAVES = (1, 24, 1, 32, 2, 40, 1, 48, 1, 50)
NEW_TOKENS = 48


def run(url: str, out: Path, waves: tuple[int, ...], seed: int) -> None:
    requests = waves_of(waves, seed=seed, prefix="p", new_tokens=(NEW_TOKENS, NEW_TOKENS))
    results = run_waves(url, requests)
    out.write_text(
        json.dumps(
            {rid: {"output_ids": r["output_ids"], "meta_info": r["meta_info"]} for rid, r in results.items()}
        )
    )


def update(url: str, path: str, recapture: bool) -> None:
    answer = update_weights_from_disk(url, Path(path), recapture_cuda_graph=recapture)
    print(json.dumps({"update": path, "recapture_cuda_graph": recapture, **answer}))


def update_from_tensor(url: str, path: str, device: str = "cuda") -> None:
    answer = update_weights_from_tensor(url, Path(path), device)
    print(json.dumps({"update_from_tensor": path, **answer}))


def graph_steps_between(before: Path, after: Path) -> float:
    """Plain steps that replayed the plain graph between two ``/metrics`` dumps."""
    return (
        parse_metrics(after.read_text()).plain_graph_steps
        - parse_metrics(before.read_text()).plain_graph_steps
    )


def step_group(meta_info: dict) -> str:
    modes = meta_info.get(MODES_KEY)
    if not modes:
        return "no_modes"
    kinds = set(modes)
    if kinds == {"plain"}:
        return "plain_only"
    if kinds == {"spec"}:
        return "spec_only"
    return "mixed"


def compare(reference: dict, candidate: dict) -> dict:
    groups: dict[str, dict] = {}
    first_difference = {}
    for rid in sorted(reference):
        got = candidate[rid]
        group = groups.setdefault(step_group(got["meta_info"]), {"requests": 0, "identical": 0})
        group["requests"] += 1
        ref_ids, got_ids = reference[rid]["output_ids"], got["output_ids"]
        if ref_ids == got_ids:
            group["identical"] += 1
        else:
            first_difference[rid] = next(
                (i for i, (a, b) in enumerate(zip(ref_ids, got_ids)) if a != b),
                min(len(ref_ids), len(got_ids)),
            )
    plain = groups.get("plain_only", {"requests": 0, "identical": 0})
    return {
        "requests": len(reference),
        "identical": sum(g["identical"] for g in groups.values()),
        "groups": groups,
        "plain_only_all_identical": plain["requests"] == plain["identical"],
        "plain_only_share": plain["requests"] / max(1, len(reference)),
        "first_difference_by_request": first_difference,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_run = sub.add_parser("run", help="send the workload to URL and save the responses")
    p_run.add_argument("url")
    p_run.add_argument("out", type=Path)
    p_run.add_argument(
        "--waves", default=",".join(map(str, DEFAULT_WAVES)), help="wave sizes, comma-separated"
    )
    p_run.add_argument("--seed", type=int, default=11)
    p_upd = sub.add_parser("update", help="load new weights from disk")
    p_upd.add_argument("url")
    p_upd.add_argument("path")
    p_upd.add_argument("--recapture", action="store_true", help="recapture_cuda_graph=True")
    p_ten = sub.add_parser(
        "update-tensor", help="send the weights in PATH through /update_weights_from_tensor"
    )
    p_ten.add_argument("url")
    p_ten.add_argument("path")
    p_ten.add_argument("--device", default="cuda", help="where the sent tensors live (cpu: the CPU test bed)")
    p_gra = sub.add_parser("graph-steps", help="plain-graph steps between two /metrics dumps")
    p_gra.add_argument("before", type=Path)
    p_gra.add_argument("after", type=Path)
    p_gra.add_argument("--label", default="")
    p_cmp = sub.add_parser("compare", help="compare a candidate's responses with a reference's")
    p_cmp.add_argument("reference", type=Path)
    p_cmp.add_argument("candidate", type=Path)
    p_cmp.add_argument("--label", default="")
    p_cmp.add_argument("--modes", action="store_true", help="the candidate must carry step modes")
    args = parser.parse_args(argv)

    if args.command == "run":
        run(args.url, args.out, tuple(int(w) for w in args.waves.split(",")), args.seed)
        return 0
    if args.command == "update":
        update(args.url, args.path, args.recapture)
        return 0
    if args.command == "update-tensor":
        update_from_tensor(args.url, args.path, args.device)
        return 0
    if args.command == "graph-steps":
        graph = graph_steps_between(args.before, args.after)
        print(json.dumps({"label": args.label, "plain_graph_steps_after": graph}))
        return 0 if graph > 0 else 1
    summary = compare(json.loads(args.reference.read_text()), json.loads(args.candidate.read_text()))
    print(json.dumps({"label": args.label, **summary}))
    if not args.modes:
        return 0 if summary["identical"] == summary["requests"] else 1
    ok = (
        "no_modes" not in summary["groups"]
        and summary["plain_only_all_identical"]
        and summary["plain_only_share"] >= 0.5
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
