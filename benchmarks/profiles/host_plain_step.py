"""The plugin's host work per plain decode step, on this machine's CPU, under cProfile.

Issue 19: on the H200 the plain step's kernels equal the baseline's, but under the
profiler the GPU idled between plain steps where it did not between baseline steps
(benchmarks/results/h200-20261203-d79b2bd/README.md), so the plugin's host work per
step sits on the critical path when the host is. This drives what the worker does
around a plain step's forward (``worker.DynamicEagleWorker.forward_batch_generation``:
the decision's reads through compat, the controller with the goodput policy, the
catch-up's hooks, the fresh batch), on a real SGLang ``ScheduleBatch`` of
``--requests`` requests (``tests/schedule_batches.py``), without the forward itself,
and prints the functions by cumulative time per step.

On the CPU, device tensor ops run inline, so their time counts here; on a GPU they are
launches. Read the Python frames (walks over the batch, per-request loops).

Usage: python benchmarks/profiles/host_plain_step.py [--requests 64] [--steps 200]
       python benchmarks/profiles/host_plain_step.py --ops   # the tensor ops per plain step instead

``--ops`` lists the ATen ops the same hooks dispatch per plain step (outside the target's
forward and SGLang's own bookkeeping, which this does not run), with their count: on a GPU
each is a kernel or a copy outside the target's CUDA graph, launched every plain step
(issue 19: clean plain steps 0.8-1.6% slower than the baseline's on the H200,
benchmarks/profiles/offstate-attribution-20261208.md).
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import pathlib
import pstats
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tests"))

import schedule_batches  # noqa: E402  (sets up the CPU import of SGLang first)
import torch  # noqa: E402

from sglang_dynspec import compat  # noqa: E402
from sglang_dynspec.catch_up import DraftCatchUp, DraftPasses  # noqa: E402
from sglang_dynspec.controller import ModeController  # noqa: E402
from sglang_dynspec.cost_model import StepCost, StepCostTable  # noqa: E402
from sglang_dynspec.estimates import EstimateFeed  # noqa: E402
from sglang_dynspec.fresh_batch import build_plain_decode_batch  # noqa: E402
from sglang_dynspec.goodput import GoodputPolicy, GoodputSettings  # noqa: E402
from sglang_dynspec.policy import Mode  # noqa: E402


def table() -> StepCostTable:
    """A table where plain always pays (the off state)."""
    return StepCostTable.from_points(
        StepCost(mode, b, c, (20e-3 if mode is Mode.SPEC else 5e-3) + b * 1e-5)
        for mode in Mode
        for b in (1, 16, 64, 128)
        for c in (128, 1024)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--ops", action="store_true", help="count the tensor ops per plain step instead")
    args = parser.parse_args()
    n = args.requests
    case = schedule_batches.SpecDecodeCase(
        prompt_lens=(256,) * n,
        output_lens=(8,) * n,
        greedy=(True,) * n,
        return_logprob=(False,) * n,
        num_draft_tokens=4,
        topk=1,
        num_steps=3,
        hidden_size=64,
        extra_pool_rows=1,
        host_mirror=False,
        overlap=True,
        leftover_verify_tensors=False,
        bonus_dtype=torch.int64,
        seed=1,
    )
    made = schedule_batches.build_spec_decode_batch(case)
    batch = made.batch
    # Room for every step in the log: this measures the per-step hooks, not flushes.
    passes = DraftPasses(extend=lambda *a: None, fill_kv=lambda *a: None)
    catch_up = DraftCatchUp(
        made.req_to_token, args.steps + 64, 3 * 64, torch.float32, passes, lambda *a: None
    )
    feed = EstimateFeed(agree=lambda x: x, table=table(), simulated_acceptance=3.0)
    controller = ModeController(GoodputPolicy(GoodputSettings()), feed=feed)
    aux = torch.zeros(n, 3 * 64)

    def step() -> None:
        mode = controller.before_decode(
            compat.decode_batch_size(batch),
            lambda: compat.accept_counters(batch),
            needs_per_token_penalties=compat.needs_per_token_penalties(batch),
            context_len=compat.mean_context_len(batch),
        )
        if mode is not Mode.PLAIN:
            # The policy's start, and now and then later: nothing here takes time, so
            # the measured step times are not a cost the table would recognise.
            controller.after_decode(mode)
            return False
        catch_up.before_plain_step(batch)
        plain = build_plain_decode_batch(batch, made.req_to_token)
        catch_up.after_plain_step(plain.input_ids, aux)
        controller.after_decode(mode, replayed_graph=True)
        # The requests grow as the scheduler would have them (the batch's tensors stay:
        # the test batch's KV table has room for one step).
        for req in batch.reqs:
            req.output_ids.append(1)
        return True

    for _ in range(32):  # until the policy has its first estimates and goes plain
        step()
    assert controller.policy.mode is Mode.PLAIN
    if args.ops:
        print_ops_per_step(step, args.steps)
        return
    start = time.perf_counter()
    profile = cProfile.Profile()
    profile.enable()
    plain = sum(step() for _ in range(args.steps))
    profile.disable()
    per_step = (time.perf_counter() - start) / plain
    print(
        f"{n} requests, {args.steps} decode steps, {plain} plain: "
        f"{per_step * 1e3:.3f} ms of host work per plain step (profiled)"
    )
    stats = pstats.Stats(profile)
    stats.sort_stats("cumulative").print_stats(args.top)


def print_ops_per_step(step, steps: int) -> None:
    """The ATen ops ``step`` dispatches, per plain step, with the shape of their first output."""
    from torch.utils._python_dispatch import TorchDispatchMode

    counts: collections.Counter = collections.Counter()

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            first = out[0] if isinstance(out, (tuple, list)) and out else out
            shape = tuple(first.shape) if isinstance(first, torch.Tensor) else ()
            counts[(str(func.overloadpacket.__name__), shape)] += 1
            return out

    with Count():
        plain = sum(step() for _ in range(steps))
    print(f"{plain} plain steps; tensor ops per plain step (op, first output's shape):")
    for (name, shape), n in counts.most_common():
        print(f"  {n / plain:6.2f}  {name} {list(shape)}")
    print(f"  {sum(counts.values()) / plain:6.2f}  in all")


if __name__ == "__main__":
    main()
