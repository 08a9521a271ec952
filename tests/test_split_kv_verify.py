"""The target's verify attention through SGLang's split-KV verify kernel
(``SGLANG_DYNSPEC_SPLIT_KV_VERIFY``, ``compat.use_split_kv_verify``).

* The switch: on real ``TritonAttnBackend`` objects, it sets SGLang's own flag on the
  target's triton backends with ``--speculative-eagle-topk 1`` only, says why not
  otherwise (naming the flag), and the step-cost cache key tells the two kernels
  apart. The flag is the one ``TritonAttnBackend.forward_extend`` reads for a
  TARGET_VERIFY forward in the installed SGLang (an upgrade that renames it fails here).
* The kernel: SGLang's ``verify_splitkv_fwd`` against the kernel it replaces
  (``extend_attention_fwd`` with the verify's chain mask, as the backend calls it) and a
  float64 reference, run by Triton's interpreter on this CPU, in a subprocess (the
  interpreter is chosen when the kernels are defined): batches with different prefix
  lengths, grouped-query heads, draft lengths that are not a power of two, and the
  index buffer of a captured CUDA graph, longer than the batch's prefixes (the kernel
  derives its split count from that buffer's length).

* A real server: EAGLE3_DYNAMIC with the switch on SGLang's triton attention backend,
  every triton kernel run by Triton's interpreter on the CPU, serves the
  non-speculative server's greedy tokens (same backend) through plain and speculative
  steps with the agreeing pair (every draft accepted, so the verify's attention decides
  four tokens per step), the split-KV kernel ran (the test bed logs its first call),
  and no KV slot is left.

The hook's start-up line under the CPU's usual attention backend is asserted in
``test_e2e_dynamic.py``; the kernel's speed and its numerics at the 8B shape in bf16
are the H200's (``benchmarks/h200/splitkv_check.py``).
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import schedule_batches  # noqa: F401  (sets up the CPU import of SGLang first)

from dynspec_testbed.plugin import SPLIT_KV_LOG_ENV, SPLIT_KV_RAN
from dynspec_testbed.server import (
    CI_ENV,
    CpuServer,
    assert_no_kv_left,
    baseline_server_args,
    dynamic_server_args,
    serve,
)
from dynspec_testbed.workload import compare_outputs, plugin_counters, run_waves, waves_of
from sglang_dynspec import compat, config


def _triton_backend(deterministic: bool = False, rows: int = 129, heads: int = 32, draft_tokens: int = 4):
    """A real ``TritonAttnBackend`` with only the attributes the switch reads (its
    constructor needs a model runner on a GPU); the 8B target's heads by default."""
    backend = object.__new__(compat.TritonAttnBackend)
    backend.use_verify_splitkv = False
    backend.enable_deterministic = deterministic
    backend.req_to_token_pool = types.SimpleNamespace(size=rows)
    backend.num_draft_tokens = draft_tokens
    backend.num_head = heads
    backend.v_head_dim = 128
    return backend


def _worker(attn_backend, decode_backend=None, topk: int = 1):
    runner = types.SimpleNamespace(
        attn_backend=attn_backend, decode_attn_backend=decode_backend or attn_backend
    )
    return types.SimpleNamespace(
        target_worker=types.SimpleNamespace(model_runner=runner), topk=topk, device="cpu"
    )


def _one_rank(fits):  # the agreement of a single tensor-parallel rank
    return [fits]


@pytest.fixture(autouse=True)
def _keep_sglangs_scratch_class(monkeypatch):
    # The switch installs the plugin's scratch class in SGLang's module; undo it after each test.
    monkeypatch.setattr(compat.verify_splitkv, "VerifySplitKV", compat.verify_splitkv.VerifySplitKV)


def test_the_switch_sets_sglangs_flag_on_every_triton_backend_of_the_target():
    prefill, decode = _triton_backend(), _triton_backend()
    worker = _worker(prefill, decode)
    assert compat.verify_attention_kernel(worker) == "sglang"
    verify = compat.use_split_kv_verify(worker, gather=_one_rank)
    assert verify.split_kv and "split-KV" in verify.note
    assert prefill.use_verify_splitkv and decode.use_verify_splitkv
    assert compat.verify_splitkv.VerifySplitKV is compat.ZeroedSplitKVScratch
    assert compat.verify_attention_kernel(worker) == "split-kv"


