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

from collections.abc import Callable
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


# Runs the target's forward on a fresh plain batch and shapes its result as a speculative
# step's: (plain batch, the speculative batch's draft input, capture_hidden) ->
# (result, aux_hidden) (``compat.target_decode``).
TargetDecode = Callable[[object, object, bool], tuple[object, "torch.Tensor | None"]]


@dataclass(frozen=True)
class PlainDecoder:
    """What a plain step needs of the worker, as values: the request-to-token table
    ``[pool_size, max_context]``, the target's model runner (whose graph a plain step
    swaps in) and the target's forward, bound by compat (``of``)."""

    req_to_token: torch.Tensor
    model_runner: object
    decode: TargetDecode

    @classmethod
    def of(cls, spec_worker) -> PlainDecoder:
        return cls(
            req_to_token=compat.request_to_token_table(spec_worker),
            model_runner=spec_worker.target_worker.model_runner,
            decode=compat.target_decode(spec_worker),
        )


def run_plain_decode(
    decoder: PlainDecoder,
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
    plain = build_plain_decode_batch(batch, decoder.req_to_token)
    if batch.has_grammar and grammar_barrier is not None:
        grammar_barrier()
    with using_plain_graph(decoder.model_runner, plain_graph):
        result, aux_hidden = decoder.decode(plain, batch.spec_info, capture_hidden)
    return PlainStep(result, plain.input_ids, aux_hidden)
