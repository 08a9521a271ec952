"""The target's verify attention through SGLang's split-KV verify kernel
(``SGLANG_DYNSPEC_SPLIT_KV_VERIFY``, ``compat.use_split_kv_verify``), and through the
grouped-head kernel first (``SGLANG_DYNSPEC_GROUPED_VERIFY``, ``compat.GroupedThenPerHead``).

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
  derives its split count from that buffer's length). The grouped-head kernel the same
  way, both SGLang's (0.5.23) and the plugin's copy (``verify_grouped_kernel``), with
  the plugin's float32 partials over NaN-filled scratch, and with SGLang's bf16 partials
  (to show what they cost).

* A real server: EAGLE3_DYNAMIC with the switch on SGLang's triton attention backend,
  every triton kernel run by Triton's interpreter on the CPU, serves the
  non-speculative server's greedy tokens (same backend) through plain and speculative
  steps with the agreeing pair (every draft accepted, so the verify's attention decides
  four tokens per step), the split-KV kernel ran (the test bed logs its first call),
  and no KV slot is left; once with the per-head kernel, once with the grouped one.

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
import torch

from dynspec_testbed.plugin import GROUPED_VERIFY_RAN, SPLIT_KV_LOG_ENV, SPLIT_KV_RAN
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


def sglangs_per_head_kernel(*args, **kwargs):  # stands in for the backend's own slot
    return True


def sglangs_prefill_kernel(*args, **kwargs):  # stands in for the backend's extend_attention_fwd
    return None


def _triton_backend(
    deterministic: bool = False,
    rows: int = 129,
    heads: int = 32,
    kv_heads: int = 8,
    draft_tokens: int = 4,
    head_dim: int = 128,
    mla: bool = False,
):
    """A real ``TritonAttnBackend`` with only the attributes the switch reads (its
    constructor needs a model runner on a GPU); the 8B target's heads by default."""
    backend = object.__new__(compat.TritonAttnBackend)
    backend.use_verify_splitkv = False
    backend.enable_deterministic = deterministic
    backend.use_mla = mla
    backend.req_to_token_pool = types.SimpleNamespace(size=rows)
    backend.num_draft_tokens = draft_tokens
    backend.num_head = heads
    backend.num_kv_head = kv_heads
    backend.v_head_dim = head_dim
    backend.verify_splitkv_fwd = sglangs_per_head_kernel
    backend.extend_attention_fwd = sglangs_prefill_kernel
    return backend


def _worker(attn_backend, decode_backend=None, topk: int = 1, draft_backend=None):
    """A speculative worker with the attributes the switches read; the draft's backend is
    another kind than triton unless given (SGLang's draft extend backend is the draft
    runner's ``attn_backend`` too)."""
    runner = types.SimpleNamespace(
        attn_backend=attn_backend, decode_attn_backend=decode_backend or attn_backend
    )
    draft_backend = draft_backend if draft_backend is not None else object()
    draft_worker = types.SimpleNamespace(
        draft_extend_attn_backend=draft_backend,
        draft_runner=types.SimpleNamespace(attn_backend=draft_backend),
    )
    return types.SimpleNamespace(
        target_worker=types.SimpleNamespace(model_runner=runner),
        draft_worker=draft_worker,
        topk=topk,
        device="cpu",
    )


def _one_rank(fits):  # the agreement of a single tensor-parallel rank
    return [fits]


@pytest.fixture(autouse=True)
def _keep_sglangs_scratch_classes(monkeypatch):
    # The switch installs the plugin's scratch classes in the kernels' modules; undo it after each test.
    monkeypatch.setattr(compat.verify_splitkv, "VerifySplitKV", compat.verify_splitkv.VerifySplitKV)
    monkeypatch.setattr(compat.grouped_verify, "VerifyMLA", compat.grouped_verify.VerifyMLA)


def test_the_switch_sets_sglangs_flag_on_every_triton_backend_of_the_target():
    prefill, decode = _triton_backend(), _triton_backend()
    worker = _worker(prefill, decode)
    assert compat.verify_attention_kernel(worker) == "sglang"
    verify = compat.use_split_kv_verify(worker, gather=_one_rank)
    assert verify.split_kv and "split-KV" in verify.note
    assert prefill.use_verify_splitkv and decode.use_verify_splitkv
    assert compat.verify_splitkv.VerifySplitKV is compat.ZeroedSplitKVScratch
    assert compat.verify_attention_kernel(worker) == "split-kv"


def test_the_grouped_switch_puts_the_grouped_kernel_first_in_every_backends_slot():
    prefill, decode = _triton_backend(), _triton_backend()
    worker = _worker(prefill, decode)
    verify = compat.use_split_kv_verify(worker, gather=_one_rank, grouped=True)
    assert verify.split_kv and "grouped-head" in verify.note and "per-head" in verify.note
    for backend in (prefill, decode):
        assert backend.use_verify_splitkv
        assert isinstance(backend.verify_splitkv_fwd, compat.GroupedThenPerHead)
        assert backend.verify_splitkv_fwd.per_head is sglangs_per_head_kernel
    assert compat.grouped_verify.VerifyMLA is compat.Float32PartialsGroupedVerify
    assert compat.verify_splitkv.VerifySplitKV is compat.ZeroedSplitKVScratch
    assert compat.verify_attention_kernel(worker) == "grouped-split-kv"
    # A second call (the draft worker's backends may be set up again) wraps nothing twice.
    compat.use_split_kv_verify(worker, gather=_one_rank, grouped=True)
    assert prefill.verify_splitkv_fwd.per_head is sglangs_per_head_kernel


