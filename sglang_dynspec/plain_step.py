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
   logprobs as ``[bs, 1]``. (``compat.spec_shaped_result``: SGLang's result type)
4. draft state: ``next_draft_input`` carries the last speculative step's
   ``topk_p``/``topk_index``/``hidden_states``: the synchronous scheduler's batch
   filtering and merging slice them, and the overlap scheduler's FutureMap stash
   writes them. (``compat.plain_step_draft_input``)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_dynspec import compat
from sglang_dynspec.fresh_batch import build_plain_decode_batch
from sglang_dynspec.plain_graph import PlainGraph, using_plain_graph


@dataclass(frozen=True)
class PlainStep:
    """A plain decode step queued on the device."""

    result: object  # the spec-shaped GenerationBatchResult the scheduler gets
    input_ids: torch.Tensor  # [bs] the input token of each request (its pending token)
    aux_hidden: torch.Tensor | None  # [bs, 3H] the target's auxiliary hidden states (capture_hidden)


def run_plain_decode(
    spec_worker,
    batch,
    plain_graph: PlainGraph | None = None,
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
    with using_plain_graph(target_worker.model_runner, plain_graph):
        result, aux_hidden = compat.run_target_decode(
            target_worker, plain, batch.spec_info, capture_hidden=capture_hidden
        )
    return PlainStep(result, plain.input_ids, aux_hidden)
