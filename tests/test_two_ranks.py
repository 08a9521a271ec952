"""Two tensor-parallel ranks on the CPU (``torch.distributed`` with gloo, two processes):
the plugin's cross-rank agreement code, as the worker runs it.

* Settings read from each rank's own environment are gathered and compared: equal
  settings pass; a stray variable on one rank is refused on *both* ranks, with a
  message naming the setting and each rank's value.
* Two goodput controllers fed the same batches but timing steps with their own clocks
  (rank-local numbers that differ) take the same decision at every step, because step
  times reach the policy only through rank 0's broadcast.
"""

from __future__ import annotations

import socket

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from sglang_dynspec import config
from sglang_dynspec.controller import ModeController
from sglang_dynspec.cost_model import StepCost, StepCostTable
from sglang_dynspec.estimates import EstimateFeed
from sglang_dynspec.goodput import GoodputPolicy, GoodputSettings
from sglang_dynspec.policy import Mode

WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gather(obj) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _broadcast_from_first(obj):
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _rank_main(rank: int, port: int, environs: list[dict], results, agree=_broadcast_from_first) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        settings = config.settings_from_environ(environs[rank])
        message = config.settings_disagreement(_gather(settings))
        # The decisions: same batch sizes on both ranks, different rank-local clocks.
        clock = {"now": 0.0}
        # The start-up table is the same on both ranks (the first rank's, handed to all);
        # it says steps cost half what they do.
        table = StepCostTable.from_points(
            StepCost(m, b, 0, (0.002 + 0.00015 * b) if m is Mode.SPEC else (0.0015 + 0.000015 * b))
            for m in Mode
            for b in (1, 8, 32, 64, 128)
        )
        feed = EstimateFeed(agree=agree, agree_every=4, clock=lambda: clock["now"], table=table)
        controller = ModeController(
            GoodputPolicy(GoodputSettings(min_dwell_steps=2)),
            (),
            feed,
            start_timer=lambda: _FakeTimer(clock),
        )
        modes = []
        for step in range(600):
            level = (step // 25) % 24
            batch = 1 + 8 * min(level, 23 - level)  # a load that climbs and falls
            mode = controller.before_decode(batch, lambda step=step: [("r", 2 * step, step)])
            per_step = (0.004 + 0.0003 * batch) if mode.value == "spec" else (0.003 + 0.00003 * batch)
            # Rank 1 sees its speculative steps 60% slower: on its own numbers it would cross
            # over at another batch size.
            clock["now"] += per_step * (1.0 + 0.6 * rank if mode.value == "spec" else 1.0)
            controller.after_decode(mode)
            modes.append(mode.value)
        results[rank] = (message, modes)
    finally:
        dist.destroy_process_group()


class _FakeTimer:
    def __init__(self, clock):
        self.clock, self.start, self.end = clock, clock["now"], None

    def stop(self):
        self.end = self.clock["now"]

    def seconds(self):
        return None if self.end is None else self.end - self.start


def _no_agreement(table):
    return table


def run_two_ranks(environs: list[dict], agree=_broadcast_from_first) -> dict:
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank_main, args=(_free_port(), environs, results, agree), nprocs=WORLD, join=True)
        return dict(results)


def test_equal_settings_pass_and_decisions_agree_despite_rank_local_clocks():
    env = {config.POLICY.env: "goodput"}
    results = run_two_ranks([env, dict(env)])
    (message0, modes0), (message1, modes1) = results[0], results[1]
    assert message0 is None and message1 is None
    assert modes0 == modes1
    assert "spec" in modes0 and "plain" in modes0  # the load crossed the crossover both ways


def test_without_the_agreement_the_same_ranks_would_decide_differently():
    """The control: each rank on its own step times takes other decisions (so the test
    above shows the agreement at work, not a workload on which any ranks agree)."""
    env = {config.POLICY.env: "goodput"}
    results = run_two_ranks([env, dict(env)], agree=_no_agreement)
    assert results[0][1] != results[1][1]


def test_a_setting_that_differs_on_one_rank_is_refused_on_both():
    env = {config.POLICY.env: "goodput"}
    results = run_two_ranks([env, {**env, config.CATCH_UP_TOKENS.env: "64"}])
    message0, message1 = results[0][0], results[1][0]
    assert message0 == message1
    assert "--speculative-catch-up-tokens (environment variable SGLANG_DYNSPEC_CATCH_UP_TOKENS)" in message0
    assert f"rank 0: {config.DEFAULT_CATCH_UP_TOKENS}, rank 1: 64" in message0


@pytest.mark.parametrize("same", [True, False])
def test_disagreement_message_is_pure(same):
    a = config.settings_from_environ({})
    b = config.settings_from_environ({} if same else {config.PLAIN_CUDA_GRAPH_ENV: "0"})
    message = config.settings_disagreement([a, b])
    assert (message is None) == same
    if not same:
        assert (
            "SGLANG_DYNSPEC_PLAIN_CUDA_GRAPH differs" in message and "rank 0: True, rank 1: False" in message
        )
