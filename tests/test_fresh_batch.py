"""Properties of ``fresh_batch.build_plain_decode_batch`` on real SGLang batches (CPU).

Each case is a real ``ScheduleBatch`` in the state the v2 EAGLE worker receives a
speculative decode step in, built by ``schedule_batches.build_spec_decode_batch``:
1-16 requests with random committed lengths and req_to_token rows, 2-16 draft
tokens, top-k 1-4, hidden size 1-96, with and without the host mirror of
``seq_lens``, with and without logprobs and overlap, and sometimes with the
draft/verify-sized ``input_ids``/``out_cache_loc`` a v1 worker leaves behind.

Draft-size rule: a draft or verify tensor has ``bs*num_draft_tokens`` or
``bs*topk*num_steps`` rows. The strategy keeps ``num_draft_tokens >= 2`` and
``topk*num_steps >= 2``, so both are at least ``2*bs``, while every tensor of a
plain decode batch has only dimensions ``bs`` and 1 (``temperatures`` is
``[bs, 1]``): any draft-sized dimension in the output is a leftover.

``ForwardBatch.init_new(plain, model_runner)`` is not exercised: it needs a model
runner. The builder is called through the module attribute so that a mutation
check can patch it.
"""

from __future__ import annotations

import dataclasses

import pytest
import schedule_batches  # noqa: F401  (sets up the CPU import of SGLang first)
import torch
from hypothesis import HealthCheck, given, note, settings
from schedule_batches import (
    SpecDecodeCase,
    build_spec_decode_batch,
    differences,
    snapshot,
    spec_decode_cases,
    tensor_attributes,
)

from sglang_dynspec import fresh_batch
from sglang_dynspec.compat import ForwardMode

PROPERTY_SETTINGS = settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

# The fields the builder replaces; every other attribute is shared with the input.
REBOUND_FIELDS = frozenset(
    {
        "forward_mode",
        "spec_info",
        "spec_algorithm",
        "input_ids",
        "out_cache_loc",
        "seq_lens",
        "seq_lens_cpu",
        "seq_lens_sum",
    }
)


def build(case: SpecDecodeCase):
    made = build_spec_decode_batch(case)
    note(f"bs={case.batch_size} draft sizes={sorted(case.draft_sized_dims)}")
    return made, made.batch


def shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


@PROPERTY_SETTINGS
@given(spec_decode_cases())
def test_plain_batch_has_one_token_per_request(case):
    made, batch = build(case)
    bs = case.batch_size
    old_seq_lens = batch.seq_lens.clone()
    old_seq_lens_cpu = None if batch.seq_lens_cpu is None else batch.seq_lens_cpu.clone()
    bonus = batch.spec_info.bonus_tokens.clone()
    expected_loc = made.req_to_token[batch.req_pool_indices, batch.seq_lens].to(torch.int64)

    plain = fresh_batch.build_plain_decode_batch(batch, made.req_to_token)

    assert plain is not batch
    assert isinstance(plain, type(batch))
    assert plain.forward_mode is ForwardMode.DECODE
    assert plain.spec_info is None
    assert plain.spec_algorithm.is_none()

    assert plain.input_ids.shape == (bs,) and plain.input_ids.dtype == torch.int64
    assert torch.equal(plain.input_ids, bonus.to(torch.int64))

    assert plain.out_cache_loc.shape == (bs,) and plain.out_cache_loc.dtype == torch.int64
    assert torch.equal(plain.out_cache_loc, expected_loc)
    assert bool((plain.out_cache_loc > 0).all())  # a reserved slot, not the padding slot 0

    assert plain.seq_lens.shape == (bs,) and plain.seq_lens.dtype == old_seq_lens.dtype
    assert torch.equal(plain.seq_lens, old_seq_lens + 1)
    if case.host_mirror:
        assert plain.seq_lens_cpu.device.type == "cpu"
        assert torch.equal(plain.seq_lens_cpu, old_seq_lens_cpu + 1)
        assert plain.seq_lens_sum == int(old_seq_lens_cpu.sum()) + bs == int(plain.seq_lens.sum())
    else:
        assert plain.seq_lens_cpu is None and plain.seq_lens_sum is None

    # "every replaced field gets a new tensor" (input_ids: see the aliasing test below)
    inputs = [t for _, t in tensor_attributes(batch)]
    for name in ("out_cache_loc", "seq_lens", "seq_lens_cpu"):
        value = getattr(plain, name)
        if value is not None:
            assert not any(shares_storage(value, t) for t in inputs), name