def test_without_the_grouped_switch_the_slot_keeps_sglangs_kernel():
    backend = _triton_backend()
    compat.use_split_kv_verify(_worker(backend), gather=_one_rank)
    assert backend.verify_splitkv_fwd is sglangs_per_head_kernel
    assert compat.grouped_verify.VerifyMLA is not compat.Float32PartialsGroupedVerify


@pytest.mark.parametrize("grouped_serves", [True, False])
def test_the_per_head_kernel_runs_only_what_the_grouped_kernel_declines(monkeypatch, grouped_serves):
    calls = []

    def grouped(*args, **kwargs):
        calls.append(("grouped", args, kwargs))
        return grouped_serves

    def per_head(*args, **kwargs):
        calls.append(("per-head", args, kwargs))
        return True

    monkeypatch.setattr(compat.grouped_verify, "verify_shared_kv_fwd", grouped)
    slot = compat.GroupedThenPerHead(per_head)
    assert slot("q", "k", max_bs=3) is True
    expected = [("grouped", ("q", "k"), {"max_bs": 3})]
    if not grouped_serves:
        expected.append(("per-head", ("q", "k"), {"max_bs": 3}))
    assert calls == expected


def test_splits_by_batch_puts_the_plugins_per_head_dispatch_in_every_backends_slot():
    prefill, decode = _triton_backend(), _triton_backend()
    worker = _worker(prefill, decode)
    verify = compat.use_split_kv_verify(worker, gather=_one_rank, splits_by_batch=True)
    assert verify.split_kv and "by batch size" in verify.note
    for backend in (prefill, decode):
        assert backend.verify_splitkv_fwd.__wrapped__ is compat.per_head_verify_splits_by_batch
    assert compat.verify_attention_kernel(worker) == "split-kv-splits-by-batch"


def test_splits_by_batch_with_the_grouped_kernel_serves_what_the_grouped_kernel_declines():
    backend = _triton_backend()
    worker = _worker(backend)
    compat.use_split_kv_verify(worker, gather=_one_rank, grouped=True, splits_by_batch=True)
    assert isinstance(backend.verify_splitkv_fwd, compat.GroupedThenPerHead)
    assert backend.verify_splitkv_fwd.per_head.__wrapped__ is compat.per_head_verify_splits_by_batch
    assert compat.verify_attention_kernel(worker) == "grouped-split-kv-splits-by-batch"
    compat.use_split_kv_verify(worker, gather=_one_rank, grouped=True, splits_by_batch=True)
    assert backend.verify_splitkv_fwd.per_head.__wrapped__ is compat.per_head_verify_splits_by_batch


def test_the_split_count_rule_over_every_batch_size_and_head_count():
    lowest, highest = compat.verify_splitkv.MIN_N_SPLITS, compat.verify_splitkv.MAX_N_SPLITS
    for heads in (1, 2, 4, 8, 14, 24, 28, 32, 40, 64, 128):
        previous = highest
        for bs in range(1, 4097):
            splits = compat.split_kv_splits(bs, heads)
            assert lowest <= splits <= highest and splits & (splits - 1) == 0, (bs, heads, splits)
            assert splits <= previous, ("more splits for a larger batch", bs, heads)
            previous = splits
            # The largest count within the program budget (the smallest if none is).
            assert splits == lowest or bs * heads * splits <= compat.SPLIT_KV_PROGRAMS, (bs, heads)
            assert splits == highest or bs * heads * splits * 2 > compat.SPLIT_KV_PROGRAMS, (bs, heads)


def test_the_split_count_at_the_8b_targets_heads_is_what_the_h100_timings_favour():
    """benchmarks/results/h100-20261205-a5a50b8/splitkv.jsonl, in-graph: 16 splits paid at
    batch 1 with long prefixes; 4 were faster from batch 64 at every prefix (and at
    batch 16 up to prefix 1024)."""
    assert [compat.split_kv_splits(bs, 32) for bs in (1, 8, 16, 32, 64, 128)] == [16, 16, 8, 4, 4, 4]


@pytest.mark.parametrize("raw, expected", [(None, True), ("1", True), ("0", False), ("off", False)])
def test_splits_by_batch_is_on_by_default(raw, expected):
    environ = {} if raw is None else {config.SPLITS_BY_BATCH_ENV: raw}
    assert config.settings_from_environ(environ).splits_by_batch is expected