@pytest.mark.parametrize("topk", [2, 4])
def test_a_tree_keeps_sglangs_kernel(topk):
    backend = _triton_backend()
    verify = compat.use_split_kv_verify(_worker(backend, topk=topk), gather=_one_rank)
    assert not verify.split_kv and not backend.use_verify_splitkv
    assert f"--speculative-eagle-topk {topk}" in verify.note


def test_another_attention_backend_is_left_alone():
    other = types.SimpleNamespace(use_verify_splitkv=False)
    verify = compat.use_split_kv_verify(_worker(other), gather=_one_rank)
    assert not verify.split_kv and other.use_verify_splitkv is False
    assert "--attention-backend triton" in verify.note and "SimpleNamespace" in verify.note
    assert compat.verify_attention_kernel(_worker(other)) == "sglang"


@pytest.mark.parametrize("rows, heads, draft_tokens", [(129, 32, 4), (17, 8, 5), (3, 2, 2)])
def test_the_scratch_estimate_is_what_sglang_allocates_at_every_split_count(rows, heads, draft_tokens):
    backend = _triton_backend(rows=rows, heads=heads, draft_tokens=draft_tokens)
    allocated = 0
    n = compat.verify_splitkv.MIN_N_SPLITS
    while n <= compat.verify_splitkv.MAX_N_SPLITS:  # every count choose_n_splits can pick
        scratch = compat.verify_splitkv.VerifySplitKV(
            rows, heads, 1, 128, 128, draft_tokens, device="cpu", n_splits=n
        )
        allocated += scratch.att_out.nbytes + scratch.att_lse.nbytes
        n *= 2
    assert compat.split_kv_scratch_bytes(backend) == allocated


def test_a_scratch_that_does_not_fit_keeps_sglangs_kernel_with_a_warning(monkeypatch):
    backend = _triton_backend(rows=4097)
    needed = compat.split_kv_scratch_bytes(backend)
    monkeypatch.setattr(
        compat, "free_device_memory", lambda device: needed + compat.SPLIT_KV_MEMORY_HEADROOM - 1
    )
    verify = compat.use_split_kv_verify(_worker(backend), gather=_one_rank)
    assert not verify.split_kv and verify.warning and not backend.use_verify_splitkv
    assert "4097 request rows" in verify.note and "--max-running-requests" in verify.note
    assert compat.verify_splitkv.VerifySplitKV is not compat.ZeroedSplitKVScratch
    monkeypatch.setattr(compat, "free_device_memory", lambda device: needed + compat.SPLIT_KV_MEMORY_HEADROOM)
    verify = compat.use_split_kv_verify(_worker(backend), gather=_one_rank)
    assert verify.split_kv and not verify.warning and f"{needed / 2**20:.0f} MiB of scratch" in verify.note


@pytest.mark.parametrize("other_rank_fits", [True, False])
def test_every_tensor_parallel_rank_runs_the_same_kernel(other_rank_fits):
    """The scratch fits on this rank; the other rank's answer decides for both."""
    backend = _triton_backend()
    verify = compat.use_split_kv_verify(_worker(backend), gather=lambda fits: [fits, other_rank_fits])
    assert verify.split_kv is other_rank_fits and backend.use_verify_splitkv is other_rank_fits
    assert verify.warning is not other_rank_fits


def test_deterministic_inference_is_named_as_what_keeps_the_old_kernel():
    backend = _triton_backend(deterministic=True)
    verify = compat.use_split_kv_verify(_worker(backend), gather=_one_rank)
    assert backend.use_verify_splitkv
    assert "--enable-deterministic-inference" in verify.note


def test_the_installed_backend_routes_the_verify_by_that_flag():
    """The flag the switch sets is what ``forward_extend`` reads for a TARGET_VERIFY
    forward, after the deterministic kernel's early return (which the note names)."""
    source = inspect.getsource(compat.TritonAttnBackend.forward_extend)
    flag = source.index("self.use_verify_splitkv")
    assert "is_target_verify()" in source[flag:]
    assert source.index("self.enable_deterministic") < flag
    assert "verify_splitkv_fwd" in source[flag:]


@pytest.mark.parametrize(
    "raw, expected", [(None, True), ("", True), ("1", True), ("0", False), ("off", False)]
)
def test_the_split_kv_verify_is_on_by_default(raw, expected):
    environ = {} if raw is None else {config.SPLIT_KV_VERIFY_ENV: raw}
    assert config.settings_from_environ(environ).split_kv_verify is expected


def test_a_bad_value_names_the_variable():
    with pytest.raises(config.ConfigError, match=config.SPLIT_KV_VERIFY_ENV):
        config.settings_from_environ({config.SPLIT_KV_VERIFY_ENV: "fast"})


