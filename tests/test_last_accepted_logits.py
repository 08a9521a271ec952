"""The draft extend's LM head at each request's last accepted row (``compat.LogitsAtLastAccepted``).

Unit level, on SGLang's real ``ForwardBatch`` and ``EagleDraftExtendInput``: the inner
module stands in for SGLang's logits processor and keeps its contract for
``DRAFT_EXTEND_V2`` (both versions' ``LogitsProcessor._get_pruned_states``): with
``spec_info.select_index`` set, the LM head runs at those rows only, and a LAST hidden
capture is pruned the same way; FULL capture keeps every row. The worker then reads
``logits[select_index]`` and ``hidden[select_index]`` with its own ``select_index``
(``i * width + accept_len_i - 1``), which is what these tests read too.
On a real server (CPU test bed, ``server`` mark), the counting pair, whose right proposal
depends on the position: with the wrapper every speculative step still accepts the whole
chain, which a proposal taken from any other row would not.
"""

from __future__ import annotations

import math

import pytest
import schedule_batches  # noqa: F401  (sets up the CPU import of SGLang first)
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dynspec_testbed.server import OVERLAP_CI_ENV, assert_no_kv_left, dynamic_server_args, serve
from dynspec_testbed.workload import random_requests, run_waves
from sglang_dynspec import compat, config
from sglang_dynspec.compat import EagleDraftExtendInput, ForwardBatch, ForwardMode, LogitsAtLastAccepted

VOCAB, HIDDEN = 11, 5


class HostLogitsContract(torch.nn.Module):
    """SGLang's logits processor for the draft extend, reduced to what the wrapper relies on."""

    def __init__(self, head: torch.Tensor, capture_last: bool):
        super().__init__()
        self.head, self.capture_last = head, capture_last
        self.rows_computed: list[int] = []

    def forward(self, input_ids, hidden_states, lm_head, forward_batch):
        select = (
            forward_batch.spec_info.select_index if forward_batch.forward_mode.is_draft_extend_v2() else None
        )
        pruned = hidden_states if select is None else hidden_states[select]
        self.rows_computed.append(pruned.shape[0])
        logits = (pruned @ self.head.T).float()
        stored = pruned if self.capture_last else hidden_states
        return compat.LogitsProcessorOutput(next_token_logits=logits, hidden_states=stored)


def draft_extend_batch(accept_lens: list[int], width: int, mode=ForwardMode.DRAFT_EXTEND_V2, buffer=None):
    bs = len(accept_lens)
    rows = bs * width
    batch = ForwardBatch(
        forward_mode=mode,
        batch_size=bs,
        input_ids=torch.zeros(rows, dtype=torch.long),
        req_pool_indices=torch.arange(bs),
        seq_lens=torch.full((bs,), 9),
        out_cache_loc=torch.zeros(rows, dtype=torch.long),
        seq_lens_sum=9 * bs,
        next_token_logits_buffer=buffer,
    )
    lens = torch.tensor(accept_lens, dtype=torch.int32)
    batch.spec_info = EagleDraftExtendInput(
        hidden_states=None, num_correct_drafts=lens - 1, num_accept_tokens=lens, num_tokens_per_req=width
    )
    return batch


def workers_select_index(accept_lens: list[int], width: int) -> torch.Tensor:
    """``select_index`` as both versions' ``_draft_extend_for_decode`` compute it."""
    return torch.arange(0, len(accept_lens) * width, width) + torch.tensor(accept_lens) - 1


def run_both(accept_lens, width, capture_last, buffer=None):
    torch.manual_seed(0)
    head, hidden = torch.randn(VOCAB, HIDDEN), torch.randn(len(accept_lens) * width, HIDDEN)
    plain = HostLogitsContract(head, capture_last)
    reference = plain(None, hidden, None, draft_extend_batch(accept_lens, width))
    wrapped_inner = HostLogitsContract(head, capture_last)
    batch = draft_extend_batch(accept_lens, width, buffer=buffer)
    got = LogitsAtLastAccepted(wrapped_inner)(None, hidden, None, batch)
    return reference, got, wrapped_inner, batch


@settings(max_examples=60, deadline=None)
@given(
    width=st.integers(2, 8),
    data=st.data(),
    capture_last=st.booleans(),
)
def test_the_worker_reads_the_same_logits_and_hidden_states_at_its_rows(width, data, capture_last):
    accept_lens = data.draw(st.lists(st.integers(1, width), min_size=1, max_size=9))
    reference, got, inner, batch = run_both(accept_lens, width, capture_last)
    select = workers_select_index(accept_lens, width)
    # The LM head ran at one row per request, not at every row.
    assert inner.rows_computed == [len(accept_lens)]
    # Every row keeps its shape, so the worker's gather is unchanged.
    assert got.next_token_logits.shape == reference.next_token_logits.shape
    torch.testing.assert_close(got.next_token_logits[select], reference.next_token_logits[select])
    assert got.hidden_states.shape == reference.hidden_states.shape
    torch.testing.assert_close(got.hidden_states[select], reference.hidden_states[select])
    # The host's field is left as it was found, for the next forward.
    assert batch.spec_info.select_index is None


def test_rows_it_does_not_keep_are_zeros_outside_a_graph_not_stale_memory():
    """SGLang's optional NaN probe (SGLANG_ENABLE_ASYNC_ASSERT) reads the whole tensor."""
    _, got, _, _ = run_both([2, 1, 4], 4, capture_last=False)
    kept = torch.zeros(12, dtype=torch.bool)
    kept[workers_select_index([2, 1, 4], 4)] = True
    assert torch.count_nonzero(got.next_token_logits[~kept]) == 0
    assert torch.count_nonzero(got.next_token_logits[kept]) > 0


