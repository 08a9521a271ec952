"""End to end on real SGLang (CPU test bed): after a weight update, EAGLE3_DYNAMIC decodes
with the new weights in both modes, as a non-speculative server does after the same update.

Each server serves the same waves (crossing threshold 3 both ways), loads new target
weights and serves the waves again: the reference from disk, EAGLE3_DYNAMIC from disk
(``/update_weights_from_disk``) or as tensors (``/update_weights_from_tensor``, the
RL trainers' route). The
update is the test bed's ``target-update``: new random weights for the target's
layers 1 and up. SGLang loads an update's path into the EAGLE draft too; the one-layer
draft skips those names, so the draft is unchanged and the update runs as it would in
production (a new target checkpoint for an unchanged draft).

The CPU bed has no CUDA graphs: what this shows is that the plain step and the
catch-up read the target's current weights and that the scheduler stays healthy.
The plain graph's part (dropped at an update, recaptured on request) is checked on the
H200 by ``benchmarks/h200/parity.sh`` (``benchmarks/results/h200-20261201-parity/``) and
by ``test_plain_step_plumbing.py``.
"""

from __future__ import annotations

import pytest

from dynspec_testbed.server import (
    OVERLAP_CI_ENV,
    CpuServer,
    assert_no_kv_left,
    baseline_server_args,
    dynamic_server_args,
    serve,
    update_weights_from_disk,
    update_weights_from_tensor,
)
from dynspec_testbed.workload import compare_outputs, plugin_counters, run_waves, waves_of
from sglang_dynspec.config import REQUEST_MODES_ENV, REQUEST_MODES_KEY

pytestmark = pytest.mark.server

WAVES = waves_of([1, 6, 1, 6], seed=31, prefix="wu", new_tokens=(16, 24))
REQUESTS = sum(len(w) for w in WAVES)


def serve_update_serve(url: str, path, between=None, update=update_weights_from_disk):
    before = run_waves(url, WAVES)
    if between is not None:
        between()
    update(url, path)
    after = run_waves(url, WAVES)
    return before, after


@pytest.fixture(scope="module")
def reference(tiny_models, tmp_path_factory):
    log = tmp_path_factory.mktemp("weight-update") / "reference.log"
    return serve(
        baseline_server_args(tiny_models),
        lambda url: serve_update_serve(url, tiny_models["target-update"]),
        log_path=log,
        env=OVERLAP_CI_ENV,
    )


# The same checkpoint sent as tensors (SGLang's /update_weights_from_tensor, inside the
# weight-update session that 0.5.23 requires) must give the disk-updated reference's outputs.
UPDATES = {"disk": update_weights_from_disk, "tensor": update_weights_from_tensor}


@pytest.mark.parametrize("method", UPDATES)
def test_after_a_weight_update_both_modes_use_the_new_weights(method, tiny_models, reference, tmp_path):
    ref_before, ref_after = reference
    # The update changes every request's output: a server still on the old weights fails below.
    changed = [rid for rid in ref_before if ref_before[rid]["output_ids"] != ref_after[rid]["output_ids"]]
    assert len(changed) == REQUESTS

    args = dynamic_server_args(tiny_models, extra=["--enable-metrics"])
    counters = {}
    with CpuServer(
        args, log_path=tmp_path / "dynamic.log", env={**OVERLAP_CI_ENV, REQUEST_MODES_ENV: "1"}
    ) as server:

        def note_counters():
            counters["before"] = plugin_counters(server.url)

        before, after = serve_update_serve(
            server.url, tiny_models["target-update"], note_counters, update=UPDATES[method]
        )
        counters["after"] = plugin_counters(server.url)
        assert_no_kv_left(server.url)

    assert [str(m) for m in compare_outputs(ref_before, before)] == []
    assert [str(m) for m in compare_outputs(ref_after, after)] == []
    # Both modes ran after the update: requests decoded only plain and requests that speculated.
    modes = [set(r["meta_info"][REQUEST_MODES_KEY]) for r in after.values()]
    assert {"plain"} in modes and any("spec" in m for m in modes), modes
    grew = {
        k: getattr(counters["after"], k) - getattr(counters["before"], k)
        for k in ("steps_plain", "steps_spec")
    }
    assert grew["steps_plain"] > 0 and grew["steps_spec"] > 0, grew