# The kernels under Triton's interpreter, in a child process: for each scratch class
# (SGLang's own and the plugin's zeroed one) and each case, the split-KV verify's output
# against the prefill kernel's and a float64 reference. A fresh scratch buffer is filled
# with NaN first: what torch.empty may hand out (in a fresh child it is zeros, which would
# hide the hazard).
_KERNEL_SCRIPT = textwrap.dedent(
    """
    import json, math, sys
    sys.path.insert(0, sys.argv[2])
    import schedule_batches  # the CPU import of SGLang
    import torch
    from sglang.kernels.ops.attention import verify_splitkv
    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd
    from sglang_dynspec import compat

    SGLANGS = compat.ZeroedSplitKVScratch.__mro__[1]
    allocate = SGLANGS._alloc

    def garbage_alloc(self, max_bs):
        allocate(self, max_bs)
        self.att_out.fill_(float("nan"))

    SGLANGS._alloc = garbage_alloc

    def reference(q, k, v, kb, vb, prefix_lens, kv_indices, draft, scale):
        out, start, row = [], 0, 0
        for n in prefix_lens:
            idx = kv_indices[start:start + n]
            start += n
            keys = torch.cat([kb[idx], k[row:row + draft]]).double()  # [n + draft, hkv, d]
            values = torch.cat([vb[idx], v[row:row + draft]]).double()
            group = q.shape[1] // keys.shape[1]
            keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
            scores = torch.einsum("qhd,khd->hqk", q[row:row + draft].double(), keys) * scale
            visible = torch.ones(draft, n + draft, dtype=torch.bool)
            visible[:, n:] = torch.tril(torch.ones(draft, draft, dtype=torch.bool))
            scores = scores.masked_fill(~visible, float("-inf"))
            out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), values))
            row += draft
        return torch.cat(out)

    def worst(a, b):
        d = (a.double() - b.double()).abs().max().item()
        return None if math.isnan(d) else d  # JSON has no NaN

    results = {}
    for name, scratch in (("sglang", SGLANGS), ("plugin", compat.ZeroedSplitKVScratch)):
        verify_splitkv.VerifySplitKV = scratch
        verify_splitkv._VK_CACHE.clear()
        results[name] = []
        for case in json.loads(sys.argv[1]):
            torch.manual_seed(case["seed"])
            prefix_lens, draft, hq, hkv, d = case["prefix_lens"], case["draft"], case["hq"], case["hkv"], case["d"]
            bs, pool = len(prefix_lens), sum(prefix_lens) + 64
            kb, vb = torch.randn(pool, hkv, d), torch.randn(pool, hkv, d)
            kv_indices = torch.randperm(pool)[: sum(prefix_lens)]
            # A captured graph's index buffer is longer than the batch's prefixes.
            kv_indices = torch.cat([kv_indices, torch.zeros(case["spare_indices"], dtype=torch.int64)])
            kv_indptr = torch.zeros(bs + 1, dtype=torch.int32)
            kv_indptr[1:] = torch.cumsum(torch.tensor(prefix_lens), 0)
            qo_indptr = torch.arange(0, (bs + 1) * draft, draft, dtype=torch.int32)
            q, k, v = torch.randn(bs * draft, hq, d), torch.randn(bs * draft, hkv, d), torch.randn(bs * draft, hkv, d)
            # The verify's tree mask of a chain, as the triton backend passes it: per
            # request, draft rows of (prefix + draft) columns.
            masks = []
            for n in prefix_lens:
                m = torch.ones(draft, n + draft, dtype=torch.bool)
                m[:, n:] = torch.tril(torch.ones(draft, draft, dtype=torch.bool))
                masks.append(m.flatten())
            mask_indptr = torch.zeros(bs + 1, dtype=torch.int64)
            mask_indptr[1:] = torch.cumsum(torch.tensor([draft * (n + draft) for n in prefix_lens]), 0)
            scale = d ** -0.5
            split, prefill = torch.empty_like(q), torch.empty_like(q)
            ran = verify_splitkv.verify_splitkv_fwd(
                q, k, v, split, kb, vb, qo_indptr, kv_indptr, kv_indices, torch.cat(masks), True,
                mask_indptr, draft, 1.0, 1.0, scale, max_bs=bs,
            )
            extend_attention_fwd(
                q, k, v, prefill, kb, vb, qo_indptr, kv_indptr, kv_indices, torch.cat(masks), True,
                mask_indptr, draft, 1.0, 1.0, scale,
            )
            ref = reference(q, k, v, kb, vb, prefix_lens, kv_indices, draft, scale)
            results[name].append({
                "ran": ran,
                "split_vs_prefill": worst(split, prefill),
                "split_vs_reference": worst(split, ref),
                "prefill_vs_reference": worst(prefill, ref),
            })
    print(json.dumps(results))
    """
)