@pytest.mark.parametrize("raw, expected", [(None, True), ("1", True), ("0", False), ("off", False)])
def test_the_draft_extend_split_kv_is_on_by_default(raw, expected):
    environ = {} if raw is None else {config.SPLIT_KV_DRAFT_EXTEND_ENV: raw}
    assert config.settings_from_environ(environ).split_kv_draft_extend is expected


def test_an_mla_target_keeps_sglangs_kernel():
    backend = _triton_backend(mla=True)
    verify = compat.use_split_kv_verify(_worker(backend), gather=_one_rank, grouped=True)
    assert not verify.split_kv and not backend.use_verify_splitkv and "MLA" in verify.note
    assert backend.verify_splitkv_fwd is sglangs_per_head_kernel


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


SCRATCH_SHAPES = [  # rows, query heads, KV heads, draft tokens, head dimension
    (129, 32, 8, 4, 128),  # the 8B target
    (17, 8, 2, 5, 64),
    (3, 4, 2, 2, 128),  # a group of 2 query heads per KV head: a smaller head block
    (5, 4, 1, 3, 256),  # one KV head; a head dimension with its own block configuration
    (3, 2, 2, 2, 16),
]


def _per_head_scratch(rows, heads, draft_tokens, head_dim) -> int:
    allocated = 0
    n = compat.verify_splitkv.MIN_N_SPLITS
    while n <= compat.verify_splitkv.MAX_N_SPLITS:  # every count choose_n_splits can pick
        scratch = compat.verify_splitkv.VerifySplitKV(
            rows, heads, 1, head_dim, head_dim, draft_tokens, device="cpu", n_splits=n
        )
        allocated += scratch.att_out.nbytes + scratch.att_lse.nbytes
        n *= 2
    return allocated


@pytest.mark.parametrize("rows, heads, kv_heads, draft_tokens, head_dim", SCRATCH_SHAPES)
def test_the_scratch_estimate_is_what_sglang_allocates_at_every_split_count(
    rows, heads, kv_heads, draft_tokens, head_dim
):
    backend = _triton_backend(
        rows=rows, heads=heads, kv_heads=kv_heads, draft_tokens=draft_tokens, head_dim=head_dim
    )
    assert compat.split_kv_scratch_bytes(backend) == _per_head_scratch(rows, heads, draft_tokens, head_dim)


@pytest.mark.parametrize("rows, heads, kv_heads, draft_tokens, head_dim", SCRATCH_SHAPES)
def test_the_grouped_scratch_estimate_adds_what_the_grouped_kernel_allocates(
    monkeypatch, rows, heads, kv_heads, draft_tokens, head_dim
):
    """The grouped kernel's scratch as its own cache builds it for the backend's call
    (``max_bs`` = the pool's rows), with the plugin's float32 partials."""
    backend = _triton_backend(
        rows=rows, heads=heads, kv_heads=kv_heads, draft_tokens=draft_tokens, head_dim=head_dim
    )
    monkeypatch.setattr(compat.grouped_verify, "VerifyMLA", compat.Float32PartialsGroupedVerify)
    monkeypatch.setattr(compat.grouped_verify, "_VMLA_CACHE", {})
    scratch = compat.grouped_verify._get_vmla(
        rows, heads, head_dim, head_dim, draft_tokens, "cpu", heads // kv_heads
    )
    assert scratch.att_out.dtype == torch.float32
    grouped = scratch.att_out.nbytes + scratch.att_lse.nbytes
    assert compat.split_kv_scratch_bytes(backend, grouped=True) == (
        _per_head_scratch(rows, heads, draft_tokens, head_dim) + grouped
    )


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


# ---------------------------------------------------------------- the draft extend
def test_the_draft_extend_switch_puts_the_split_kv_kernel_in_the_draft_backends_prefill_slot():
    target, draft = _triton_backend(), _triton_backend()
    worker = _worker(target, draft_backend=draft)
    compat.use_split_kv_verify(worker, gather=_one_rank, splits_by_batch=True)
    choice = compat.use_split_kv_draft_extend(worker, gather=_one_rank, splits_by_batch=True)
    assert choice.split_kv and not choice.warning
    assert "draft extend's 4 positions per request, the target's scratch" in choice.note
    slot = draft.extend_attention_fwd
    assert isinstance(slot, compat.SplitKVThenPrefill) and slot.prefill is sglangs_prefill_kernel
    assert slot.split_kv.__wrapped__ is compat.per_head_verify_splits_by_batch
    assert (slot.max_tokens, slot.max_bs) == (4, 129)
    assert target.extend_attention_fwd is sglangs_prefill_kernel  # the target's extends keep SGLang's
    assert compat.verify_attention_kernel(worker) == "split-kv-splits-by-batch+draft-extend-split-kv"
    # Set up again (SGLang may rebuild the draft's backends): nothing is wrapped twice.
    compat.use_split_kv_draft_extend(worker, gather=_one_rank)
    assert draft.extend_attention_fwd is slot


