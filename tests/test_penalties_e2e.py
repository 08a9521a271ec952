"""End to end on real SGLang (CPU test bed): frequency, presence and repetition penalties
under EAGLE3_DYNAMIC.

SGLang's EAGLE verify applies the penalties accumulated before a speculative step to
every drafted position, and then counts only the step's last token ("a relaxed
version of penalties", ``eagle_utils`` / ``eagle_prepare_for_decode``); a plain step
counts every token, as a non-speculative server does. With ``--speculative-penalties
exact`` (the default) a decode batch with a penalised request decodes plain, so the
outputs equal the non-speculative server's; ``relaxed`` lets such batches speculate.

The workload is built so that penalties decide the tokens and no two candidates are
close: the agreeing pair's target gives AGREE_TOKEN a logit of about 1.2 and every
other token exactly 0, so a logit bias on a few tokens orders the alternatives with
gaps of at least 0.02 (far above float noise) once AGREE_TOKEN is penalised. Without
the biases, a penalised AGREE_TOKEN would leave 511 exactly tied logits, and the
reference itself would not be reproducible. The reference serves the requests twice,
with different batching, and the two must agree: that is what makes the comparison
evidence.

Outputs are compared under the synchronous scheduler only. Under the overlap scheduler
SGLang's own penalty accounting lags: a decode batch is prepared before the previous
step's tokens reach the requests, so a token is sometimes counted a step late, and the
non-speculative server gives these requests different tokens from run to run (on this
bed: ``300, 300, 7, 7, 17, 17, ...`` in one run, ``300, 7, 7, 17, 17, ...`` in the next,
against ``300, 7, 17, 11, 19, ...`` synchronously). Under overlap the test checks the
decision only: penalised batches decode plain.
"""

from __future__ import annotations

import dataclasses

import pytest

from dynspec_testbed.models import AGREE_TOKEN
from dynspec_testbed.server import CI_ENV, OVERLAP_CI_ENV, baseline_server_args, dynamic_server_args, serve
from dynspec_testbed.workload import compare_outputs, random_requests, run_waves
from sglang_dynspec.config import PENALTIES, REQUEST_MODES_ENV, REQUEST_MODES_KEY

pytestmark = pytest.mark.server

BIAS = {"7": 1.09, "11": 1.03, "13": 0.21, "17": 1.05, "19": 0.94}
PENALTY_PARAMS = [
    {"frequency_penalty": 0.46},
    {"presence_penalty": 0.38},
    {"repetition_penalty": 1.72},
    {"frequency_penalty": 0.32, "presence_penalty": 0.11},
]
PENALISED = [
    dataclasses.replace(r, extra={"sampling_params": {**params, "logit_bias": BIAS}})
    for r, params in zip(random_requests(4, seed=21, prefix="pen", new_tokens=(16, 16)), PENALTY_PARAMS)
]
# A logit bias alone: verify applies it exactly, so this request may speculate.
BIASED = [
    dataclasses.replace(r, extra={"sampling_params": {"logit_bias": {"7": 1.5}}})
    for r in random_requests(1, seed=22, prefix="bias", new_tokens=(16, 16))
]
# Waves of two, below the threshold (3): without the exact rule these batches speculate.
WAVES = [PENALISED[:2], PENALISED[2:], BIASED]


@pytest.fixture(scope="module")
def reference(tiny_models, tmp_path_factory):
    log = tmp_path_factory.mktemp("penalties") / "reference.log"
    args = baseline_server_args(tiny_models, "agree", extra=["--disable-overlap-schedule"])
    in_waves, at_once = serve(
        args,
        lambda url: (run_waves(url, WAVES), run_waves(url, [PENALISED + BIASED])),
        log_path=log,
        env=CI_ENV,
    )
    # The workload is well conditioned: other batching, same tokens.
    assert [str(m) for m in compare_outputs(in_waves, at_once)] == []
    # Penalties decide the tokens: the penalised requests do not repeat AGREE_TOKEN throughout.
    for request in PENALISED:
        assert set(in_waves[request.rid]["output_ids"]) != {AGREE_TOKEN}, in_waves[request.rid]
    return in_waves


def serve_dynamic(tiny_models, log, env, penalties: str | None):
    args = dynamic_server_args(
        tiny_models, "agree", extra=[] if penalties is None else [PENALTIES.option, penalties]
    )
    return serve(args, lambda url: run_waves(url, WAVES), log_path=log, env={**env, REQUEST_MODES_ENV: "1"})


def step_modes(results, requests) -> dict[str, set[str]]:
    return {r.rid: set(results[r.rid]["meta_info"][REQUEST_MODES_KEY]) for r in requests}


def test_exact_penalties_decode_plain_and_equal_the_baseline(tiny_models, reference, tmp_path):
    got = serve_dynamic(tiny_models, tmp_path / "exact.log", CI_ENV, penalties="exact")

    assert [str(m) for m in compare_outputs(reference, got)] == []
    assert all(modes == {"plain"} for modes in step_modes(got, PENALISED).values()), step_modes(
        got, PENALISED
    )
    # An unpenalised request alone below the threshold still speculates.
    assert "spec" in step_modes(got, BIASED)["bias0"]


def test_exact_penalties_decode_plain_under_the_overlap_scheduler(tiny_models, tmp_path):
    """The decision only (see the module docstring): the overlap scheduler hands the
    worker the forward copy of the sampling state, with the penalties accumulated."""
    got = serve_dynamic(tiny_models, tmp_path / "exact-overlap.log", OVERLAP_CI_ENV, penalties="exact")

    assert all(modes == {"plain"} for modes in step_modes(got, PENALISED).values()), step_modes(
        got, PENALISED
    )
    assert "spec" in step_modes(got, BIASED)["bias0"]
    assert got["bias0"]["output_ids"] == [7] * 16  # the bias decides every token, in both modes


def test_relaxed_penalties_speculate_and_count_fewer_tokens(tiny_models, reference, tmp_path):
    """The control: with relaxed penalties the same batches speculate, and the outputs
    with a frequency penalty differ. Once the alternatives are penalised below
    AGREE_TOKEN, a verify step sees the same counts at all four drafted positions and
    accepts AGREE_TOKEN four times, where a per-token count takes it once. (Presence
    and repetition penalties do not grow with the count, and this draft proposes only
    AGREE_TOKEN, so those two requests come out the same either way.)"""
    got = serve_dynamic(tiny_models, tmp_path / "relaxed.log", CI_ENV, penalties=None)  # the default

    assert all("spec" in modes for modes in step_modes(got, PENALISED).values()), step_modes(got, PENALISED)
    differing = {str(m).split(":")[0] for m in compare_outputs(reference, got)}
    frequency = {r.rid for r in PENALISED if "frequency_penalty" in r.extra["sampling_params"]}
    assert differing == frequency, differing
