"""End to end on real SGLang (CPU test bed): sampling parameters mean the same in both modes.

Sampled outputs cannot be compared token for token (verify samples by rejection, a
plain step from the target's distribution), so each request here is sampled but
determined: ``top_k`` 1, or a ``top_p`` so small that only the top token is left, at a
temperature above 0 (the sampling path, not the greedy shortcut), with and without a
``min_p`` that both paths ignore. Stop token ids and stop strings, taken from the
reference's own greedy outputs so that they fire mid-generation, check that a
speculative step that accepts several tokens past a stop is cut where a plain step
stops. ``n`` = 2 checks that both copies of a request come back, equal. Every request is
sent in waves that cross the threshold both ways, to the non-speculative server and to
EAGLE3_DYNAMIC (random pair, synchronous scheduler), and the outputs must be equal.
"""

from __future__ import annotations

import dataclasses

import pytest

from dynspec_testbed.server import (
    CI_ENV,
    dynamic_server_args,
    generate_concurrently,
    serve,
)
from dynspec_testbed.workload import compare_outputs, random_requests, run_waves, split_into_waves
from sglang_dynspec.config import REQUEST_MODES_ENV, REQUEST_MODES_KEY

pytestmark = pytest.mark.server

SIZES = [1, 6, 1, 6]  # across threshold 3 and back
DETERMINED = [
    {"temperature": 1.0, "top_k": 1},
    {"temperature": 0.7, "top_p": 1e-6},
    {"temperature": 1.3, "top_k": 1, "min_p": 0.9},
    {"temperature": 0.5, "top_k": 40, "top_p": 1e-6},
]


def with_params(requests, params_of):
    return [
        dataclasses.replace(r, extra={"sampling_params": params_of(i, r)}) for i, r in enumerate(requests)
    ]


BASE = random_requests(sum(SIZES), seed=41, prefix="s", new_tokens=(24, 32))
SAMPLED = with_params(BASE, lambda i, r: DETERMINED[i % len(DETERMINED)])


def stop_requests(greedy: dict[str, dict]):
    """Copies of BASE that stop at a token id or a text their greedy output reaches mid-way."""
    out = []
    for i, r in enumerate(BASE):
        ids, text = greedy[r.rid]["output_ids"], greedy[r.rid]["text"]
        if i % 2:
            params = {"stop_token_ids": [ids[len(ids) // 2]], "ignore_eos": False}  # else ignored
        else:
            params = {"stop": [text[len(text) // 2 : len(text) // 2 + 3]]}
        out.append(dataclasses.replace(r, rid=f"stop{i}", extra={"sampling_params": params}))
    return out


def run_all(url: str, greedy_reference: dict[str, dict] | None):
    greedy = run_waves(url, split_into_waves(BASE, SIZES))
    source = greedy_reference if greedy_reference is not None else greedy
    results = {
        **greedy,
        **run_waves(url, split_into_waves(SAMPLED, SIZES)),
        **run_waves(url, split_into_waves(stop_requests(source), SIZES)),
    }
    twins = generate_concurrently(
        url,
        [{**r.kwargs(), "sampling_params": {**r.kwargs()["sampling_params"], "n": 2}} for r in BASE[:3]],
        3,
    )
    return results, twins


def test_sampling_parameters_stops_and_n_match_the_baseline(tiny_models, reference_servers, tmp_path):
    ref, ref_twins = reference_servers.serve("random", lambda url: run_all(url, None))
    got, twins = serve(
        dynamic_server_args(tiny_models),
        lambda url: run_all(url, greedy_reference=ref),
        log_path=tmp_path / "dynamic.log",
        env={**CI_ENV, REQUEST_MODES_ENV: "1"},
    )

    assert [str(m) for m in compare_outputs(ref, got)] == []
    # The stops fired mid-way, in both modes' steps.
    for rid in (f"stop{i}" for i in range(len(BASE))):
        assert len(got[rid]["output_ids"]) < BASE[int(rid[4:])].max_new_tokens, (rid, got[rid])
        assert got[rid]["meta_info"]["finish_reason"]["type"] == "stop", got[rid]["meta_info"]
    modes = {rid: set(r["meta_info"][REQUEST_MODES_KEY]) for rid, r in got.items()}
    assert any("spec" in m for m in modes.values()) and any("plain" in m for m in modes.values()), modes
    # n = 2: two copies per request, equal to each other and to the baseline's.
    assert [len(t) for t in twins] == [2, 2, 2]
    assert [[c["output_ids"] for c in t] for t in twins] == [[c["output_ids"] for c in t] for t in ref_twins]
    assert all(t[0]["output_ids"] == t[1]["output_ids"] for t in twins)