def test_the_forwards_logits_buffer_receives_the_rows_where_its_shape_fits():
    buffer = torch.full((12, VOCAB), 7.0)
    reference, got, _, _ = run_both([1, 3, 4], 4, capture_last=True, buffer=buffer)
    assert got.next_token_logits.data_ptr() == buffer.data_ptr()
    select = workers_select_index([1, 3, 4], 4)
    torch.testing.assert_close(buffer[select], reference.next_token_logits[select])


@pytest.mark.parametrize(
    "case",
    ["another mode", "select_index already set (0.5.23's graph)", "no accept lengths", "one row per request"],
)
def test_it_leaves_every_other_forward_alone(case):
    torch.manual_seed(1)
    head = torch.randn(VOCAB, HIDDEN)
    width = 1 if case == "one row per request" else 4
    mode = ForwardMode.DECODE if case == "another mode" else ForwardMode.DRAFT_EXTEND_V2
    batch = draft_extend_batch([1, 2], width, mode=mode)
    preset = workers_select_index([1, 2], width)
    if case.startswith("select_index"):
        batch.spec_info.select_index = preset
    if case == "no accept lengths":
        batch.spec_info.num_accept_tokens = None
    inner = HostLogitsContract(head, capture_last=False)
    hidden = torch.randn(2 * width, HIDDEN)
    got = LogitsAtLastAccepted(inner)(None, hidden, None, batch)
    expected_rows = 2 if case.startswith("select_index") else 2 * width
    assert inner.rows_computed == [expected_rows]
    assert got.next_token_logits.shape[0] == expected_rows
    assert batch.spec_info.select_index is (preset if case.startswith("select_index") else None)


def test_off_by_default_until_a_device_check():
    assert config.settings_from_environ({}).last_accepted_logits is False
    assert config.settings_from_environ({config.LAST_ACCEPTED_LOGITS_ENV: "1"}).last_accepted_logits is True


# One request alone, then five together: all below the threshold of 8, so every decode
# step speculates (one draft step, two draft tokens: width 2, accept length 1 or 2).
COUNT_WAVES = [
    random_requests(1, seed=51, prefix="alone", new_tokens=(40, 40)),
    random_requests(5, seed=52, prefix="five", new_tokens=(30, 30)),
]


@pytest.mark.server
def test_the_counting_pair_accepts_every_draft_with_it(tiny_models, tmp_path):
    args = dynamic_server_args(
        tiny_models,
        "count",
        steps=1,
        draft_tokens=2,
        disable_above=8,
        extra=["--max-running-requests", 16, "--enable-metrics"],
    )
    log = tmp_path / "server.log"

    def run(url):
        outputs = run_waves(url, COUNT_WAVES, batched=True)
        assert_no_kv_left(url, timeout=60)
        return outputs

    env = {**OVERLAP_CI_ENV, config.LAST_ACCEPTED_LOGITS_ENV: "1"}
    outputs = serve(args, run, log_path=log, env=env)
    assert (
        f"draft extend logits ({config.LAST_ACCEPTED_LOGITS_ENV}): the draft extend after each verify computes "
        "the draft's logits at each request's last accepted position only (1 of 2 positions per request)"
    ) in log.read_text()
    prompts = {r.rid: r.input_ids for wave in COUNT_WAVES for r in wave}
    for rid, out in outputs.items():
        ids, meta = out["output_ids"], out["meta_info"]
        start = prompts[rid][-1]
        assert ids == [(start + 1 + i) % 512 for i in range(len(ids))], rid  # what the target alone emits
        # Every step accepted its draft: 2 tokens per verify step after the prefill's
        # first (the last step may commit one, at the length limit).
        full = math.ceil((len(ids) - 1) / 2)
        assert meta["spec_verify_ct"] <= full + 1, (rid, len(ids), meta["spec_verify_ct"])


def _sglangs_logits_processor() -> torch.nn.Module:
    """A real ``LogitsProcessor`` object (its constructor needs SGLang's server globals)."""
    processor = object.__new__(compat.LogitsProcessor)
    torch.nn.Module.__init__(processor)
    return processor


def _worker(logits_processor) -> object:
    import types

    model = types.SimpleNamespace(logits_processor=logits_processor)
    return types.SimpleNamespace(
        draft_worker=types.SimpleNamespace(draft_runner=types.SimpleNamespace(model=model)),
        server_args=types.SimpleNamespace(speculative_num_draft_tokens=4),
    )


def test_the_switch_wraps_sglangs_processor_once_and_the_cost_key_names_it():
    sglangs = _sglangs_logits_processor()
    worker = _worker(sglangs)
    assert compat.draft_extend_logits_rows(worker) == "all"
    note = compat.use_last_accepted_logits(worker)
    assert note.endswith("(1 of 4 positions per request)"), note
    wrapped = worker.draft_worker.draft_runner.model.logits_processor
    assert isinstance(wrapped, LogitsAtLastAccepted) and wrapped.inner is sglangs
    # A step-cost table timed without it is not read with it (cost_cache's key).
    assert compat.draft_extend_logits_rows(worker) == "last-accepted"
    assert compat.use_last_accepted_logits(worker) == "already in place"
    assert worker.draft_worker.draft_runner.model.logits_processor is wrapped


def test_a_draft_without_sglangs_processor_is_left_alone():
    other = torch.nn.Identity()
    worker = _worker(other)
    assert compat.use_last_accepted_logits(worker).startswith("not used: the draft model (SimpleNamespace)")
    assert worker.draft_worker.draft_runner.model.logits_processor is other
    assert compat.draft_extend_logits_rows(worker) == "all"