def test_the_draft_extend_alone_takes_sglangs_split_count_and_scratch_of_its_own():
    target, draft = _triton_backend(), _triton_backend()
    worker = _worker(target, draft_backend=draft)
    choice = compat.use_split_kv_draft_extend(worker, gather=_one_rank)
    assert choice.split_kv and "of scratch of its own" in choice.note
    assert draft.extend_attention_fwd.split_kv.__wrapped__ is compat.verify_splitkv.verify_splitkv_fwd
    assert compat.verify_splitkv.VerifySplitKV is compat.ZeroedSplitKVScratch
    assert compat.verify_attention_kernel(worker) == "sglang+draft-extend-split-kv"


def test_a_draft_of_another_shape_has_its_scratch_checked_against_free_memory(monkeypatch):
    target, draft = _triton_backend(), _triton_backend(heads=16, kv_heads=4)
    worker = _worker(target, draft_backend=draft)
    compat.use_split_kv_verify(worker, gather=_one_rank)
    needed = compat.split_kv_scratch_bytes(draft)
    assert needed != compat.split_kv_scratch_bytes(target)
    monkeypatch.setattr(
        compat, "free_device_memory", lambda device: needed + compat.SPLIT_KV_MEMORY_HEADROOM - 1
    )
    choice = compat.use_split_kv_draft_extend(worker, gather=_one_rank)
    assert not choice.split_kv and choice.warning and "--max-running-requests" in choice.note
    assert draft.extend_attention_fwd is sglangs_prefill_kernel
    monkeypatch.setattr(compat, "free_device_memory", lambda device: needed + compat.SPLIT_KV_MEMORY_HEADROOM)
    choice = compat.use_split_kv_draft_extend(worker, gather=_one_rank)
    assert choice.split_kv and f"{needed / 2**20:.0f} MiB of scratch of its own" in choice.note


@pytest.mark.parametrize("other_rank_fits", [True, False])
def test_every_rank_runs_the_same_draft_extend_kernel(other_rank_fits):
    draft = _triton_backend()
    worker = _worker(_triton_backend(), draft_backend=draft)
    choice = compat.use_split_kv_draft_extend(worker, gather=lambda fits: [fits, other_rank_fits])
    assert choice.split_kv is other_rank_fits
    assert isinstance(draft.extend_attention_fwd, compat.SplitKVThenPrefill) is other_rank_fits


@pytest.mark.parametrize(
    "draft, topk, named",
    [
        (object(), 1, "--speculative-draft-attention-backend triton"),
        (_triton_backend(), 2, "--speculative-eagle-topk 2"),
        (_triton_backend(mla=True), 1, "multi-head latent attention"),
    ],
)
def test_the_draft_extend_keeps_sglangs_kernel_where_the_split_kv_kernel_does_not_apply(draft, topk, named):
    choice = compat.use_split_kv_draft_extend(
        _worker(_triton_backend(), topk=topk, draft_backend=draft), _one_rank
    )
    assert not choice.split_kv and named in choice.note
    assert getattr(draft, "extend_attention_fwd", sglangs_prefill_kernel) is sglangs_prefill_kernel


def test_deterministic_inference_is_named_for_the_draft_extend_too():
    choice = compat.use_split_kv_draft_extend(
        _worker(_triton_backend(), draft_backend=_triton_backend(deterministic=True)), _one_rank
    )
    assert "--enable-deterministic-inference" in choice.note


def _slot_and_calls(split_serves: bool = True):
    calls = []

    def split_kv(*args, **kwargs):
        calls.append(("split-kv", args, kwargs))
        return split_serves

    def prefill(*args, **kwargs):
        calls.append(("prefill", args, kwargs))

    return compat.SplitKVThenPrefill(prefill, split_kv, max_tokens=4, max_bs=129), calls


def _call(slot, custom_mask=None, is_causal=True, max_len_extend=4, **options):
    """The slot called as TritonAttnBackend.forward_extend calls the prefill kernel: 16
    arguments by position (placeholders where only the gate's are read), then options."""
    head = tuple(f"arg{i}" for i in range(9))
    return slot(*head, custom_mask, is_causal, "mask_indptr", max_len_extend, 1.0, 1.0, 0.125, **options)


@pytest.mark.parametrize(
    "change, served",
    [
        ({}, True),  # the draft extend: 4 positions per request, no mask, causal
        # Shorter than a draft (a catch-up of uniform gaps): SGLang caches the kernel's scratch
        # per length, and only the draft length's is the verify's, counted at start-up.
        ({"max_len_extend": 3}, False),
        ({"extend_seq_lens_cpu": [4, 4], "page_size": 1, "sinks": None, "logit_cap": 0.0}, True),
        ({"max_len_extend": 5}, False),  # longer than a draft: a prompt, the prefill kernel's
        ({"max_len_extend": torch.tensor(4)}, False),  # not a Python value: no reading it in a graph
        ({"custom_mask": torch.ones(4, dtype=torch.bool)}, False),  # a tree or another mask
        ({"is_causal": False}, False),
        ({"lse_extend": torch.empty(4)}, False),  # 0.5.23's chunked prefill asks for the LSE
        ({"skip_prefix": True}, False),
        ({"skip_extend": True}, False),
        ({"identity_kv_indices": True}, False),
        ({"page_size": 16}, False),
        ({"score_mod": max}, False),
        ({"aux_tensors": [torch.empty(1)]}, False),
        ({"an_option_of_a_later_sglang": 0}, False),
    ],
)
def test_which_extends_the_draft_slot_sends_to_the_split_kv_kernel(change, served):
    slot, calls = _slot_and_calls()
    assert _call(slot, **change) is None
    assert [kind for kind, _, _ in calls] == (["split-kv"] if served else ["prefill"])
    kind, args, kwargs = calls[0]
    assert args[:9] == tuple(f"arg{i}" for i in range(9)) and args[13:] == (1.0, 1.0, 0.125)
    if served:  # only what the split-KV kernel takes, and its scratch's rows
        assert kwargs == {"max_bs": 129, **{k: v for k, v in change.items() if k in compat.SPLIT_KV_OPTIONS}}
    else:  # SGLang's kernel gets its call unchanged
        assert kwargs == {
            k: v for k, v in change.items() if k not in ("custom_mask", "is_causal", "max_len_extend")
        }