KERNEL_CASES = [
    # One request, a prefix shorter than one key block: 3 of 4 splits hold no keys.
    {"prefix_lens": [5], "draft": 4, "hq": 4, "hkv": 4, "d": 32, "spare_indices": 0, "seed": 1},
    # Different prefix lengths, grouped-query heads (4 per KV head), as the 8B target.
    {"prefix_lens": [17, 70, 3], "draft": 4, "hq": 8, "hkv": 2, "d": 64, "spare_indices": 0, "seed": 2},
    # Draft length 5 (tiles padded to 8); a graph-sized index buffer: 16 splits, most empty.
    {"prefix_lens": [40, 9], "draft": 5, "hq": 4, "hkv": 1, "d": 32, "spare_indices": 20000, "seed": 3},
    # Draft length 2; prefixes long enough that every split holds keys.
    {"prefix_lens": [256, 200], "draft": 2, "hq": 2, "hkv": 2, "d": 16, "spare_indices": 0, "seed": 4},
]


@pytest.fixture(scope="module")
def kernel_results() -> dict[str, list[dict]]:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run(
        [sys.executable, "-c", _KERNEL_SCRIPT, json.dumps(KERNEL_CASES), str(Path(__file__).parent)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])
    assert {name: len(r) for name, r in results.items()} == {
        "sglang": len(KERNEL_CASES),
        "plugin": len(KERNEL_CASES),
    }
    return results


def test_split_kv_verify_computes_the_prefill_kernels_attention(kernel_results):
    for case, result in zip(KERNEL_CASES, kernel_results["plugin"]):
        assert result["ran"], (case, "the split-KV kernel refused a case it serves")
        # float32 accumulation in both kernels; the reference is float64 (None: NaN).
        for key in ("split_vs_reference", "prefill_vs_reference", "split_vs_prefill"):
            assert result[key] is not None and result[key] < 1e-5, (case, key, result)


def test_sglangs_scratch_lets_garbage_through_where_a_split_holds_no_keys(kernel_results):
    """Why the plugin zeroes the scratch: with NaN in a fresh buffer, SGLang's own class
    returns NaN wherever a split held no keys (cases 0-2), and is right where every split
    held keys (case 3)."""
    sglangs = kernel_results["sglang"]
    assert [r["split_vs_reference"] is None for r in sglangs] == [True, True, True, False], sglangs
    assert all(r["prefill_vs_reference"] is not None for r in sglangs)


# A wave of 3 (plain: above the threshold of 2), then one request alone (speculative).
SERVED_WAVES = waves_of([3, 1], seed=31, prefix="splitkv", new_tokens=(12, 20))
TRITON_ON_THE_CPU = ["--attention-backend", "triton", "--enable-metrics"]


@pytest.mark.server
def test_a_server_with_the_split_kv_verify_serves_the_non_speculative_tokens(tiny_models, tmp_path):
    interpreted = {**CI_ENV, "TRITON_INTERPRET": "1"}
    reference = serve(
        baseline_server_args(tiny_models, "agree", extra=TRITON_ON_THE_CPU),
        lambda url: run_waves(url, SERVED_WAVES),
        log_path=tmp_path / "reference.log",
        env=interpreted,
    )
    args = dynamic_server_args(tiny_models, "agree", disable_above=2, extra=TRITON_ON_THE_CPU)
    log = tmp_path / "dynamic.log"
    env = {**interpreted, config.SPLIT_KV_VERIFY_ENV: "1", SPLIT_KV_LOG_ENV: "1"}
    with CpuServer(args, log_path=log, env=env) as server:
        got = run_waves(server.url, SERVED_WAVES)
        counters = plugin_counters(server.url)
        assert_no_kv_left(server.url)
    assert compare_outputs(reference, got) == []
    assert counters.steps_spec > 0 and counters.steps_plain > 0, counters
    text = log.read_text()
    assert (
        "(SGLANG_DYNSPEC_SPLIT_KV_VERIFY): SGLang's split-KV verify kernel (verify_splitkv.py) on the target"
        in text
    )
    assert SPLIT_KV_RAN in text
