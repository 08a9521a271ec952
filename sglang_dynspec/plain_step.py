"""One plain decode step inside the speculative worker, honouring the v2 scheduler contract.

The scheduler cannot tell a plain step from a speculative one: it gets a
``GenerationBatchResult`` with one accepted token per request (``accept_lens`` = 1,
stride 1) and consumes it on its speculative path (``kv_committed_len += 1``).
What the worker owes the scheduler, in both modes:

1. grammar: with grammars active, call ``grammar_barrier()`` before the forward. The
   target samples inline under speculation, so the vocab mask must already reflect
   the previous step's token; without the barrier it is one step stale
   ("Grammar accept_token failed").
2. publish: under the overlap scheduler, call ``on_publish(new_seq_lens)`` exactly
   once per forward. The scheduler does not publish for speculative batches; a
   missing publish is silent outside ``SGLANG_IS_IN_CI`` and yields wrong tokens.
3. draft state: ``next_draft_input`` carries the last speculative step's
   ``topk_p``/``topk_index``/``hidden_states``: the synchronous scheduler's batch
   filtering and merging slice them, and the overlap scheduler's FutureMap stash
   writes them (see ``compat.plain_step_draft_input``).
"""

from __future__ import annotations

from sglang_dynspec import compat
from sglang_dynspec.fresh_batch import build_plain_decode_batch


def run_plain_decode(worker, batch, on_publish=None, grammar_barrier=None, plain_graph=None,
                     catch_up=None):
    """Run the target's plain decode for ``batch`` and return a spec-shaped result.

    With ``catch_up`` (a ``catch_up.DraftCatchUp``), a full catch-up log is replayed
    first, and the forward also captures the target's auxiliary hidden states, which
    are logged for the draft's catch-up.
    """
    pool_indices = catch_up.before_plain_step(batch) if catch_up is not None else None
    plain = build_plain_decode_batch(batch, worker.req_to_token_pool.req_to_token)
    if batch.has_grammar and grammar_barrier is not None:
        grammar_barrier()
    model_runner = worker.target_worker.model_runner
    with compat.plain_decode_graphs(model_runner, plain_graph):
        out = compat.run_target_decode(worker.target_worker, plain, capture_hidden=catch_up is not None)
    if catch_up is not None:
        catch_up.record(pool_indices, batch, plain, out.logits_output.hidden_states)
    if on_publish is not None:
        on_publish(plain.seq_lens)
    return compat.finish_plain_result(out, plain, batch.spec_info)