def test_an_extend_the_split_kv_kernel_declines_runs_the_prefill_kernel_unchanged():
    slot, calls = _slot_and_calls(split_serves=False)  # can_handle: ragged rows, say
    _call(slot, extend_seq_lens_cpu=[3, 4], logit_cap=0.0)
    assert [kind for kind, _, _ in calls] == ["split-kv", "prefill"]
    assert calls[1][2] == {"extend_seq_lens_cpu": [3, 4], "logit_cap": 0.0}


def test_the_slot_takes_the_installed_prefill_kernels_arguments():
    """Its first 16 parameters are SGLang's, by name (a keyword call binds the same way),
    and every further option of the installed kernel is classified: one added by a later
    SGLang fails here until someone decides whether the split-KV kernel serves it."""
    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd

    sglangs = inspect.signature(extend_attention_fwd).parameters
    slots = list(inspect.signature(compat.SplitKVThenPrefill.__call__).parameters)[1:-1]
    assert list(sglangs)[:16] == slots
    options = list(sglangs)[16:]
    known = compat.SPLIT_KV_OPTIONS | compat.IGNORED_OPTIONS | set(compat.PREFILL_ONLY_OPTIONS)
    assert set(options) <= known, set(options) - known
    for name in set(options) & set(compat.PREFILL_ONLY_OPTIONS):
        assert sglangs[name].default == compat.PREFILL_ONLY_OPTIONS[name], name
    # ... and the backend's extends call it through that slot.
    assert "self.extend_attention_fwd(" in inspect.getsource(compat.TritonAttnBackend)


@pytest.mark.parametrize(
    "raw, expected", [(None, True), ("", True), ("1", True), ("0", False), ("off", False)]
)
def test_the_split_kv_verify_is_on_by_default(raw, expected):
    environ = {} if raw is None else {config.SPLIT_KV_VERIFY_ENV: raw}
    assert config.settings_from_environ(environ).split_kv_verify is expected


@pytest.mark.parametrize("raw, expected", [(None, False), ("0", False), ("1", True), ("on", True)])
def test_the_grouped_verify_is_off_until_timed(raw, expected):
    environ = {} if raw is None else {config.GROUPED_VERIFY_ENV: raw}
    assert config.settings_from_environ(environ).grouped_verify is expected


def test_the_grouped_verify_without_the_split_kv_verify_is_refused_naming_both():
    environ = {config.GROUPED_VERIFY_ENV: "1", config.SPLIT_KV_VERIFY_ENV: "0"}
    with pytest.raises(config.ConfigError) as refused:
        config.settings_from_environ(environ)
    message = str(refused.value)
    assert config.GROUPED_VERIFY_ENV in message and config.SPLIT_KV_VERIFY_ENV in message


@pytest.mark.parametrize(
    "name",
    [
        config.SPLIT_KV_VERIFY_ENV,
        config.GROUPED_VERIFY_ENV,
        config.SPLITS_BY_BATCH_ENV,
        config.SPLIT_KV_DRAFT_EXTEND_ENV,
    ],
)
def test_a_bad_value_names_the_variable(name):
    with pytest.raises(config.ConfigError, match=name):
        config.settings_from_environ({name: "fast"})


# What both child scripts below start with: the CPU import of SGLang, the kernels, and a
# float64 reference of causal attention over each request's prefix and its extend.
_CHILD_PRELUDE = textwrap.dedent(
    """
    import json, math, sys
    sys.path.insert(0, sys.argv[2])
    import schedule_batches  # the CPU import of SGLang
    import torch
    from sglang.kernels.ops.attention import verify_splitkv
    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd
    from sglang_dynspec import compat

    def reference(q, k, v, kb, vb, prefix_lens, extend_lens, kv_indices, scale):
        out, start, row = [], 0, 0
        for n, e in zip(prefix_lens, extend_lens):
            idx = kv_indices[start:start + n]
            start += n
            keys = torch.cat([kb[idx], k[row:row + e]]).double()  # [n + e, hkv, d]
            values = torch.cat([vb[idx], v[row:row + e]]).double()
            group = q.shape[1] // keys.shape[1]
            keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
            scores = torch.einsum("qhd,khd->hqk", q[row:row + e].double(), keys) * scale
            visible = torch.ones(e, n + e, dtype=torch.bool)
            visible[:, n:] = torch.tril(torch.ones(e, e, dtype=torch.bool))
            scores = scores.masked_fill(~visible, float("-inf"))
            out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), values))
            row += e
        return torch.cat(out)
    """
)

