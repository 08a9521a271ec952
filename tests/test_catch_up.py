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

import contextlib
import copy
import types

import pytest
import schedule_batches  # noqa: F401  (sets up the CPU import of SGLang first)
import torch
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from schedule_batches import (
    SpecDecodeCase,
    build_spec_decode_batch,
    differences,
    snapshot,
    spec_decode_cases,
)

from sglang_dynspec import catch_up as catch_up_module
from sglang_dynspec import compat
from sglang_dynspec.catch_up import (
    CatchUp,
    DraftCatchUp,
    DraftPasses,
    GapRows,
    NoCatchUp,
    PlainGapLog,
    ReplayTally,
    build_catch_up_batch,
    flush_slack,
)
from sglang_dynspec.compat import ForwardMode
from sglang_dynspec.device_timer import HostCopy
from sglang_dynspec.metric_names import CatchUpReason

POOL, CAPACITY, WIDTH = 6, 4, 3
SPEC_CASE = SpecDecodeCase(
    prompt_lens=(3, 5),
    output_lens=(2, 1),
    greedy=(True, True),
    return_logprob=(False, False),
    num_draft_tokens=4,
    topk=1,
    num_steps=3,
    hidden_size=8,
    extra_pool_rows=2,
    host_mirror=True,
    overlap=False,
    leftover_verify_tensors=False,
    bonus_dtype=torch.int64,
    seed=11,
)


class PlainGapLogMachine(RuleBasedStateMachine):
    """The log against a model: per slot, the list of (token, hidden row) since the
    slot was last caught up or prefilled."""

    def __init__(self):
        super().__init__()
        self.log = PlainGapLog(POOL, CAPACITY, WIDTH, torch.float32, "cpu")
        self.model = {slot: [] for slot in range(POOL)}
        self.committed = {slot: 10 * slot for slot in range(POOL)}  # KV-committed length
        self.counter = 0

    @initialize(slack=st.integers(0, 2))
    def with_slack(self, slack):
        # The positions beyond CAPACITY that flushes in pieces add (flush_slack): the
        # rows are laid out by the whole length.
        self.log = PlainGapLog(POOL, CAPACITY, WIDTH, torch.float32, "cpu", slack=slack)

    @rule(slots=st.sets(st.integers(0, POOL - 1), min_size=1).map(sorted), data=st.data())
    def plain_step(self, slots, data):
        if self.log.is_full(slots):
            # The worker flushes before such a step; recording must refuse, not overflow.
            assert any(len(self.model[s]) >= CAPACITY + self.log.slack for s in slots)
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
        self.log.record(slots, tokens, hidden)
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

    @rule(slots=st.sets(st.integers(0, POOL - 1), min_size=1).map(sorted), prompt=st.integers(1, 50))
    def prefill(self, slots, prompt):
        # A prefill drops whatever an earlier owner of the slot left.
        self.log.forget(slots)
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


TestPlainGapLog = PlainGapLogMachine.TestCase
TestPlainGapLog.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_capacity_must_be_positive():
    with pytest.raises(ValueError, match="at least 1"):
        PlainGapLog(2, 0, 4, torch.float32, "cpu")


def test_recording_needs_the_gap_start():
    log = PlainGapLog(3, 2, 1, torch.float32, "cpu")
    with pytest.raises(RuntimeError, match="start_gaps"):
        log.record([1], torch.tensor([7]), torch.zeros(1, 1))


def test_given_lengths_override_the_logs_own():
    log = PlainGapLog(3, 2, 1, torch.float32, "cpu")
    log.start_gaps([1], torch.tensor([40]))
    log.record([1], torch.tensor([7]), torch.zeros(1, 1))
    assert log.gap_rows([0, 1, 2]).committed_lens == [41]
    assert log.gap_rows([0, 1, 2], [10, 11, 12]).committed_lens == [11]


def _flush_schedule(
    bs: int, capacity: int, budget: int, steps: int, joins: dict[int, list[int]], slack: int = 0
):
    """Drive ``PlainGapLog.due_for_flush`` over ``steps`` plain steps of ``bs`` request
    slots (``joins``: step -> slots whose request is replaced by a new one, gap 0, as a
    prefill would); return each flush as the gaps it replayed."""
    log = PlainGapLog(bs, capacity, 1, torch.float32, "cpu", slack=slack)
    slots, flushes = list(range(bs)), []
    for step in range(steps):
        for i in joins.get(step, ()):
            log.gap[i] = 0
        due = log.due_for_flush(slots, budget)
        if due:
            assert all(log.gap[i] for i in due)
            flushes.append([log.gap[i] for i in due])
            for i in due:
                log.gap[i] = 0
        assert not log.is_full(slots), (step, log.gap)  # the step can be recorded
        for i in slots:
            log.gap[i] += 1
    return flushes


@settings(max_examples=300, deadline=None)
@given(
    bs=st.integers(1, 64),
    capacity=st.integers(1, 48),
    budget=st.integers(0, 600),
    steps=st.integers(1, 200),
    joins=st.dictionaries(st.integers(0, 199), st.lists(st.integers(0, 63), max_size=8), max_size=30),
)
def test_flushes_keep_every_log_within_its_buffer_and_pieces_within_the_budget(
    bs, capacity, budget, steps, joins
):
    joins = {t: [i for i in slots if i < bs] for t, slots in joins.items()}
    slack = flush_slack(capacity, budget, bs)  # as DraftCatchUp sizes the log
    flushes = _flush_schedule(bs, capacity, budget, steps, joins, slack=slack)
    full = capacity + slack
    for gaps in flushes:
        if 0 < budget < bs * capacity and len(gaps) > 1:
            # A piece exceeds the budget only by gaps that were full.
            assert sum(g for g in gaps if g < full) <= budget or max(gaps) == full, gaps


