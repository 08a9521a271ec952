"""Unit and property tests of ``catch_up``: the plain-step log and the catch-up batch.

* ``PlainGapLog`` against a pure-Python model, as a Hypothesis state machine:
  any sequence of plain steps (each over a random subset of request slots, with
  random tokens and hidden rows), speculative steps, flushes and prefills; after
  each, the host gap counters, the full check, the committed lengths derived from
  each gap's start and ``gather`` (the rows the catch-up replays, in order) match
  the model.
* ``build_catch_up_batch`` on real SGLang ``ScheduleBatch`` objects (the builder of
  ``schedule_batches``): an EXTEND batch over exactly the gap positions of the
  chosen requests (prefix ``L - g``, extend ``g``, the KV slots the target wrote
  there, the logged tokens), nothing speculative or logprob-related left, and the
  input batch unchanged.

The end-to-end claims (draft KV rows equal an always-speculating server's, full
acceptance right after a resume) are in ``test_catch_up_e2e.py``.
"""

from __future__ import annotations

import pytest
import schedule_batches  # noqa: F401  (sets up the CPU import of SGLang first)
import torch
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from schedule_batches import build_spec_decode_batch, differences, snapshot, spec_decode_cases

from sglang_dynspec.catch_up import GapRows, PlainGapLog, build_catch_up_batch
from sglang_dynspec.compat import ForwardMode

POOL, CAPACITY, WIDTH = 6, 4, 3


class PlainGapLogMachine(RuleBasedStateMachine):
    """The log against a model: per slot, the list of (token, hidden row) since the
    slot was last caught up or prefilled."""

    def __init__(self):
        super().__init__()
        self.log = PlainGapLog(POOL, CAPACITY, WIDTH, torch.float32, "cpu")
        self.model = {slot: [] for slot in range(POOL)}
        self.committed = {slot: 10 * slot for slot in range(POOL)}  # KV-committed length
        self.counter = 0

    @rule(slots=st.sets(st.integers(0, POOL - 1), min_size=1).map(sorted), data=st.data())
    def plain_step(self, slots, data):
        if self.log.is_full(slots):
            # The worker flushes before such a step; recording must refuse, not overflow.
            assert any(len(self.model[s]) >= CAPACITY for s in slots)
            with pytest.raises(RuntimeError, match="full"):
                self._record(slots)
            self.flush(slots)
        order = data.draw(st.permutations(slots), label="row order")
        self._record(order)

    def _record(self, slots):
        tokens = torch.arange(self.counter, self.counter + len(slots))
        hidden = torch.randn(len(slots), WIDTH)
        self.counter += len(slots)
        # Each request decodes the position at its committed length (the worker passes seq_lens).
        self.log.start_gaps(slots, torch.tensor([self.committed[s] for s in slots]))
        self.log.record(slots, torch.tensor(slots), tokens, hidden)
        for k, slot in enumerate(slots):
            self.model[slot].append((int(tokens[k]), hidden[k].clone()))
            self.committed[slot] += 1

    def flush(self, slots):
        self.log.forget(slots)
        for slot in slots:
            self.model[slot] = []

    @precondition(lambda self: any(self.model.values()))
    @rule(data=st.data())
    def catch_up(self, data):
        slots = data.draw(st.sets(st.sampled_from(range(POOL)), min_size=1).map(sorted), label="batch")
        rows = self.log.gap_rows(slots)
        assert rows.pool_indices == [s for s in slots if self.model[s]]
        assert rows.gaps == [len(self.model[s]) for s in rows.pool_indices]
        # Known on the host from the gap's start, without reading the device's seq_lens.
        assert rows.committed_lens == [self.committed[s] for s in rows.pool_indices]
        hidden, tokens = self.log.gather(rows)
        expected = [entry for s in rows.pool_indices for entry in self.model[s]]
        assert tokens.tolist() == [t for t, _ in expected]
        if expected:
            assert torch.equal(hidden, torch.stack([h for _, h in expected]))
        self.flush(rows.pool_indices)

    @rule(
        slots=st.sets(st.integers(0, POOL - 1), min_size=1).map(sorted),
        device_indices=st.booleans(),
        prompt=st.integers(1, 50),
    )
    def prefill(self, slots, device_indices, prompt):
        # A prefill drops whatever an earlier owner of the slot left.
        self.log.forget(slots, torch.tensor(slots) if device_indices else None)
        for slot in slots:
            self.model[slot] = []
            self.committed[slot] = prompt

    @rule(data=st.data())
    def speculative_step(self, data):
        # Slots without a gap speculate: each commits 1 to 4 positions, unseen by the log.
        for slot in (s for s in range(POOL) if not self.model[s]):
            self.committed[slot] += data.draw(st.integers(1, 4), label=f"accepted by slot {slot}")

    @invariant()
    def counters_match(self):
        assert self.log.gap == [len(self.model[s]) for s in range(POOL)]
        assert self.log._fill.tolist() == self.log.gap  # device cursor mirrors the host