@PROPERTY_SETTINGS
@given(spec_decode_cases())
def test_no_draft_sized_tensor_in_plain_batch(case):
    made, batch = build(case)
    plain = fresh_batch.build_plain_decode_batch(batch, made.req_to_token)

    tensors = tensor_attributes(plain)
    assert {"input_ids", "out_cache_loc", "seq_lens", "req_pool_indices"} <= {n for n, _ in tensors}
    leftovers = [f"{name}{tuple(t.shape)}" for name, t in tensors if set(t.shape) & case.draft_sized_dims]
    assert not leftovers, f"{leftovers}; draft sizes {sorted(case.draft_sized_dims)}"
    for name, t in tensors:
        assert set(t.shape) <= {case.batch_size, 1}, f"{name}{tuple(t.shape)}"


@PROPERTY_SETTINGS
@given(spec_decode_cases())
def test_input_batch_is_left_unchanged(case):
    made, batch = build(case)
    before = snapshot(batch)

    plain = fresh_batch.build_plain_decode_batch(batch, made.req_to_token)

    assert differences(batch, before) == []
    # The output shares the requests, sampling info and pools: they too are intact.
    assert plain.reqs is batch.reqs and plain.sampling_info is batch.sampling_info


@PROPERTY_SETTINGS
@given(spec_decode_cases())
def test_only_plain_decode_fields_are_rebound(case):
    made, batch = build(case)
    plain = fresh_batch.build_plain_decode_batch(batch, made.req_to_token)

    old, new = vars(batch), vars(plain)
    assert set(new) == set(old)
    changed = {name for name in old if new[name] is not old[name]}
    assert changed <= REBOUND_FIELDS, sorted(changed - REBOUND_FIELDS)
    assert {f.name for f in dataclasses.fields(plain)} >= REBOUND_FIELDS


def example_case(**overrides) -> SpecDecodeCase:
    params = dict(
        prompt_lens=(5, 3, 9),
        output_lens=(2, 1, 4),
        greedy=(True, False, True),
        return_logprob=(False, True, False),
        num_draft_tokens=4,
        topk=2,
        num_steps=3,
        hidden_size=8,
        extra_pool_rows=2,
        host_mirror=True,
        overlap=False,
        leftover_verify_tensors=False,
        bonus_dtype=torch.int32,
        seed=1,
    )
    params.update(overrides)
    return SpecDecodeCase(**params)


def test_rejects_a_batch_without_spec_info():
    made = build_spec_decode_batch(example_case())
    made.batch.spec_info = None
    with pytest.raises(ValueError, match="spec_info"):
        fresh_batch.build_plain_decode_batch(made.batch, made.req_to_token)


def test_input_ids_do_not_alias_the_draft_input():
    """int64 bonus tokens (what SGLang produces) must still be copied: an in-place
    write to the plain batch's input_ids must not edit the scheduler's state."""
    made = build_spec_decode_batch(example_case(bonus_dtype=torch.int64))
    plain = fresh_batch.build_plain_decode_batch(made.batch, made.req_to_token)
    assert not shares_storage(plain.input_ids, made.batch.spec_info.bonus_tokens)


def test_min_p_is_ignored_by_plain_steps_as_by_verify():
    """EAGLE verify does not apply min_p; the plain step's sampler must not either, or a
    request's sampling would change with the mode. The scheduler's sampling info stays."""
    made = build_spec_decode_batch(example_case())
    info = made.batch.sampling_info
    info.need_min_p_sampling = True
    plain = fresh_batch.build_plain_decode_batch(made.batch, made.req_to_token)
    assert plain.sampling_info is not info and plain.sampling_info.need_min_p_sampling is False
    assert info.need_min_p_sampling is True
    assert plain.sampling_info.temperatures is info.temperatures  # everything else shared