@settings(max_examples=200, deadline=None)
@given(bs=st.integers(1, 128), capacity=st.integers(1, 128), data=st.data())
def test_gaps_that_started_together_are_flushed_in_pieces_of_the_budget(bs, capacity, data):
    """A wave of requests admitted together fills every log at the same step: with a
    budget that holds ceil(bs / capacity) full logs (a smaller one cannot start early
    enough: a flush takes at least one request), no flush replays more than the budget,
    and every position is replayed once."""
    least = capacity * -(-bs // capacity)
    budget = data.draw(st.integers(least, max(least, bs * capacity)), label="budget")
    steps = 3 * capacity + 2
    flushes = _flush_schedule(bs, capacity, budget, steps, {})
    assert all(sum(gaps) <= budget for gaps in flushes), flushes
    replayed = sum(map(sum, flushes))
    assert replayed <= bs * steps and bs * steps - replayed <= bs * capacity  # the rest is still logged
    if budget >= bs * capacity:  # no limit: as without a budget, all at once when one is full
        assert flushes == _flush_schedule(bs, capacity, 0, steps, {})
        assert all(gaps == [capacity] * bs for gaps in flushes)


@settings(max_examples=300, deadline=None)
@given(bs=st.integers(1, 128), capacity=st.integers(4, 160), data=st.data())
def test_with_the_slack_a_wave_decoding_twice_the_buffer_is_flushed_once(bs, capacity, data):
    """A wave admitted together whose requests decode ``2 x capacity`` tokens plain and
    end: all at once, each request is flushed once (at a full log; its second gap ends
    with it). In pieces, with ``flush_slack``'s extra positions, each is flushed once too,
    no piece over the budget, where a log of exactly ``capacity`` flushes some twice
    (shown below at the closed loop's shape)."""
    least = capacity * -(-bs // capacity)
    budget = data.draw(st.integers(least, max(least, bs * capacity)), label="budget")
    slack = flush_slack(capacity, budget, bs)
    note(f"slack={slack}")
    flushes = _flush_schedule(bs, capacity, budget, 2 * capacity, {}, slack=slack)
    assert 0 <= slack <= capacity // 4 and (slack == 0 or capacity + slack <= budget)
    # The gap at which the first piece of a wave of bs requests starts (due_for_flush's lead).
    first = capacity + slack - -(-bs // max(1, budget // (capacity + slack))) + 1
    assert first >= capacity or slack == 0  # slack is given only where it reaches a full buffer
    if first >= capacity:
        assert sorted(g for gaps in flushes for g in gaps) == sorted(
            g for gaps in flushes for g in gaps if g >= capacity
        )
        assert sum(map(len, flushes)) == bs, flushes  # every request once
    assert all(sum(g for g in gaps if g < capacity + slack) <= budget for gaps in flushes), flushes
    # Never more replayed than in a log of exactly ``capacity``.
    assert sum(map(sum, flushes)) <= sum(map(sum, _flush_schedule(bs, capacity, budget, 2 * capacity, {})))


def test_pieces_without_the_slack_flush_the_closed_loops_requests_twice():
    """64 requests of 256 tokens, the default 128 positions, pieces of 2,048: the
    measured case (benchmarks/results/h200-20261203-2c4f5f3/README.md). A log of exactly
    128 positions flushes every request twice, 1.96x the positions all at once replays;
    with the slack (4 positions here) once, in 5 pieces."""
    at_once = sum(map(sum, _flush_schedule(64, 128, 0, 256, {})))
    tight = sum(map(sum, _flush_schedule(64, 128, 2048, 256, {})))
    slack = flush_slack(128, 2048, 64)
    with_slack = _flush_schedule(64, 128, 2048, 256, {}, slack=slack)
    assert at_once == 64 * 128
    assert tight == 16_096  # 64 first gaps of 125-128, then 64 second gaps of 125
    assert slack == 4 and sum(map(len, with_slack)) == 64
    assert all(sum(gaps) <= 2048 for gaps in with_slack) and len(with_slack) > 1


def test_no_slack_without_pieces():
    assert flush_slack(128, 0, 128) == 0  # all at once
    assert flush_slack(128, 128 * 128, 128) == 0  # a budget that holds every log
    assert flush_slack(128, 2048, 128) == 8  # 15 logs of 136 per piece of 2,048: lead 9 at 128 requests
    assert flush_slack(12, 12, 3) == 0  # a log larger than the budget would overflow every piece
    # One more position would leave one log per piece of 8, not two: pieces would start earlier.
    assert flush_slack(4, 8, 16) == 0


def test_without_a_budget_every_gap_is_flushed_once_one_log_is_full():
    flushes = _flush_schedule(3, 4, 0, 10, {2: [1]})
    assert flushes == [[4, 2, 4], [4, 4, 4]]  # slot 1 restarted at step 2: flushed with the rest


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
    assert needed == 129 * 32 * (3 * 4096 * 2 + 8)
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


# ------------------------------------------------------------- DraftCatchUp, with fakes
class FakeDraftPasses:
    """Records what each draft pass was given; ``extend`` returns recognisable state."""

    def __init__(self, topk: int, hidden_size: int):
        self.topk, self.hidden_size = topk, hidden_size
        self.calls: list[tuple] = []

    def extend(self, ext, hidden, tails):
        self.calls.append(("extend", ext, hidden.clone(), tails.clone()))
        n = len(ext.reqs)
        return types.SimpleNamespace(
            topk_p=torch.full((n, self.topk), 0.25),
            topk_index=torch.full((n, self.topk), 7, dtype=torch.int64),
            hidden_states=torch.full((n, self.hidden_size), -1.0),
            draft_probs=None,
        )

    def fill_kv(self, ext, hidden, tails, last_rows, compared_rows=None):
        self.calls.append(("fill_kv", ext, hidden.clone(), tails.clone(), last_rows.clone()))


AUX_WIDTH = 5


def draft_catch_up(made, case, capacity, flush_tokens=0):
    passes = FakeDraftPasses(case.topk, case.hidden_size)
    reports = []
    catch_up = DraftCatchUp(
        made.req_to_token,
        capacity=capacity,
        hidden_width=AUX_WIDTH,
        hidden_dtype=torch.float32,
        passes=DraftPasses(passes.extend, passes.fill_kv),
        report=lambda reason, requests, tokens, timer: reports.append((reason, requests, tokens)),
        flush_tokens=flush_tokens,
    )
    return catch_up, passes, reports


def plain_steps(catch_up, batch, steps: int, gen: torch.Generator):
    """Run ``steps`` plain steps through the catch-up's hooks as the worker does, and
    commit each as the scheduler would (one position, a new pending token). Returns
    the logged (input token, aux row) of each request, step after step."""
    logged = []
    for _ in range(steps):
        catch_up.before_plain_step(batch)
        inputs = batch.spec_info.bonus_tokens.clone()
        aux = torch.randn(len(batch.reqs), AUX_WIDTH, generator=gen)
        catch_up.after_plain_step(inputs, aux)
        logged.append((inputs, aux))
        batch.seq_lens = batch.seq_lens + 1
        if batch.seq_lens_cpu is not None:
            batch.seq_lens_cpu = batch.seq_lens_cpu + 1
        batch.spec_info.bonus_tokens = torch.randint(0, 100, (len(batch.reqs),), generator=gen).to(
            batch.spec_info.bonus_tokens.dtype
        )
    return logged


CATCH_UP_SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@CATCH_UP_SETTINGS
@given(case=spec_decode_cases(max_requests=4), steps=st.integers(1, 4))
def test_resume_replays_every_plain_position_and_hands_back_fresh_draft_state(case, steps):
    made = build_spec_decode_batch(case)
    batch = made.batch
    catch_up, passes, reports = draft_catch_up(made, case, capacity=4)
    start = batch.seq_lens.tolist()
    logged = plain_steps(catch_up, batch, steps, torch.Generator().manual_seed(case.seed % 2**31))
    assert passes.calls == []  # nothing replayed while the log has room

    catch_up.before_speculative_step(batch)

    [(kind, ext, hidden, tails)] = passes.calls
    bs = case.batch_size
    assert kind == "extend" and ext.prefix_lens == start and ext.extend_lens == [steps] * bs
    assert ext.seq_lens.tolist() == batch.seq_lens.tolist()
    # Request after request, step after step: the logged inputs and aux rows.
    assert ext.input_ids.tolist() == [int(logged[s][0][r]) for r in range(bs) for s in range(steps)]
    assert torch.equal(hidden, torch.stack([logged[s][1][r] for r in range(bs) for s in range(steps)]))
    assert tails.tolist() == batch.spec_info.bonus_tokens.tolist()
    assert (batch.spec_info.topk_index == 7).all() and (batch.spec_info.hidden_states == -1).all()
    assert reports == [(CatchUpReason.RESUME, bs, bs * steps)]
    catch_up.before_speculative_step(batch)  # caught up: nothing left to replay
    assert len(passes.calls) == 1


@CATCH_UP_SETTINGS
@given(case=spec_decode_cases(max_requests=4))
def test_a_full_log_is_flushed_into_the_draft_kv_before_the_next_plain_step(case):
    made = build_spec_decode_batch(case)
    batch = made.batch
    catch_up, passes, reports = draft_catch_up(made, case, capacity=2)
    draft_state = batch.spec_info.topk_index
    plain_steps(catch_up, batch, 2, torch.Generator().manual_seed(1))
    assert passes.calls == []
    plain_steps(catch_up, batch, 1, torch.Generator().manual_seed(2))

    [(kind, ext, hidden, tails, last_rows)] = passes.calls
    bs = case.batch_size
    assert kind == "fill_kv" and ext.extend_lens == [2] * bs
    assert last_rows.tolist() == [2 * r + 1 for r in range(bs)]
    assert batch.spec_info.topk_index is draft_state  # a flush hands back no draft state
    assert reports == [(CatchUpReason.BUFFER_FULL, bs, 2 * bs)]
    assert [catch_up.log.gap[i] for i in batch.req_pool_indices.tolist()] == [1] * bs  # the new gaps


def assert_every_plain_position_replayed_once(calls, batch, start: list[int], logged) -> None:
    """Across the draft passes' ``calls``, every position each request of ``batch``
    decoded plain (from ``start``, one per logged step) was replayed once, in order,
    with the token logged there."""
    covered = {req.rid: [] for req in batch.reqs}  # (first position, tokens) of each replay
    for call in calls:
        ext = call[1]
        tokens = iter(ext.input_ids.tolist())
        for req, prefix, n in zip(ext.reqs, ext.prefix_lens, ext.extend_lens):
            covered[req.rid].append((prefix, [next(tokens) for _ in range(n)]))
    steps = len(logged)
    for r, req in enumerate(batch.reqs):
        positions, tokens = [], []
        for prefix, got in covered[req.rid]:
            positions += range(prefix, prefix + len(got))
            tokens += got
        assert positions == list(range(start[r], start[r] + steps))
        assert tokens == [int(logged[s][0][r]) for s in range(steps)]


@CATCH_UP_SETTINGS
@given(case=spec_decode_cases(max_requests=4), budget=st.integers(1, 7), data=st.data())
def test_a_flush_budget_replays_every_position_once_in_pieces(case, budget, data):
    # Each plain step writes one position past the committed ones, into the KV slots the
    # scheduler reserved (case.reserve of them): no more steps than that.
    steps = data.draw(st.integers(1, min(12, case.reserve)), label="steps")
    made = build_spec_decode_batch(case)
    batch = made.batch
    catch_up, passes, reports = draft_catch_up(made, case, capacity=4, flush_tokens=budget)
    full = 4 + catch_up.log.slack  # flush_slack sized the log for the budget
    start = batch.seq_lens.tolist()
    logged = plain_steps(catch_up, batch, steps, torch.Generator().manual_seed(case.seed % 2**31))
    catch_up.before_speculative_step(batch)

    bs = case.batch_size
    assert_every_plain_position_replayed_once(passes.calls, batch, start, logged)
    flushes = [tokens for reason, _, tokens in reports if reason is CatchUpReason.BUFFER_FULL]
    assert all(t <= max(budget, full) for t in flushes), (flushes, budget, full)  # one full log
    assert [reason for reason, _, _ in reports][-1:] == (
        [CatchUpReason.RESUME] if bs * steps > sum(flushes) else []
    )


@settings(max_examples=200, deadline=None)
@given(gaps=st.lists(st.integers(1, 9), max_size=8), max_tokens=st.integers(0, 20))
def test_gap_rows_split_into_consecutive_groups_within_the_forward_size(gaps, max_tokens):
    n = len(gaps)
    rows = GapRows(list(range(n)), [10 + k for k in range(n)], gaps, [50 + k for k in range(n)])
    groups = rows.chunks(max_tokens)
    # Together, the groups are the requests, in order, each whole.
    for field in ("rows", "pool_indices", "gaps", "committed_lens"):
        assert [x for g in groups for x in getattr(g, field)] == getattr(rows, field)
    if max_tokens == 0 or sum(gaps) <= max_tokens:
        assert groups == [rows]
        return
    for group in groups:
        assert len(group) >= 1
        assert group.num_tokens <= max_tokens or len(group) == 1, (group, max_tokens)
    # Greedy: no group could have taken the next request too.
    for group, after in zip(groups, groups[1:]):
        assert group.num_tokens + after.gaps[0] > max_tokens


@CATCH_UP_SETTINGS
@given(
    case=spec_decode_cases(max_requests=4),
    forward_tokens=st.integers(1, 9),
    budget=st.sampled_from([0, 3]),
    mixed=st.booleans(),
    data=st.data(),
)
def test_every_catch_up_forward_replays_at_most_the_prefill_forward_size(
    case, forward_tokens, budget, mixed, data
):
    """Flushes (with and without a budget), the resume and a mixed step's catch-up run
    in draft forwards of whole gaps within ``forward_tokens`` (one request alone where
    its gap is larger), replay every position decoded plain once, in order, and the
    resume still hands every request fresh draft state."""
    steps = data.draw(st.integers(1, min(12, case.reserve)), label="steps")
    made = build_spec_decode_batch(case)
    batch = made.batch
    catch_up, passes, reports = draft_catch_up(made, case, capacity=4)
    catch_up.flush_tokens, catch_up.forward_tokens = budget, forward_tokens
    start = batch.seq_lens.tolist()
    logged = plain_steps(catch_up, batch, steps, torch.Generator().manual_seed(case.seed % 2**31))
    bs = case.batch_size
    if mixed:  # every request decoding in a mixed step: one token each (its pending token)
        step = copy.copy(batch)
        step.decoding_reqs = list(batch.reqs)
        step.extend_lens = [1] * bs
        step.prefix_lens = batch.seq_lens.tolist()
        step.input_ids = batch.spec_info.bonus_tokens.clone()
        catch_up.before_extend_step(step)
    else:
        catch_up.before_speculative_step(batch)

    for call in passes.calls:
        ext = call[1]
        assert ext.extend_num_tokens <= forward_tokens or len(ext.reqs) == 1, (
            ext.extend_lens,
            forward_tokens,
        )
    assert all(tokens <= forward_tokens or requests == 1 for _, requests, tokens in reports), reports
    assert_every_plain_position_replayed_once(passes.calls, batch, start, logged)
    final = [call for call in passes.calls if call[0] == "extend"]
    if not mixed and final:
        # Each request's draft state comes from its own forward's last position.
        assert (batch.spec_info.topk_index == 7).all() and (batch.spec_info.hidden_states == -1).all()
        tails = torch.cat([call[3] for call in final]).tolist()
        resumed = [req.rid for call in final for req in call[1].reqs]
        pending = dict(zip([req.rid for req in batch.reqs], batch.spec_info.bonus_tokens.tolist()))
        assert tails == [pending[rid] for rid in resumed]


@CATCH_UP_SETTINGS
@given(case=spec_decode_cases(max_requests=4))
def test_a_prefill_drops_the_logs_of_its_requests(case):
    made = build_spec_decode_batch(case)
    batch = made.batch
    catch_up, passes, _ = draft_catch_up(made, case, capacity=4)
    plain_steps(catch_up, batch, 2, torch.Generator().manual_seed(3))
    prefill = copy.copy(batch)
    prefill.decoding_reqs = None
    catch_up.before_extend_step(prefill)
    assert passes.calls == [] and not any(catch_up.log.gap)


def test_the_plain_step_hooks_must_bracket_a_step():
    case = SPEC_CASE
    made = build_spec_decode_batch(case)
    catch_up, _, _ = draft_catch_up(made, case, capacity=4)
    with pytest.raises(RuntimeError, match="without before_plain_step"):
        catch_up.after_plain_step(torch.zeros(1, dtype=torch.int64), torch.zeros(1, AUX_WIDTH))
    catch_up.before_plain_step(made.batch)
    with pytest.raises(RuntimeError, match="no hidden states"):
        catch_up.after_plain_step(made.batch.spec_info.bonus_tokens, None)


def test_no_catch_up_implements_the_protocol_and_does_nothing():
    made = build_spec_decode_batch(SPEC_CASE)
    off = NoCatchUp()
    hooks: CatchUp = off  # type-checked: NoCatchUp and DraftCatchUp share the protocol
    assert not hooks.enabled and hooks.nbytes == 0
    hooks.before_plain_step(made.batch)
    hooks.after_plain_step(made.batch.spec_info.bonus_tokens, None)
    hooks.before_speculative_step(made.batch)
    hooks.before_extend_step(made.batch)


# ------------------------------------------------- draft-vs-target comparison (replays)
class FakeTop1:
    """A stand-in for ``compat.DraftTop1`` over ``FakeDraft``: the captured "hidden
    state" of a row is the proposal itself (one column), so ``top1`` reads it back."""

    def __init__(self):
        self.seen: list | None = None
        self.rows: torch.Tensor | None = None

    @contextlib.contextmanager
    def capture(self, rows):
        self.seen, self.rows = [], rows
        try:
            yield self.seen
        finally:
            self.seen = self.rows = None

    def forward(self, proposals: torch.Tensor) -> None:
        """A draft forward ran: its logits head saw ``proposals`` ``[num_tokens]``."""
        if self.seen is not None:
            self.seen.append(proposals.to(torch.float32)[:, None].index_select(0, self.rows))

    def top1(self, hidden):
        return hidden[:, 0].to(torch.int64)


def proposal(rotated: list[int], i: int) -> int:
    """What the fake draft proposes at gap index ``i`` of a request whose rotated input
    (logged tokens after the first, then the pending token) is ``rotated``: the token
    the target decoded after ``rotated[i]`` (``rotated[i + 1]``) unless that token is a
    multiple of 3, and a token the target never decodes otherwise. At the last index,
    whose answer is not known yet, it proposes the pending token, which a comparison
    that did not leave that index out would count (against the clamped last row)."""
    if i == len(rotated) - 1:
        return rotated[i]
    return rotated[i + 1] if rotated[i + 1] % 3 else -1 - i


class FakeDraft(FakeDraftPasses):
    """Draft passes that also "propose", through ``FakeTop1``, as ``proposal`` says."""

    def __init__(self, topk: int, hidden_size: int):
        super().__init__(topk, hidden_size)
        self.top1 = FakeTop1()

    def _propose(self, ext, tails, right_at=None):
        out, start = [], 0
        for k, g in enumerate(ext.extend_lens):
            rotated = ext.input_ids[start + 1 : start + g].tolist() + [int(tails[k])]
            out += [proposal(rotated, i) for i in range(g)]
            start += g
        out = torch.tensor(out)
        if right_at is not None:  # as compat.fill_draft_kv: right only where asked (MlpAtRows)
            wrong = torch.full_like(out, -7)
            out = wrong.index_copy(0, right_at, out.index_select(0, right_at))
        self.top1.forward(out)

    def extend(self, ext, hidden, tails):
        self._propose(ext, tails)
        return super().extend(ext, hidden, tails)

    def fill_kv(self, ext, hidden, tails, last_rows, compared_rows=None):
        self._propose(
            ext,
            tails,
            right_at=compared_rows if compared_rows is not None else torch.tensor([], dtype=torch.int64),
        )
        super().fill_kv(ext, hidden, tails, last_rows, compared_rows)


def comparing_catch_up(made, case, capacity):
    draft = FakeDraft(case.topk, case.hidden_size)
    catch_up = DraftCatchUp(
        made.req_to_token,
        capacity=capacity,
        hidden_width=AUX_WIDTH,
        hidden_dtype=torch.float32,
        passes=DraftPasses(draft.extend, draft.fill_kv, draft.top1),
        report=lambda *args: None,
    )
    return catch_up, draft


def expected_tally(logged, tails, compared_every=1) -> tuple[int, int]:
    """(matches, positions) from the logged plain steps, in pure Python: request ``r``'s
    gap index ``i`` is compared with the token decoded two positions on, for every
    index but the last; with ``compared_every`` > 1, only flat rows that are multiples
    of it (request after request)."""
    matches = positions = row = 0
    for r, tail in enumerate(tails):
        inputs = [int(step[0][r]) for step in logged]
        rotated = inputs[1:] + [int(tail)]
        for i in range(len(inputs)):
            if row % compared_every == 0 and i < len(inputs) - 1:
                positions += 1
                matches += (
                    proposal(rotated, i) == inputs[i + 2]
                    if i + 2 < len(inputs)
                    else (proposal(rotated, i) == int(tail))
                )
            row += 1
    return matches, positions


@CATCH_UP_SETTINGS
@given(case=spec_decode_cases(max_requests=4), steps=st.integers(1, 4), resume=st.booleans())
def test_a_catch_up_counts_where_the_drafts_top1_is_the_targets_next_token(case, steps, resume):
    """Both kinds of catch-up (a resume's draft extend, a full buffer's KV fill) tally the
    draft's proposals against the tokens the target decoded: the right position (not
    the draft's own input, not one past), each request's last position left out."""
    made = build_spec_decode_batch(case)
    batch = made.batch
    capacity = steps if not resume else 4
    catch_up, draft = comparing_catch_up(made, case, capacity)
    logged = plain_steps(catch_up, batch, steps, torch.Generator().manual_seed(case.seed % 2**31))
    tails = batch.spec_info.bonus_tokens.tolist()
    if resume:
        catch_up.before_speculative_step(batch)
    else:
        plain_steps(catch_up, batch, 1, torch.Generator().manual_seed(5))  # flushes first
    assert draft.calls[0][0] == ("extend" if resume else "fill_kv")

    matches, positions = expected_tally(logged, tails)
    assert catch_up.replays.read_back(stamp=7) == []  # closed now, read at the next call
    assert catch_up.replays.read_back(stamp=8) == ([(matches, positions, 7)] if positions else [])
    assert catch_up.replays.read_back(stamp=9) == []  # nothing since


def test_at_most_max_compared_positions_are_compared_evenly_spaced(monkeypatch):
    made = build_spec_decode_batch(SPEC_CASE)  # two requests
    monkeypatch.setattr(catch_up_module, "MAX_COMPARED", 3)
    catch_up, draft = comparing_catch_up(made, SPEC_CASE, capacity=4)
    logged = plain_steps(catch_up, made.batch, 4, torch.Generator().manual_seed(9))
    tails = made.batch.spec_info.bonus_tokens.tolist()
    catch_up.before_speculative_step(made.batch)
    # 8 replayed rows, at most 3 compared: rows 0, 3, 6 (stride 3); row 3 is request 0's last.
    assert draft.calls and catch_up.replays.read_back(0) == []
    [(matches, positions, _)] = catch_up.replays.read_back(1)
    assert (matches, positions) == expected_tally(logged, tails, compared_every=3)
    assert positions == 2


def test_nothing_is_compared_without_a_top1_reader():
    made = build_spec_decode_batch(SPEC_CASE)
    catch_up, passes, _ = draft_catch_up(made, SPEC_CASE, capacity=4)
    assert catch_up.replays is None and NoCatchUp().replays is None


def test_the_tally_reads_back_only_copies_that_have_run():
    class Pending(HostCopy):
        done = False

        def ready(self):
            return self.done

    tally = ReplayTally("cpu")
    tally.add(torch.tensor([True, False, True]), 3)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(catch_up_module, "HostCopy", Pending)
        assert tally.read_back(16) == []  # window closed, its copy not run yet
        tally.add(torch.tensor([True]), 1)
        assert tally.read_back(32) == []  # still not: the first window blocks the queue
    for copy_, _, _ in tally._closed:
        copy_.done = True
    assert tally.read_back(48) == [(2, 3, 16), (1, 1, 32)]  # in order, each its own stamp
    assert tally.read_back(64) == []  # windows with no positions are not closed


def test_a_window_stays_open_while_a_side_stream_flush_may_still_add_to_it():
    flush_running = [True]
    tally = ReplayTally("cpu", busy=lambda: flush_running[0])
    tally.add(torch.tensor([True, True]), 2)
    assert tally.read_back(16) == [] and not tally._closed  # not closed: the sum may be partial
    flush_running[0] = False
    assert tally.read_back(32) == []  # closed now, under this stamp
    assert tally.read_back(48) == [(2, 2, 32)]


# ------------------------------------------- buffer-full flushes on a side stream
class RecordingSideStream:
    """``SideStream``'s interface; notes, in the shared timeline, where work is queued
    beside the current stream and where the current stream waits for it."""

    def __init__(self, timeline: list):
        self.timeline, self.kept = timeline, []

    @contextlib.contextmanager
    def queue(self, *keep):
        self.timeline.append("side:begin")
        yield
        self.timeline.append("side:end")
        self.kept.append(keep)

    def busy(self) -> bool:
        return False

    def join(self) -> None:
        self.timeline.append("join")


def side_stream_catch_up(made, case, capacity):
    timeline = []
    passes = FakeDraftPasses(case.topk, case.hidden_size)

    def noted(name, run):
        def call(*args):
            timeline.append(name)
            return run(*args)

        return call

    side = RecordingSideStream(timeline)
    catch_up = DraftCatchUp(
        made.req_to_token,
        capacity=capacity,
        hidden_width=AUX_WIDTH,
        hidden_dtype=torch.float32,
        passes=DraftPasses(noted("extend", passes.extend), noted("fill_kv", passes.fill_kv)),
        report=lambda *report: timeline.append(("report", report[0])),
        side=side,
    )
    return catch_up, passes, side, timeline


@CATCH_UP_SETTINGS
@given(case=spec_decode_cases(max_requests=4))
def test_a_side_stream_flush_runs_beside_the_plain_steps_and_every_draft_pass_waits_for_it(case):
    made = build_spec_decode_batch(case)
    batch = made.batch
    catch_up, passes, side, timeline = side_stream_catch_up(made, case, capacity=2)
    logged = plain_steps(catch_up, batch, 3, torch.Generator().manual_seed(4))  # the third flushes

    # The flush's draft forward is queued on the side stream; nothing waits for it while plain.
    assert timeline == ["side:begin", "fill_kv", "side:end", ("report", CatchUpReason.BUFFER_FULL)]
    [(_, ext, hidden, tails, _)] = passes.calls
    bs = case.batch_size
    # It read the logged rows of the first two steps, gathered before the third step wrote
    # the log again, and every tensor it read from the current stream is held for it.
    assert torch.equal(hidden, torch.stack([logged[s][1][r] for r in range(bs) for s in range(2)]))
    [kept] = side.kept
    assert any(k is ext for k in kept) and sum(isinstance(k, torch.Tensor) for k in kept) >= 3

    timeline.clear()
    catch_up.before_speculative_step(batch)  # the resume: waits, then replays the third step
    assert timeline[0] == "join" and timeline[1:] == ["extend", ("report", CatchUpReason.RESUME)]
    timeline.clear()
    prefill = copy.copy(batch)
    prefill.decoding_reqs = None
    catch_up.before_extend_step(prefill)  # SGLang's draft pass follows a prefill
    assert timeline == ["join"]


def test_side_stream_bookkeeping_on_a_device_without_streams():
    from sglang_dynspec.device_timer import SideStream

    side = SideStream("cpu")
    ran = []
    with side.queue(torch.ones(2)):
        ran.append("work")
    assert ran == ["work"] and side.pending and not side.busy()
    side.join()
    assert not side.pending


class FakeCudaStreams:
    """``torch.cuda``'s stream calls as ``SideStream`` makes them, on the host: which stream
    is current, what waits for what, and events that complete when the test says."""

    class Event:
        def __init__(self):
            self.done = False

        def record(self, stream):
            stream.log.append("record")

        def query(self):
            return self.done

    class Stream:
        def __init__(self, name, log):
            self.name, self.log, self.device = name, log, "cuda:0"

        def wait_stream(self, other):
            self.log.append(f"{self.name} waits for {other.name}")

        def wait_event(self, event):
            self.log.append(f"{self.name} waits for an event")

    def __init__(self, monkeypatch):
        self.log = []
        self.main = self.Stream("main", self.log)
        self.current = self.main
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: self.current)
        monkeypatch.setattr(torch.cuda, "stream", self._use)
        monkeypatch.setattr(torch.cuda, "Event", self.Event)

    @contextlib.contextmanager
    def _use(self, stream):
        self.current, before = stream, self.current
        try:
            yield
        finally:
            self.current = before


def test_a_side_stream_holds_what_its_blocks_read_only_until_they_have_run(monkeypatch):
    from sglang_dynspec.device_timer import SideStream

    cuda = FakeCudaStreams(monkeypatch)
    side = SideStream("cpu")
    side._stream = cuda.Stream("side", cuda.log)  # as on a GPU
    with side.queue("first"):
        assert cuda.current is side._stream  # the block's work goes on the side stream
    assert cuda.current is cuda.main and cuda.log == ["side waits for main", "record"]
    first = side._done
    with side.queue("second"):
        pass
    assert side._kept == [("first",), ("second",)] and side.busy()  # both may still be running
    first.done = side._done.done = True
    with side.queue("third"):  # a long plain phase: no join, and nothing piles up
        pass
    assert side._kept == [("third",)]
    side.join()
    assert cuda.log[-1] == "main waits for an event" and side._kept == [] and not side.busy()


# ------------------------------------- a flush without the draft's last MLP (compat)
class CountingMlp(torch.nn.Module):
    """A stand-in MLP: doubles its rows and counts the rows it was given."""

    def __init__(self):
        super().__init__()
        self.rows_seen = 0

    def forward(self, x):
        self.rows_seen += x.shape[0]
        return 2 * x + 1


@given(n=st.integers(1, 12), data=st.data())
def test_the_last_mlp_runs_only_at_the_compared_rows(n, data):
    rows = sorted(data.draw(st.sets(st.integers(0, n - 1))))
    hidden = torch.randn(n, 3)
    mlp = CountingMlp()
    out = compat.MlpAtRows(mlp, torch.tensor(rows, dtype=torch.int64))(hidden)
    for r in range(n):
        expected = 2 * hidden[r] + 1 if r in rows else hidden[r]
        assert torch.equal(out[r], expected), r
    assert mlp.rows_seen == len(rows)
    assert torch.equal(compat.MlpAtRows(mlp, None)(hidden), hidden) and mlp.rows_seen == len(rows)


def test_the_last_mlp_is_put_back_after_the_flush_even_when_it_fails():
    layer = types.SimpleNamespace(mlp=CountingMlp())
    real = layer.mlp
    with compat.last_mlp_only_at(layer, None):
        assert isinstance(layer.mlp, compat.MlpAtRows) and layer.mlp.mlp is real
    assert layer.mlp is real
    with pytest.raises(RuntimeError), compat.last_mlp_only_at(layer, torch.tensor([0])):
        raise RuntimeError("draft forward failed")
    assert layer.mlp is real
    with compat.last_mlp_only_at(None, None):  # a draft of another class: nothing changes
        pass


@given(lens=st.lists(st.integers(1, 9), min_size=1, max_size=8))
def test_the_last_rows_of_a_prefill_are_each_requests_last_token(lens):
    batch = types.SimpleNamespace(extend_lens=lens, input_ids=torch.zeros(sum(lens), dtype=torch.int64))
    rows = compat.extend_last_rows(batch).tolist()
    flat_owner = [r for r, n in enumerate(lens) for _ in range(n)]
    assert len(rows) == len(lens)
    for r, row in enumerate(rows):
        assert flat_owner[row] == r and (row + 1 == len(flat_owner) or flat_owner[row + 1] == r + 1)


def test_an_idle_batch_has_no_last_rows():
    assert compat.extend_last_rows(types.SimpleNamespace(extend_lens=[], input_ids=None)) is None


# ------------------------------------- the draft's prefill graph left out (compat)
class GraphSeen:
    """A draft runner whose forward records whether its prefill graph was in place."""

    def __init__(self, graph):
        self.prefill_cuda_graph_runner = graph
        self.seen = []

    def forward(self):
        self.seen.append(self.prefill_cuda_graph_runner)


def _worker_with(runner):
    return types.SimpleNamespace(draft_worker=types.SimpleNamespace(draft_runner=runner))


@given(num_tokens=st.integers(0, 5000), eager_from=st.sampled_from([0, 1, 1024, 4096]))
def test_a_forward_skips_the_drafts_prefill_graph_exactly_from_the_threshold(num_tokens, eager_from):
    graph = object()
    runner = GraphSeen(graph)
    with compat.draft_graph_off_from(_worker_with(runner), num_tokens, eager_from):
        runner.forward()
    eager = eager_from > 0 and num_tokens >= eager_from
    assert runner.seen == [None if eager else graph]
    assert runner.prefill_cuda_graph_runner is graph  # put back


def test_the_drafts_prefill_graph_is_put_back_when_the_forward_fails():
    graph = object()
    runner = GraphSeen(graph)
    with pytest.raises(RuntimeError), compat.draft_graph_off_from(_worker_with(runner), 8192, 1024):
        assert runner.prefill_cuda_graph_runner is None
        raise RuntimeError("draft forward failed")
    assert runner.prefill_cuda_graph_runner is graph
    runner = GraphSeen(None)  # no graph (the CPU test bed, --disable-cuda-graph): nothing changes
    with compat.draft_graph_off_from(_worker_with(runner), 8192, 1024):
        runner.forward()
    assert runner.seen == [None]


def test_a_prefill_leaves_the_drafts_graph_only_with_its_last_mlp_cut():
    """The prefill's draft pass skips the graph from the threshold when the cut applies
    (a LlamaForCausalLMEagle3 draft), and never for a draft of another class, whose
    pass would gain nothing from leaving the graph."""
    graph = object()
    runner = GraphSeen(graph)
    runner.model = object()  # not a LlamaForCausalLMEagle3: no last layer to cut
    batch = types.SimpleNamespace(
        forward_mode=compat.ForwardMode.EXTEND,
        extend_lens=[2048],
        input_ids=torch.zeros(2048, dtype=torch.int64),
    )
    with compat.draft_mlp_at_last_rows(_worker_with(runner), batch, eager_from=1024):
        runner.forward()
    assert runner.seen == [graph]

    eagle3 = compat.LlamaForCausalLMEagle3.__new__(compat.LlamaForCausalLMEagle3)
    torch.nn.Module.__init__(eagle3)
    layer = types.SimpleNamespace(mlp=CountingMlp())
    eagle3.model = types.SimpleNamespace(layers=[layer])
    runner.model = eagle3
    for tokens, expected in ((2048, None), (1023, graph)):
        runner.seen.clear()
        batch.extend_lens, batch.input_ids = [tokens], torch.zeros(tokens, dtype=torch.int64)
        with compat.draft_mlp_at_last_rows(_worker_with(runner), batch, eager_from=1024):
            assert isinstance(layer.mlp, compat.MlpAtRows)
            runner.forward()
        assert runner.seen == [expected] and runner.prefill_cuda_graph_runner is graph, tokens