# The kernels under Triton's interpreter, in a child process: for each scratch class
# (SGLang's own and the plugin's zeroed one) and each case, the split-KV verify's output
# against the prefill kernel's and a float64 reference. A fresh scratch buffer is filled
# with NaN first: what torch.empty may hand out (in a fresh child it is zeros, which would
# hide the hazard).
_KERNEL_SCRIPT = _CHILD_PRELUDE + textwrap.dedent(
    """
    SGLANGS = compat.ZeroedSplitKVScratch.__mro__[1]
    allocate = SGLANGS._alloc

    def garbage_alloc(self, max_bs):
        allocate(self, max_bs)
        self.att_out.fill_(float("nan"))

    SGLANGS._alloc = garbage_alloc

    def worst(a, b):
        d = (a.double() - b.double()).abs().max().item()
        return None if math.isnan(d) else d  # JSON has no NaN

    def per_head(scratch):
        def install():
            verify_splitkv.VerifySplitKV = scratch
            verify_splitkv._VK_CACHE.clear()
        return install, verify_splitkv.verify_splitkv_fwd

    def grouped(module, verify_class):
        def install():
            # NaN in both fresh buffers: a partial of a split without keys must never be read.
            class Garbage(verify_class):
                def _alloc(self, max_bs):
                    super()._alloc(max_bs)
                    self.att_out.fill_(float("nan"))
                    self.att_lse.fill_(float("nan"))
            module.VerifyMLA = Garbage
            module._VMLA_CACHE.clear()
        return install, module.verify_shared_kv_fwd

    def splits_by_batch(programs):
        def install():
            per_head(compat.ZeroedSplitKVScratch)[0]()
            compat.SPLIT_KV_PROGRAMS = programs
        return install, compat.per_head_verify_splits_by_batch

    kernels = {
        "sglang": per_head(SGLANGS),
        "plugin": per_head(compat.ZeroedSplitKVScratch),
        # The split count by batch size: as configured, and with so few programs that
        # every case takes SGLang's smallest count.
        "plugin-splits-by-batch": splits_by_batch(compat.SPLIT_KV_PROGRAMS),
        "plugin-splits-by-batch-fewest": splits_by_batch(1),
    }
    from sglang_dynspec import verify_grouped_kernel as copy
    modules = {"copy": copy}
    if compat.grouped_verify is not copy:  # SGLang ships it (0.5.23)
        modules["sglang"] = compat.grouped_verify
    for where, module in modules.items():
        bf16_partials = module.VerifyMLA
        kernels[f"grouped-{where}-bf16-partials"] = grouped(module, bf16_partials)
        kernels[f"grouped-{where}"] = grouped(module, compat.with_float32_partials(bf16_partials))

    results = {}
    for name, (install, kernel) in kernels.items():
        install()
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
            verify_splitkv._VK_CACHE.clear()
            ran = kernel(
                q, k, v, split, kb, vb, qo_indptr, kv_indptr, kv_indices, torch.cat(masks), True,
                mask_indptr, draft, 1.0, 1.0, scale, max_bs=bs,
            )
            extend_attention_fwd(
                q, k, v, prefill, kb, vb, qo_indptr, kv_indptr, kv_indices, torch.cat(masks), True,
                mask_indptr, draft, 1.0, 1.0, scale,
            )
            ref = reference(q, k, v, kb, vb, prefix_lens, [draft] * bs, kv_indices, scale)
            results[name].append({
                "ran": ran,
                # The per-head kernel's split counts this call used (its cache's keys).
                "splits": sorted(key[-1] for key in verify_splitkv._VK_CACHE),
                "split_kv_programs": compat.SPLIT_KV_PROGRAMS,
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
    grouped = {"copy"} | ({"sglang"} if compat.grouped_verify.__name__.startswith("sglang.") else set())
    expected = {"sglang", "plugin", "plugin-splits-by-batch", "plugin-splits-by-batch-fewest"}
    for where in grouped:
        expected |= {f"grouped-{where}", f"grouped-{where}-bf16-partials"}
    assert {name: len(r) for name, r in results.items()} == {name: len(KERNEL_CASES) for name in expected}
    return results


# The draft extend's slot with the real kernels, run by Triton's interpreter: per case, which
# kernel served the extend (the split-KV kernel's calls are counted) and the slot's output
# against SGLang's prefill kernel's and a float64 reference. The draft extend calls the
# prefill kernel with no mask (causal) and max_len_extend the longest extend.
_DRAFT_EXTEND_SCRIPT = _CHILD_PRELUDE + textwrap.dedent(
    """
    verify_splitkv.VerifySplitKV = compat.ZeroedSplitKVScratch

    results = []
    for case in json.loads(sys.argv[1]):
        torch.manual_seed(case["seed"])
        prefix_lens, extend_lens, hq, hkv, d = case["prefix_lens"], case["extend_lens"], case["hq"], case["hkv"], case["d"]
        bs, pool, rows = len(prefix_lens), sum(prefix_lens) + 64, sum(extend_lens)
        kb, vb = torch.randn(pool, hkv, d), torch.randn(pool, hkv, d)
        kv_indices = torch.randperm(pool)[: sum(prefix_lens)]
        kv_indptr = torch.zeros(bs + 1, dtype=torch.int32)
        kv_indptr[1:] = torch.cumsum(torch.tensor(prefix_lens), 0)
        qo_indptr = torch.zeros(bs + 1, dtype=torch.int32)
        qo_indptr[1:] = torch.cumsum(torch.tensor(extend_lens), 0)
        q, k, v = torch.randn(rows, hq, d), torch.randn(rows, hkv, d), torch.randn(rows, hkv, d)
        scale = d ** -0.5
        served = []

        def split_kv(*args, **kwargs):
            ran = compat.per_head_verify_splits_by_batch(*args, **kwargs)
            served.append(ran)
            return ran

        slot = compat.SplitKVThenPrefill(extend_attention_fwd, split_kv, max_tokens=case["draft"], max_bs=bs)
        out, prefill = torch.empty_like(q), torch.empty_like(q)
        call = (q, k, v)
        slot(*call, out, kb, vb, qo_indptr, kv_indptr, kv_indices, None, True, None, max(extend_lens),
             1.0, 1.0, scale, logit_cap=0.0, sliding_window_size=-1, sinks=None, page_size=1)
        extend_attention_fwd(*call, prefill, kb, vb, qo_indptr, kv_indptr, kv_indices, None, True, None,
                             max(extend_lens), 1.0, 1.0, scale)
        ref = reference(q, k, v, kb, vb, prefix_lens, extend_lens, kv_indices, scale)
        results.append({
            "split_kv_served": any(served),
            "slot_vs_reference": (out.double() - ref).abs().max().item(),
            "prefill_vs_reference": (prefill.double() - ref).abs().max().item(),
        })
    print(json.dumps(results))
    """
)

DRAFT_EXTEND_CASES = [
    # The draft extend: 4 positions per request over different prefixes, 4 query heads per KV head.
    {"prefix_lens": [17, 70, 3], "extend_lens": [4, 4, 4], "draft": 4, "hq": 8, "hkv": 2, "d": 64, "seed": 5},
    # One request, a draft of one position.
    {"prefix_lens": [33], "extend_lens": [1], "draft": 1, "hq": 4, "hkv": 4, "d": 32, "seed": 6},
    # Ragged extends (a catch-up of uneven gaps): the kernel's can_handle declines them.
    {"prefix_lens": [17, 40], "extend_lens": [4, 2], "draft": 4, "hq": 4, "hkv": 2, "d": 32, "seed": 7},
    # A prompt longer than the draft: the gate keeps it on the prefill kernel.
    {"prefix_lens": [0, 5], "extend_lens": [9, 9], "draft": 4, "hq": 4, "hkv": 2, "d": 32, "seed": 8},
]


def test_the_draft_extend_slot_computes_the_prefill_kernels_attention():
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            _DRAFT_EXTEND_SCRIPT,
            json.dumps(DRAFT_EXTEND_CASES),
            str(Path(__file__).parent),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "TRITON_INTERPRET": "1"},
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])
    assert [r["split_kv_served"] for r in results] == [True, True, False, False]
    for case, result in zip(DRAFT_EXTEND_CASES, results):
        # float32 on the CPU: both kernels within float32 rounding of the float64 reference
        assert result["slot_vs_reference"] < 1e-5, (case, result)
        assert result["prefill_vs_reference"] < 1e-5, (case, result)


PLUGIN_KERNELS = ["plugin", "plugin-splits-by-batch", "plugin-splits-by-batch-fewest", "grouped-copy"] + (
    ["grouped-sglang"] if compat.grouped_verify.__name__.startswith("sglang.") else []
)


@pytest.mark.parametrize("kernel", PLUGIN_KERNELS)
def test_split_kv_verify_computes_the_prefill_kernels_attention(kernel_results, kernel):
    """The per-head kernel with the plugin's zeroed scratch, and the grouped-head kernel
    (the plugin's copy and SGLang's where it ships one) with float32 partials over a
    scratch that starts as NaN."""
    for case, result in zip(KERNEL_CASES, kernel_results[kernel]):
        assert result["ran"], (case, "the split-KV kernel refused a case it serves")
        # float32 accumulation in both kernels; the reference is float64 (None: NaN).
        for key in ("split_vs_reference", "prefill_vs_reference", "split_vs_prefill"):
            assert result[key] is not None and result[key] < 1e-5, (case, key, result)


def test_the_split_count_follows_the_batch_size_not_the_index_buffer(kernel_results):
    """SGLang's count comes from the index buffer's length over the batch size: 4 for
    these short prefixes, 16 with a captured graph's long buffer (case 2). The plugin's
    follows the batch size alone, in the same kernel, whatever the buffer."""
    assert [r["splits"] for r in kernel_results["plugin"]] == [[4], [4], [16], [4]]
    for name in ("plugin-splits-by-batch", "plugin-splits-by-batch-fewest"):
        for case, result in zip(KERNEL_CASES, kernel_results[name]):
            programs = result["split_kv_programs"]
            bs = len(case["prefix_lens"])
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(compat, "SPLIT_KV_PROGRAMS", programs)
                assert result["splits"] == [compat.split_kv_splits(bs, case["hq"])], (name, case)
    assert {r["splits"][0] for r in kernel_results["plugin-splits-by-batch"]} == {16}
    assert {r["splits"][0] for r in kernel_results["plugin-splits-by-batch-fewest"]} == {
        compat.verify_splitkv.MIN_N_SPLITS
    }


def test_the_grouped_kernels_bf16_partials_are_why_the_plugin_keeps_them_in_float32(kernel_results):
    """With SGLang's bf16 partials the grouped kernel's output is off the float64
    reference by a bf16 rounding of each split's partial (above 1e-4 with these float32
    inputs, where the float32 partials stay under 1e-5)."""
    for where in ("copy", "sglang"):
        if f"grouped-{where}-bf16-partials" not in kernel_results:
            continue
        bf16 = [r["split_vs_reference"] for r in kernel_results[f"grouped-{where}-bf16-partials"]]
        assert all(error is not None for error in bf16), bf16
        assert max(bf16) > 1e-4, bf16


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


@pytest.fixture(scope="module")
def triton_reference(tiny_models, tmp_path_factory):
    """The non-speculative server's greedy tokens on the same triton backend."""
    return serve(
        baseline_server_args(tiny_models, "agree", extra=TRITON_ON_THE_CPU),
        lambda url: run_waves(url, SERVED_WAVES),
        log_path=tmp_path_factory.mktemp("splitkv") / "reference.log",
        env={**CI_ENV, "TRITON_INTERPRET": "1"},
    )