TestPlainGapLog = PlainGapLogMachine.TestCase
TestPlainGapLog.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_capacity_must_be_positive():
    with pytest.raises(ValueError, match="at least 1"):
        PlainGapLog(2, 0, 4, torch.float32, "cpu")


def test_recording_needs_the_gap_start():
    log = PlainGapLog(3, 2, 1, torch.float32, "cpu")
    with pytest.raises(RuntimeError, match="start_gaps"):
        log.record([1], torch.tensor([1]), torch.tensor([7]), torch.zeros(1, 1))


def test_given_lengths_override_the_logs_own():
    log = PlainGapLog(3, 2, 1, torch.float32, "cpu")
    log.start_gaps([1], torch.tensor([40]))
    log.record([1], torch.tensor([1]), torch.tensor([7]), torch.zeros(1, 1))
    assert log.gap_rows([0, 1, 2]).committed_lens == [41]
    assert log.gap_rows([0, 1, 2], [10, 11, 12]).committed_lens == [11]


# ------------------------------------------------------------------ catch-up batch
PROPERTY_SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY_SETTINGS
@given(case=spec_decode_cases(), data=st.data())
def test_catch_up_batch_covers_exactly_the_gaps(case, data):
    made = build_spec_decode_batch(case)
    batch = made.batch
    committed = list(case.committed_lens)
    rows = data.draw(st.sets(st.integers(0, case.batch_size - 1), min_size=1).map(sorted), label="rows")
    gaps = [data.draw(st.integers(1, committed[r]), label=f"gap of row {r}") for r in rows]
    pool = batch.req_pool_indices.tolist()
    gap_rows = GapRows(rows, [pool[r] for r in rows], gaps, [committed[r] for r in rows])
    tokens = torch.arange(sum(gaps), dtype=torch.int64) + 5
    before = snapshot(batch)
    note(f"rows={rows} gaps={gaps} committed={[committed[r] for r in rows]}")

    ext = build_catch_up_batch(batch, gap_rows, tokens, made.req_to_token)

    assert differences(batch, before) == []
    assert ext is not batch and ext.forward_mode == ForwardMode.EXTEND
    assert ext.reqs == [batch.reqs[r] for r in rows]
    assert ext.req_pool_indices.tolist() == gap_rows.pool_indices
    assert ext.prefix_lens == [committed[r] - g for r, g in zip(rows, gaps)]
    assert ext.extend_lens == gaps and ext.extend_num_tokens == sum(gaps)
    assert ext.seq_lens.tolist() == ext.seq_lens_cpu.tolist() == [committed[r] for r in rows]
    assert ext.seq_lens_sum == sum(committed[r] for r in rows)
    expected_slots = torch.cat(
        [made.req_to_token[pool[r], committed[r] - g : committed[r]] for r, g in zip(rows, gaps)]
    )
    assert ext.out_cache_loc.tolist() == expected_slots.tolist()
    assert ext.input_ids is tokens
    assert ext.spec_info is None and not ext.return_logprob
    assert ext.top_logprobs_nums is None and ext.token_ids_logprobs is None
    assert ext.decoding_reqs is None and ext.chunked_req is None
    assert torch.equal(ext.sampling_info.temperatures, batch.sampling_info.temperatures[rows])
    assert batch.sampling_info.temperatures.shape[0] == case.batch_size  # the input's is intact


def test_buffer_size_is_checked_against_free_device_memory(monkeypatch):
    from sglang_dynspec import catch_up

    # 8B shape: 3 x 4096 aux width in bf16 (24 KiB + 8 B per position), 129 slots, T = 32: 97 MiB.
    needed = PlainGapLog.bytes_needed(129, 32, 3 * 4096, torch.bfloat16)
    assert needed == 129 * (32 * (3 * 4096 * 2 + 8) + 8)
    assert round(needed / 2**20) == 97
    monkeypatch.setattr(
        torch.cuda, "mem_get_info", lambda device=None: (needed + catch_up.CATCH_UP_MEMORY_HEADROOM, 0)
    )
    catch_up._check_device_memory(needed, 32, "cuda:0")  # fits exactly
    monkeypatch.setattr(
        torch.cuda, "mem_get_info", lambda device=None: (catch_up.CATCH_UP_MEMORY_HEADROOM + needed // 2, 0)
    )
    with pytest.raises(
        RuntimeError, match=r"--speculative-catch-up-tokens 32 needs 97 MiB.*lower it to 16 or less"
    ):
        catch_up._check_device_memory(needed, 32, "cuda:0")
    catch_up._check_device_memory(needed, 32, "cpu")  # host memory: SGLang's CPU engine, nothing to check
