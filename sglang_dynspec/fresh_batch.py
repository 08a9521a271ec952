"""Build a fresh, non-speculative decode batch from a speculative one.

Why a new object: switching speculation off at run time on SGLang's v1 worker crashed
with "size of tensor a (160) must match ... (2)" (10 requests x 16 draft tokens),
because the fallback reused a batch whose tensors were sized for draft tokens. The
plain step here never edits the scheduler's batch: it gets a shallow copy whose
speculative fields are replaced by plain-decode ones, all sized one per request.
(ArcticInference avoids the same "stale-data crash" the other way, by keeping the
speculative pipeline alive with zero-filled drafts, which keeps its cost.)

Spec v2 convention (SGLang eagle_worker_v2, both 0.5.17 and 0.5.23): ``seq_lens`` is
the KV-committed length, and the last sampled token of each request (the pending
"bonus" token) sits at position ``seq_lens`` and is not in the KV cache yet. The
scheduler has already reserved KV slots from ``seq_lens`` onwards
(``eagle_prepare_for_decode``), so the plain step writes exactly one of them:

    committed:  t0 t1 ... t[L-1] | pending: b  (position L)
    plain step: input_ids = [b], out_cache_loc = req_to_token[req, L],
                seq_lens = L + 1 (attention reads L + 1 keys, b included)
"""

from __future__ import annotations

import copy

import torch

from sglang_dynspec.compat import ForwardMode, ScheduleBatch, SpeculativeAlgorithm, pending_tokens


def build_plain_decode_batch(batch: ScheduleBatch, req_to_token: torch.Tensor) -> ScheduleBatch:
    """Return a new batch for one plain DECODE step of the requests in ``batch``.

    ``batch`` is a speculative decode batch (``spec_info`` is an EagleDraftInput);
    ``req_to_token`` is the request-to-KV-slot table ``[pool_size, max_context]``.
    The result has exactly one input token and one KV slot per request, sequence
    lengths + 1, ``spec_info`` None and forward mode DECODE. ``batch`` and its
    tensors are left untouched: every replaced field gets a new tensor.
    """
    draft_input = batch.spec_info
    if draft_input is None:
        raise ValueError("a speculative decode batch carries spec_info; got None")
    plain = copy.copy(batch)  # shares reqs, sampling_info, pools; fields below are rebound
    plain.forward_mode = ForwardMode.DECODE
    plain.spec_info = None
    plain.spec_algorithm = SpeculativeAlgorithm.NONE
    # [bs] the pending token of each request, at position seq_lens
    plain.input_ids = pending_tokens(draft_input).to(torch.int64, copy=True)
    # [bs] the first reserved slot past the committed KV of each request
    plain.out_cache_loc = req_to_token[batch.req_pool_indices.long(), batch.seq_lens.long()].to(torch.int64)
    # [bs] new tensors: decode positions are seq_lens - 1 and attention reads
    # seq_lens keys, the pending token included.
    plain.seq_lens = batch.seq_lens + 1
    # Sampling must mean the same in both modes. SGLang's EAGLE verify applies
    # temperature, top-k, top-p, penalties and logit bias, but not min_p; the plain
    # step samples through the model runner's sampler, which would. So it ignores
    # min_p too (on its own copy: the scheduler's sampling info is not edited).
    if batch.sampling_info is not None and batch.sampling_info.need_min_p_sampling:
        plain.sampling_info = copy.copy(batch.sampling_info)
        plain.sampling_info.need_min_p_sampling = False
    if batch.seq_lens_cpu is not None:
        plain.seq_lens_cpu = batch.seq_lens_cpu + 1
        plain.seq_lens_sum = int(plain.seq_lens_cpu.sum())
    else:
        # The overlap scheduler may run without a host mirror; ForwardBatch.init_new
        # fills the sum in when it can.
        plain.seq_lens_sum = None
    return plain