@pytest.mark.server
@pytest.mark.parametrize("kernel", ["per-head", "grouped", "draft-extend"])
def test_a_server_with_the_split_kv_verify_serves_the_non_speculative_tokens(
    tiny_models, tmp_path, triton_reference, kernel
):
    """The tiny target has 4 query heads over 2 KV heads: the grouped kernel serves its
    verify with a head block of 2 (one KV head's pair). ``draft-extend``: the split-KV
    kernel for the draft extend alone (the target's verify keeps SGLang's prefill
    kernel), so every call of it that the test bed logs is the draft's."""
    args = dynamic_server_args(tiny_models, "agree", disable_above=2, extra=TRITON_ON_THE_CPU)
    log = tmp_path / "dynamic.log"
    env = {
        **CI_ENV,
        "TRITON_INTERPRET": "1",
        config.SPLIT_KV_VERIFY_ENV: "0" if kernel == "draft-extend" else "1",
        config.GROUPED_VERIFY_ENV: "1" if kernel == "grouped" else "0",
        config.SPLIT_KV_DRAFT_EXTEND_ENV: "1" if kernel == "draft-extend" else "0",
        SPLIT_KV_LOG_ENV: "1",
    }
    with CpuServer(args, log_path=log, env=env) as server:
        got = run_waves(server.url, SERVED_WAVES)
        counters = plugin_counters(server.url)
        assert_no_kv_left(server.url)
    assert compare_outputs(triton_reference, got) == []
    assert counters.steps_spec > 0 and counters.steps_plain > 0, counters
    text = log.read_text()
    if kernel == "grouped":
        assert (
            "(SGLANG_DYNSPEC_SPLIT_KV_VERIFY, SGLANG_DYNSPEC_GROUPED_VERIFY, "
            "SGLANG_DYNSPEC_SPLIT_KV_SPLITS_BY_BATCH): the grouped-head verify kernel" in text
        )
        assert GROUPED_VERIFY_RAN in text and SPLIT_KV_RAN not in text
    elif kernel == "draft-extend":
        assert "target verify attention" not in text
        assert (
            "draft extend attention (SGLANG_DYNSPEC_SPLIT_KV_DRAFT_EXTEND, SGLANG_DYNSPEC_SPLIT_KV_SPLITS_BY_BATCH): "
            "SGLang's split-KV verify kernel (verify_splitkv.py) with its split count by batch size for the "
            "draft extend's 4 positions per request" in text
        )
        assert SPLIT_KV_RAN in text and GROUPED_VERIFY_RAN not in text
    else:
        assert (
            "(SGLANG_DYNSPEC_SPLIT_KV_VERIFY, SGLANG_DYNSPEC_SPLIT_KV_SPLITS_BY_BATCH): SGLang's split-KV "
            "verify kernel (verify_splitkv.py) with 4-16 splits per prefix by batch size" in text
        )
        assert SPLIT_KV_RAN in text and GROUPED_VERIFY_RAN not in text
