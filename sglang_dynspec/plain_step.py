"""One plain decode step inside the speculative worker, honouring the v2 scheduler contract.

The scheduler cannot tell a plain step from a speculative one: it gets a
``GenerationBatchResult`` with one accepted token per request (``accept_lens`` = 1,
stride 1) and consumes it on its speculative path (``kv_committed_len += 1``).
What the worker owes the scheduler, in both modes, and where this module pays it:

1. grammar: with grammars active, call ``grammar_barrier()`` before the forward. The
   target samples inline under speculation, so the vocab mask must already reflect
   the previous step's token; without the barrier it is one step stale
   ("Grammar accept_token failed"). (:func:`run_plain_decode`)
2. publish: under the overlap scheduler, call ``on_publish(new_seq_lens)`` exactly
   once per forward. The scheduler does not publish for speculative batches; a
   missing publish is silent outside ``SGLANG_IS_IN_CI`` and yields wrong tokens.
   (the worker, after the catch-up has logged the step)
3. result shape: one token per request, ``accept_lens`` of ones, row stride 1,
   logprobs as ``[bs, 1]``. (:func:`finish_plain_result`)
4. draft state: ``next_draft_input`` carries the last speculative step's
   ``topk_p``/``topk_index``/``hidden_states``: the synchronous scheduler's batch
   filtering and merging slice them, and the overlap scheduler's FutureMap stash
   writes them. (:func:`plain_step_draft_input`)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_dynspec import compat
from sglang_dynspec.fresh_batch import build_plain_decode_batch
from sglang_dynspec.plain_graph import PlainDecodeGraph, plain_decode_graphs


@dataclass(frozen=True)
class PlainStep:
    """A plain decode step queued on the device."""

    result: object  # the spec-shaped GenerationBatchResult the scheduler gets
    input_ids: torch.Tensor  # [bs] the input token of each request (its pending token)
    aux_hidden: torch.Tensor | None  # [bs, 3H] the target's auxiliary hidden states (capture_hidden)


def run_plain_decode(
    spec_worker,
    batch,
    plain_graph: PlainDecodeGraph | None = None,
    grammar_barrier=None,
    capture_hidden: bool = False,
) -> PlainStep:
    """Run the target's plain decode for ``batch``; the result is shaped as a spec result.

    ``capture_hidden``: the forward also returns the target's packed auxiliary hidden
    states (the draft catch-up logs them). The caller publishes the new sequence
    lengths (``result.new_seq_lens``) under the overlap scheduler, exactly once.
    """
    plain = build_plain_decode_batch(batch, compat.request_to_token_table(spec_worker))
    if batch.has_grammar and grammar_barrier is not None:
        grammar_barrier()
    target_worker = spec_worker.target_worker
    with plain_decode_graphs(target_worker.model_runner, plain_graph):
        out = compat.run_target_decode(target_worker, plain, capture_hidden=capture_hidden)
    aux_hidden = out.logits_output.hidden_states if out.logits_output is not None else None
    return PlainStep(finish_plain_result(out, plain, batch.spec_info), plain.input_ids, aux_hidden)


def plain_step_draft_input(next_tokens: torch.Tensor, previous):
    """The spec state handed to the next step after a plain step.

    ``next_tokens`` becomes the pending token, as a verify step's bonus would. The
    draft's top-k and hidden state are carried over from the last speculative step
    (``previous``), in both schedulers:

    * synchronous: batch filtering and merging slice ``topk_p``, ``topk_index`` and
      ``hidden_states`` unconditionally;
    * overlap: ``FutureMap.stash`` writes them back unconditionally on 0.5.17
      (``payload.topk_p.to(...)``: None crashes) and when present on 0.5.23. The
      incoming tensors were gathered from the FutureMap for this step, so writing
      them back keeps its rows as they were.
    """
    new = compat.EagleDraftInput(
        bonus_tokens=next_tokens,
        capture_hidden_mode=compat.CaptureHiddenMode.LAST,
        num_tokens_per_req=1,
        num_tokens_for_logprob_per_req=1,
    )
    new.topk_p = previous.topk_p
    new.topk_index = previous.topk_index
    new.hidden_states = previous.hidden_states
    new.draft_probs = previous.draft_probs
    return new


def finish_plain_result(out, plain_batch, draft_input):
    """Shape a plain forward's result as the v2 scheduler expects a spec result.

    One token per request: ``accept_lens`` of ones (a tensor: the scheduler copies it
    to the host and asserts it is there), row stride 1, ``new_seq_lens`` = committed
    length + 1, and logprobs in the spec layout ``[bs, max_accept] = [bs, 1]``.
    """
    next_tokens = out.next_token_ids  # [bs]
    bs = next_tokens.shape[0]
    out.accept_lens = torch.ones(bs, dtype=torch.int32, device=next_tokens.device)
    out.new_seq_lens = plain_batch.seq_lens  # [bs], a new tensor (see fresh_batch)
    out.speculative_num_draft_tokens = 1
    if hasattr(out, "speculative_output_stride"):
        out.speculative_output_stride = 1
    logits = out.logits_output
    if plain_batch.return_logprob and logits is not None and logits.next_token_logprobs is not None:
        logits.next_token_logprobs = logits.next_token_logprobs.view(-1, 1)
    out.next_draft_input = plain_step_draft_input(next_tokens, draft_input)
    # The overlap scheduler keeps the inputs of a launched forward alive for two
    # iterations; these are the tensors this step created.
    out.extra_keep_alive_refs = [plain_batch.input_ids, plain_batch.out_cache_loc, plain_batch.seq_lens]
    return out
