"""Draft catch-up: replay the positions decoded in plain mode into the EAGLE-3 draft.

An EAGLE-3 draft keeps its own KV cache, in the same slots as the target's. For each
committed position ``p`` the draft stores what its layer computes from the target's
packed auxiliary hidden state at ``p`` and the token at ``p + 1``; its next proposal
starts from the last such row. A plain step runs the target alone, so without this
module the draft KV at the positions plain steps decode is never written, and the
first proposals after speculation resumes start from the state the last speculative
step left.

During plain steps, :class:`PlainGapLog` keeps, for each request slot, the target's
auxiliary hidden state and input token of every position decoded since the request's
draft state was last current (the request's *gap*), in a buffer of ``capacity``
positions per slot. :func:`build_catch_up_batch` then makes one EXTEND batch over
every gap, and SGLang's own draft prefill pass (``_draft_extend_for_prefill``, the
pass that follows a target prefill) writes the draft KV an always-speculating server
would have written there and returns fresh proposals:

    committed KV:  t0 ... t[s-1] | t[s] ... t[L-1] | pending: b (position L)
                   draft KV ok     gap (plain steps)
    catch-up:      EXTEND with prefix s, extend L - s; input t[s..L-1] (rotated by
                   one, b appended, as a prefill), hidden = the logged aux rows

While it replays, a catch-up also measures how well the draft would have drafted
(``ReplayTally``; on when the policy uses it, the goodput policy): at each replayed
position it compares the draft's top-1 proposal with the token the target decoded
there. The draft at position ``p`` reads the target's state at ``p`` and the token at
``p + 1`` (the rotated input) and proposes the token at ``p + 2``: the next input
token of the rotated sequence, which is in the log for all but each request's last
position (the pending token ``b`` for the one before it; the last position's
proposal is the next step's draft, not known yet). So a request with a gap of ``g``
gives ``g - 1`` comparisons, at most ``MAX_COMPARED`` per catch-up (evenly spaced
beyond that). Matches add up in a device tensor; the host reads them back, behind
the queued work, only when the estimate feed agrees its inputs (``read_back``).

When it runs (``worker.py``): before a speculative step whose batch has gaps (the
resume), before a mixed prefill+decode step for its decoding requests, and in plain
mode before a step at which a gap would outgrow the buffer (then every gap in the
batch is flushed, so gaps restart together and the next flush is ``capacity`` steps
away; or, with a flush budget, the largest gaps in pieces of that many positions,
starting early enough that all are flushed in time, in a buffer ``flush_slack``
positions longer so that they start no earlier than a full ``capacity``:
``PlainGapLog.due_for_flush``).
The buffer never overflows. What stays stale: a request that finishes while
plain leaves fewer than ``capacity`` trailing positions unreplayed; a later request
that reuses that prefix from the radix cache drafts from them (lower acceptance,
never a wrong token: the target verifies every draft).
"""

from __future__ import annotations

import contextlib
import copy
import itertools
from collections import deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from sglang_dynspec import compat
from sglang_dynspec.compat import ForwardMode, ScheduleBatch
from sglang_dynspec.device_timer import DeviceTimer, HostCopy, SideStream, to_device
from sglang_dynspec.metric_names import CatchUpReason

# Reports a queued catch-up: (reason, requests, tokens, timer) -> None
# (``controller.ModeController.on_catch_up``).
CatchUpReport = Callable[[CatchUpReason, int, int, DeviceTimer], None]


@dataclass(frozen=True)
class GapRows:
    """The requests of one batch that have a gap, in batch order (host values)."""

    rows: list[int]  # row of each request in the batch
    pool_indices: list[int]  # its req_to_token row
    gaps: list[int]  # positions decoded plain since its draft state was current
    committed_lens: list[int]  # its KV-committed length L (gap = [L - gap, L))

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def num_tokens(self) -> int:
        return sum(self.gaps)

    def last_positions(self) -> list[int]:
        """Index of each request's last replayed position, request after request."""
        return list(itertools.accumulate(self.gaps, initial=-1))[1:]

    def chunks(self, max_tokens: int) -> list[GapRows]:
        """These requests in consecutive groups that replay at most ``max_tokens``
        positions each (a request whose gap alone is larger is a group of its own: a
        gap is never split, its last position gives the request's draft state);
        ``max_tokens`` 0: one group."""
        if max_tokens <= 0 or self.num_tokens <= max_tokens:
            return [self]
        groups, start, tokens = [], 0, 0
        for k, gap in enumerate(self.gaps):
            if k > start and tokens + gap > max_tokens:
                groups.append(self._slice(start, k))
                start, tokens = k, 0
            tokens += gap
        groups.append(self._slice(start, len(self.gaps)))
        return groups

    def _slice(self, start: int, stop: int) -> GapRows:
        return GapRows(
            self.rows[start:stop],
            self.pool_indices[start:stop],
            self.gaps[start:stop],
            self.committed_lens[start:stop],
        )


@dataclass(frozen=True)
class GapIndex:
    """:class:`GapRows` on the device, one entry per replayed position (request after
    request) or per request.

    Built from one host-to-device copy of the per-request values and expanded on the
    device, so a catch-up's host work grows with its requests, not its positions: the
    per-position Python lists it replaces took 3.4 ms for a flush of 64 requests x 128
    positions and 7.4 ms for 128 x 128 on this project's CPU, inside a flush of 14.5 ms
    of device time on the H200 (benchmarks/results/h200-20261203-d79b2bd/README.md).
    """

    slots: torch.Tensor  # [T] the req_to_token row of each position
    cols: torch.Tensor  # [T] its column in the request's log (0 .. gap - 1)
    positions: torch.Tensor  # [T] its position in the sequence (L - gap .. L - 1)
    last: torch.Tensor  # [n] index of each request's last position among the T
    pool_indices: torch.Tensor  # [n] each request's req_to_token row
    committed_lens: torch.Tensor  # [n] each request's committed length L
    rows: torch.Tensor  # [n] each request's row in the batch

    @classmethod
    def of(cls, gap_rows: GapRows, device) -> GapIndex:
        per_request = to_device(
            [gap_rows.pool_indices, gap_rows.gaps, gap_rows.committed_lens, gap_rows.rows],
            torch.int64,
            device,
        )
        pool_indices, gaps, lens, rows = per_request
        total = gap_rows.num_tokens
        ends = gaps.cumsum(0)
        # output_size: the host knows the total, so the expansion does not read the device.
        owner = torch.repeat_interleave(
            torch.arange(len(gap_rows), device=gaps.device), gaps, output_size=total
        )
        cols = torch.arange(total, device=gaps.device) - (ends - gaps)[owner]
        return cls(
            slots=pool_indices[owner],
            cols=cols,
            positions=(lens - gaps)[owner] + cols,
            last=ends - 1,
            pool_indices=pool_indices,
            committed_lens=lens,
            rows=rows,
        )


class PlainGapLog:
    """Per request slot: the aux hidden states and tokens of positions decoded plain.

    Host counters (``gap``) drive every decision, so no step needs a device sync, and
    pick the column each plain step writes (a request's gap is its log's fill). A gap's first position
    (the committed length when it started, ``start_gaps``) is copied to the host
    behind the step that decodes it; every plain step commits exactly one position,
    so the committed length at a catch-up is that start plus the gap, known on the
    host without reading the device's ``seq_lens`` (under the overlap scheduler
    SGLang keeps no host mirror of them for some attention backends).
    """

    def __init__(
        self,
        pool_size: int,
        capacity: int,
        hidden_width: int,
        hidden_dtype: torch.dtype,
        device,
        slack: int = 0,
    ):
        """``capacity``: the positions per slot that ``--speculative-catch-up-tokens``
        asks for; ``slack``: more, that let flushes in pieces start no earlier than a
        full ``capacity`` (``flush_slack``). ``self.capacity`` is their sum."""
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        if slack < 0:
            raise ValueError(f"slack must be non-negative, got {slack}")
        _check_device_memory(
            self.bytes_needed(pool_size, capacity + slack, hidden_width, hidden_dtype), capacity, device
        )
        self.capacity = capacity + slack
        self.slack = slack
        self.device = device
        self.hidden = torch.zeros(pool_size, self.capacity, hidden_width, dtype=hidden_dtype, device=device)
        self.tokens = torch.zeros(pool_size, self.capacity, dtype=torch.int64, device=device)
        self.gap = [0] * pool_size
        # Per slot with a gap: (copy, index) of its gap's first position.
        self._start: list[tuple[HostCopy, int] | None] = [None] * pool_size

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.hidden, self.tokens))

    @staticmethod
    def bytes_needed(pool_size: int, capacity: int, hidden_width: int, hidden_dtype: torch.dtype) -> int:
        """Device memory of a log: per slot, ``capacity`` aux rows and tokens."""
        per_position = hidden_width * torch.empty((), dtype=hidden_dtype).element_size() + 8
        return pool_size * capacity * per_position

    def is_full(self, pool_indices: Sequence[int]) -> bool:
        """True if recording one more plain step would overflow some request's buffer."""
        return bool(pool_indices) and max(map(self.gap.__getitem__, pool_indices)) >= self.capacity

    def due_for_flush(self, pool_indices: Sequence[int], budget: int = 0) -> list[int]:
        """The slots whose gaps to flush before the next plain step (empty: none yet).

        ``budget`` 0: every gap of the batch, once one would overflow. Else a flush
        replays ``budget`` positions at most: it starts ``lead`` steps before a full
        buffer, where ``lead`` flushes of ``budget // capacity`` full logs drain a batch
        whose gaps all started together, and takes the largest gaps that have reached
        that point (at least one; every full one, whatever the budget, so the buffer
        never overflows: a budget under ``capacity * ceil(batch / capacity)`` cannot start
        early enough, and the batch may grow faster than the lead allowed for).
        """
        capacity, gap = self.capacity, self.gap
        largest = max(map(gap.__getitem__, pool_indices), default=0)
        if budget <= 0 or budget >= len(pool_indices) * capacity:
            return [i for i in pool_indices if gap[i]] if largest >= capacity else []
        start = max(1, first_piece_at(capacity, budget, len(pool_indices)))
        if largest < start:
            return []
        chosen, tokens = [], 0
        for i in sorted((i for i in pool_indices if gap[i] >= start), key=gap.__getitem__, reverse=True):
            if chosen and tokens + gap[i] > budget and gap[i] < capacity:
                break
            chosen.append(i)
            tokens += gap[i]
        return chosen

    def start_gaps(self, pool_indices: Sequence[int], positions: torch.Tensor) -> None:
        """Note where the gaps of the slots without one start: ``positions[i]`` (device)
        is the position request ``i`` is about to decode plain. Call before the step's
        forward, so the copy runs behind the work already queued."""
        new = [k for k, i in enumerate(pool_indices) if not self.gap[i]]
        if not new:
            return
        if len(new) < len(pool_indices):
            positions = positions[to_device(new, torch.int64, positions.device)]
        copy = HostCopy(positions)
        for j, k in enumerate(new):
            self._start[pool_indices[k]] = (copy, j)

    def record(self, pool_indices: Sequence[int], tokens: torch.Tensor, hidden: torch.Tensor) -> None:
        """Log one plain step: ``tokens[i]`` was the input and ``hidden[i]`` the aux state
        at the position request ``i`` just decoded. Call ``is_full`` (and flush) first."""
        if self.is_full(pool_indices):
            full = [i for i in pool_indices if self.gap[i] >= self.capacity]
            raise RuntimeError(f"request slots {full}: plain-step log full ({self.capacity} positions)")
        gap, start, capacity = self.gap, self._start, self.capacity
        at = []
        for i in pool_indices:
            if start[i] is None:
                raise RuntimeError(f"request slot {i}: plain step recorded without start_gaps")
            at.append(i * capacity + gap[i])
            gap[i] += 1
        # Flat rows from the host's counters, copied once through pinned memory: the
        # step adds one copy and two index_copy_ kernels, where a device cursor cost
        # five small kernels more per plain step (the plain step's GPU time beside a
        # baseline step's: benchmarks/results/h200-20261204-673c6bf/README.md, section 3).
        # index_copy_ rather than ``hidden[idx, col] = ...``: on the CPU test bed
        # 0.02 ms instead of 8 ms per step at 64 requests (two-tensor index_put).
        at = to_device(at, torch.int64, self.device)
        self.hidden.view(-1, self.hidden.shape[-1]).index_copy_(0, at, hidden.to(self.hidden.dtype))
        self.tokens.view(-1).index_copy_(0, at, tokens.to(torch.int64))

    def forget(self, pool_indices: Sequence[int]) -> None:
        """Empty the logs of these slots (caught up, or freshly prefilled). Host
        counters only: the next plain step of a slot writes from column 0."""
        for i in pool_indices:
            self.gap[i] = 0
            self._start[i] = None

    def committed_len(self, slot: int) -> int:
        """The committed length of a slot with a gap: its gap's start plus the gap."""
        copy, index = self._start[slot]
        return copy.read()[index] + self.gap[slot]

    def gap_rows(
        self,
        pool_indices: Sequence[int],
        committed_lens: Sequence[int] | None = None,
        only: Collection[int] | None = None,
    ) -> GapRows:
        """The rows with a gap (of the slots in ``only``, if given); ``committed_lens``
        (by row) defaults to the log's own."""
        rows = [r for r, i in enumerate(pool_indices) if self.gap[i] and (only is None or i in only)]
        slots = [pool_indices[r] for r in rows]
        if committed_lens is None:
            lens = [self.committed_len(i) for i in slots]
        else:
            lens = [int(committed_lens[r]) for r in rows]
        return GapRows(rows=rows, pool_indices=slots, gaps=[self.gap[i] for i in slots], committed_lens=lens)

    def gather(self, gap_rows: GapRows, index: GapIndex | None = None):
        """# [num_tokens, width], [num_tokens]: the logged rows, request after request
        (``index``: ``gap_rows`` on the device, when the caller has it already)."""
        index = index if index is not None else GapIndex.of(gap_rows, self.device)
        at = index.slots * self.capacity + index.cols
        return self.hidden.view(-1, self.hidden.shape[-1])[at], self.tokens.view(-1)[at]


def first_piece_at(length: int, budget: int, batch_size: int) -> int:
    """The gap at which flushes in pieces of ``budget`` start for ``batch_size`` logs of
    ``length`` positions that filled together: ``lead`` steps before a full log, where
    ``lead`` pieces of ``budget // length`` full logs drain them (may be under 1)."""
    lead = -(-batch_size // max(1, budget // length))
    return length - lead + 1


def flush_slack(capacity: int, budget: int, pool_size: int) -> int:
    """Positions per slot beyond ``capacity`` for flushes in pieces of ``budget``.

    Pieces must start ``lead`` steps before a full log (``PlainGapLog.due_for_flush``), so
    in a log of exactly ``capacity`` positions a wave of requests admitted together is
    flushed at ``capacity - lead + 1`` to ``capacity`` positions, and a request that
    decodes ``2 x capacity`` tokens plain fills its log a second time just before it
    ends: flushed twice, where all at once flushes it once (the closed loop's 256-token
    requests with the default 128 positions: about twice the positions replayed, H200,
    benchmarks/results/h200-20261203-2c4f5f3/README.md). With ``lead - 1`` more
    positions the pieces start no earlier than a full ``capacity``, for a batch of every
    slot (a piece holds ``budget // (capacity + slack)`` logs, so the lead is counted at
    the larger size). At most a quarter of ``capacity`` more (memory), and no log larger
    than the budget; where those bounds leave too few, none (the pieces start early, as
    without slack). 0 without a budget, or one that holds every log."""
    if budget <= 0 or budget >= pool_size * capacity:
        return 0
    most = max(0, min(capacity // 4, budget - capacity))
    for slack in range(most + 1):
        if first_piece_at(capacity + slack, budget, pool_size) >= capacity:
            return slack
    # Out of bounds: the pieces start early with or without slack, and more positions
    # per flush would replay more, not less (a larger log can mean fewer per piece).
    return 0


# Device memory left free after the log is allocated: SGLang has already sized its
# KV pool, and the plain decode graph (176 MiB on the 8B shape with batch sizes up to
# 128, benchmarks/results/h200-20261201-architecture-check/) is captured after the log.
CATCH_UP_MEMORY_HEADROOM = 1 << 30


def _check_device_memory(needed: int, capacity: int, device) -> None:
    """Refuse, naming the flag, a log that would not fit in free device memory."""
    if torch.device(device).type != "cuda":
        return
    free = torch.cuda.mem_get_info(device)[0]
    if needed + CATCH_UP_MEMORY_HEADROOM > free:
        fits = max(0, capacity * (free - CATCH_UP_MEMORY_HEADROOM) // max(needed, 1))
        raise RuntimeError(
            f"--speculative-catch-up-tokens {capacity} needs {needed / 2**20:.0f} MiB of device memory for "
            f"the draft catch-up buffer, but only {free / 2**20:.0f} MiB are free after SGLang sized its KV "
            f"pool (and {CATCH_UP_MEMORY_HEADROOM / 2**20:.0f} MiB must stay free for the plain decode graph); "
            f"lower it to {fits} or less, or lower --mem-fraction-static"
        )


def free_memory_note(device) -> str:
    """``"N MiB of device memory free"`` on CUDA (for the start-up log); else ``"host memory"``."""
    if torch.device(device).type != "cuda":
        return "host memory"
    return f"{torch.cuda.mem_get_info(device)[0] / 2**20:.0f} MiB of device memory free"


def build_catch_up_batch(
    batch: ScheduleBatch,
    gap_rows: GapRows,
    tokens: torch.Tensor,
    req_to_token: torch.Tensor,
    index: GapIndex | None = None,
) -> ScheduleBatch:
    """A new EXTEND batch over the gaps of ``gap_rows`` (``batch`` is left untouched).

    Request ``k`` extends positions ``[L_k - g_k, L_k)`` with the logged input tokens
    (``tokens``, concatenated in request order) into the KV slots the target wrote
    there. No logprobs, no spec input, no CUDA-graph eligibility flags. ``index``:
    ``gap_rows`` on the device, when the caller has it already.
    """
    n = len(gap_rows)
    device = batch.seq_lens.device
    index = index if index is not None else GapIndex.of(gap_rows, device)
    prefix = [L - g for L, g in zip(gap_rows.committed_lens, gap_rows.gaps)]

    ext = copy.copy(batch)  # shares pools and requests; every field below is rebound
    ext.forward_mode = ForwardMode.EXTEND
    ext.reqs = [batch.reqs[r] for r in gap_rows.rows]
    ext.req_pool_indices = index.pool_indices.to(batch.req_pool_indices.dtype)
    ext.input_ids = tokens
    ext.out_cache_loc = req_to_token[index.slots, index.positions].to(torch.int64)
    ext.seq_lens_cpu = torch.tensor(gap_rows.committed_lens, dtype=torch.int64)
    ext.seq_lens = index.committed_lens.to(batch.seq_lens.dtype)
    ext.seq_lens_sum = int(sum(gap_rows.committed_lens))
    ext.prefix_lens = prefix
    ext.extend_lens = list(gap_rows.gaps)
    ext.extend_num_tokens = gap_rows.num_tokens
    ext.extend_logprob_start_lens = list(gap_rows.gaps)
    ext.extend_input_logprob_token_ids = None
    ext.return_logprob = False
    ext.top_logprobs_nums = None
    ext.token_ids_logprobs = None
    ext.multimodal_inputs = [None] * n
    ext.input_embeds = None
    ext.spec_info = None
    ext.decoding_reqs = None
    ext.chunked_req = None
    ext.has_grammar = False
    ext.is_extend_in_batch = True
    ext.sampling_info = slice_sampling_info(batch.sampling_info, index.rows)
    # Fields some SGLang versions lack (compat.OPTIONAL_BATCH_FIELDS).
    compat.set_optional_batch_fields(
        ext,
        req_pool_indices_cpu=torch.tensor(gap_rows.pool_indices, dtype=torch.int64),
        orig_seq_lens=ext.seq_lens.to(torch.int32),
        chunked_req_next_prompt_token=None,
        can_run_decode_cuda_graph=False,
    )
    return ext


_SAMPLING_ROW_FIELDS = ("temperatures", "top_ps", "top_ks", "min_ps", "sampling_seed")


def slice_sampling_info(sampling_info, rows: torch.Tensor):
    """A shallow copy of ``sampling_info`` keeping ``rows`` of its per-request tensors.

    Only what the draft's proposal step reads (temperatures and seeds, under
    rejection sampling) has to be right; penalties, biases and grammar masks apply
    to the target's sampling, which the catch-up does not run.
    """
    if sampling_info is None:
        return None
    sliced = copy.copy(sampling_info)
    for name in _SAMPLING_ROW_FIELDS:
        value = getattr(sampling_info, name, None)
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            setattr(sliced, name, value[rows])
    sliced.grammars = None
    return sliced


_DRAFT_STATE_FIELDS = ("topk_p", "topk_index", "hidden_states", "draft_probs")


def with_draft_state_rows(draft_input, rows: torch.Tensor, fresh) -> None:
    """Point ``draft_input``'s draft state at new tensors whose ``rows`` come from ``fresh``.

    Out of place: the old tensors may be rows gathered from the overlap scheduler's
    FutureMap or shared with a previous result. Only ``draft_input``'s attributes
    are rebound (it is this step's object), never a tensor written.
    """
    for name in _DRAFT_STATE_FIELDS:
        old, new = getattr(draft_input, name, None), getattr(fresh, name, None)
        if old is None or new is None:
            continue
        setattr(draft_input, name, old.index_copy(0, rows, new.to(old.dtype)))


# Replayed positions compared per catch-up, at most: each costs one row of the
# draft's logits head (H x draft vocab multiply-adds); a flush of 128 requests x 128
# positions would otherwise add 16,384 rows. Beyond it, evenly spaced positions.
MAX_COMPARED = 1024


class ReplayTally:
    """How often the draft's top-1 proposal matched the target's token in the replays.

    Matches are summed on the device (``add`` never reads a tensor); the compared
    positions are counted on the host (known from the gap lengths). ``read_back`` closes
    the current window: it copies the device sum into pinned memory behind the queued
    work (``HostCopy``) and returns the windows closed earlier whose copies have run,
    so the host never waits for the device. ``busy``: whether a side stream's flush may
    still be adding to the sum (``SideStream.busy``).
    """

    def __init__(self, device, busy: Callable[[], bool] | None = None):
        self._matches = torch.zeros(1, dtype=torch.int64, device=device)
        self._positions = 0
        self._closed: deque[tuple[HostCopy, int, int]] = deque()  # (copy, positions, stamp)
        # True while a flush queued on a side stream may still add to the sum: the window
        # then stays open until the next read_back (closing it would copy a partial sum).
        self._busy = busy or (lambda: False)

    def add(self, agree: torch.Tensor, positions: int) -> None:
        """``agree`` ``[n]`` (bool, device): which compared positions matched;
        ``positions``: how many of them count (the host's number)."""
        self._matches.add_(agree.sum())
        self._positions += positions

    def read_back(self, stamp: int) -> list[tuple[int, int, int]]:
        """``(matches, positions, stamp)`` of each window closed before this call whose
        copy has run, in order; then closes the current window under ``stamp`` (the
        caller's step count)."""
        done = []
        while self._closed and self._closed[0][0].ready():
            copy, positions, closed_at = self._closed.popleft()
            done.append((copy.read()[0], positions, closed_at))
        if self._positions and not self._busy():
            self._closed.append((HostCopy(self._matches), self._positions, stamp))
            self._matches.zero_()  # queued after the copy: the copy reads the sum
            self._positions = 0
        return done


class CatchUp(Protocol):
    """What the worker calls at the edges of every step (``worker.py``).

    Decode steps: ``before_plain_step``, the plain forward, ``after_plain_step``; or
    ``before_speculative_step`` and the speculative step. Prefill and mixed steps:
    ``before_extend_step``. ``enabled``: plain forwards must capture the target's
    auxiliary hidden states (``after_plain_step`` logs them). ``replays``: the
    draft-vs-target tally of the replays, or None when nothing is compared.
    """

    enabled: bool
    nbytes: int  # device memory held
    replays: ReplayTally | None
    forward_tokens: int  # positions one draft forward replays at most (0: no limit)

    def before_plain_step(self, batch: ScheduleBatch) -> None: ...

    def after_plain_step(self, input_ids: torch.Tensor, aux_hidden) -> None: ...

    def before_speculative_step(self, batch: ScheduleBatch) -> None: ...

    def before_extend_step(self, batch: ScheduleBatch) -> None: ...


class NoCatchUp:
    """The catch-up turned off (``--speculative-catch-up-tokens 0``): the draft resumes
    from the state the last speculative step left."""

    enabled = False
    nbytes = 0
    replays = None
    forward_tokens = 0

    def before_plain_step(self, batch: ScheduleBatch) -> None:
        pass

    def after_plain_step(self, input_ids: torch.Tensor, aux_hidden) -> None:
        pass

    def before_speculative_step(self, batch: ScheduleBatch) -> None:
        pass

    def before_extend_step(self, batch: ScheduleBatch) -> None:
        pass


class DraftTop1(Protocol):
    """Reads the draft's top-1 proposals at chosen rows of a pass (``compat.DraftTop1``)."""

    def capture(self, rows: torch.Tensor):
        """A context manager yielding a list: each draft forward inside appends the
        logits head's input at ``rows``."""

    def top1(self, hidden: torch.Tensor) -> torch.Tensor:
        """Target token ids: the draft's argmax at each captured row."""


@dataclass(frozen=True)
class DraftPasses:
    """The two draft passes a catch-up runs, bound to one worker (``compat.draft_passes``).

    ``extend(batch, hidden, tails)`` writes the draft KV of an EXTEND batch and returns
    the draft state of each request's last position (SGLang's prefill pass);
    ``fill_kv(batch, hidden, tails, last_rows, compared_rows)`` writes the draft KV
    only; its proposals are right only at ``compared_rows`` (None: nowhere). ``top1``:
    reads the draft's proposals during either (None: replays are not compared).
    """

    extend: Callable[[ScheduleBatch, torch.Tensor, torch.Tensor], object]
    fill_kv: Callable[[ScheduleBatch, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], None]
    top1: DraftTop1 | None = None


class DraftCatchUp:
    """Keeps the draft model current across plain steps (see the module docstring).

    Built from values: the request-to-token table ``[pool_size, max_context]``, the
    width and dtype of the target's auxiliary hidden states, the two draft passes, and
    ``report``, which gets each catch-up with a device timer. With ``passes.top1`` each
    catch-up also compares the draft's proposals with the target's tokens (``replays``).
    ``flush_tokens``: positions one buffer-full flush replays at most
    (``PlainGapLog.due_for_flush``; 0: every gap of the batch at once).
    ``forward_tokens``: positions one draft forward of any catch-up replays at most
    (whole gaps, ``GapRows.chunks``; 0: no limit): SGLang's largest prefill forward,
    the activations its memory plan allows for, where a flush of every gap of a large
    batch (requests x ``capacity``) would not be bounded. ``side``: a
    stream for buffer-full flushes (``SGLANG_DYNSPEC_FLUSH_STREAM``), so that the plain
    steps after one run beside it instead of behind it; every other draft forward (a
    resume, a mixed catch-up, the pass after a prefill, a speculative step) waits for it
    first, on the device (``SideStream.join``). None: flushes run in order.
    """

    enabled = True

    def __init__(
        self,
        req_to_token: torch.Tensor,
        capacity: int,
        hidden_width: int,
        hidden_dtype: torch.dtype,
        passes: DraftPasses,
        report: CatchUpReport,
        flush_tokens: int = 0,
        side: SideStream | None = None,
        forward_tokens: int = 0,
    ):
        self.req_to_token = req_to_token
        self.flush_tokens = flush_tokens
        self.forward_tokens = forward_tokens
        self.device = req_to_token.device
        self.passes = passes
        self.report = report
        self.side = side
        busy = side.busy if side is not None else None
        self.replays = ReplayTally(self.device, busy) if passes.top1 is not None else None
        pool_size = int(req_to_token.shape[0])
        self.log = PlainGapLog(
            pool_size=pool_size,
            capacity=capacity,
            hidden_width=hidden_width,
            hidden_dtype=hidden_dtype,
            device=self.device,
            slack=flush_slack(capacity, flush_tokens, pool_size),
        )
        # The plain step between before_plain_step and after_plain_step: its request slots.
        self._step: list[int] | None = None

    @property
    def nbytes(self) -> int:
        return self.log.nbytes

    def before_plain_step(self, batch: ScheduleBatch) -> None:
        """Flush the gaps that are due (``PlainGapLog.due_for_flush``: all of them once
        one log is full, or, with ``flush_tokens``, the largest in pieces of that many
        positions, early enough that none overflows); note where new gaps start."""
        slots = compat.request_pool_indices(batch.reqs)
        due = self.log.due_for_flush(slots, self.flush_tokens)
        if due:
            self._catch_up_decode_batch(batch, slots, CatchUpReason.BUFFER_FULL, only=set(due))
        # The pending token of each request sits at position seq_lens (fresh_batch).
        self.log.start_gaps(slots, batch.seq_lens)
        self._step = slots

    def after_plain_step(self, input_ids: torch.Tensor, aux_hidden) -> None:
        """Log the positions the plain step just decoded: ``input_ids`` ``[bs]`` its input
        tokens, ``aux_hidden`` ``[bs, 3H]`` the target's auxiliary hidden states."""
        if self._step is None:
            raise RuntimeError("after_plain_step without before_plain_step")
        slots, self._step = self._step, None
        if aux_hidden is None:
            raise RuntimeError(
                "the plain decode step returned no hidden states; the draft catch-up needs "
                "the target's auxiliary hidden states (FULL capture)"
            )
        self.log.record(slots, input_ids, aux_hidden)

    def before_speculative_step(self, batch: ScheduleBatch) -> None:
        """Resume: replay the gaps and hand the speculative step fresh draft state."""
        self._join()
        slots = compat.request_pool_indices(batch.reqs)
        if any(self.log.gap[i] for i in slots):
            self._catch_up_decode_batch(batch, slots, CatchUpReason.RESUME)

    def before_extend_step(self, batch: ScheduleBatch) -> None:
        """Prefill or mixed step: catch the decoding requests of a mixed batch up (their
        one-token tails are drafted by the prefill pass, which needs the positions
        before them). The other requests are being prefilled: their slots' logs, left
        by an earlier owner of the slot or an earlier life of a retracted request, are
        dropped."""
        self._join()  # SGLang's draft pass follows this step's target forward
        decoding = {id(req) for req in (getattr(batch, "decoding_reqs", None) or ())}
        rows = [r for r, req in enumerate(batch.reqs) if id(req) in decoding]
        slots = compat.request_pool_indices(batch.reqs)
        if rows and batch.input_ids is not None:
            starts = list(itertools.accumulate(batch.extend_lens, initial=0))
            gap_rows = self.log.gap_rows([slots[r] for r in rows], [batch.prefix_lens[r] for r in rows])
            if len(gap_rows):
                batch_rows = [rows[k] for k in gap_rows.rows]
                gap_rows = GapRows(batch_rows, gap_rows.pool_indices, gap_rows.gaps, gap_rows.committed_lens)
                for part in gap_rows.chunks(self.forward_tokens):
                    tail_at = to_device([starts[r] for r in part.rows], torch.int64, batch.input_ids.device)
                    self._catch_up(batch, part, batch.input_ids[tail_at], CatchUpReason.MIXED)
        # Every other log of the batch is dropped: a slot being prefilled, or a decoding
        # request whose gap could not be replayed here (no input ids); its tail is
        # drafted by this step, so later plain positions would not continue the gap.
        self.log.forget(slots)

    def _catch_up_decode_batch(
        self, batch: ScheduleBatch, slots: list[int], reason: CatchUpReason, only: set[int] | None = None
    ) -> None:
        gap_rows = self.log.gap_rows(slots, only=only)
        if not len(gap_rows):
            return
        draft_input = batch.spec_info
        pending = compat.pending_tokens(draft_input)
        for part in gap_rows.chunks(self.forward_tokens):
            rows = to_device(part.rows, torch.int64, batch.seq_lens.device)
            fresh = self._catch_up(batch, part, pending[rows], reason)
            if reason is CatchUpReason.RESUME:
                with_draft_state_rows(draft_input, rows, fresh)

    def _catch_up(self, batch: ScheduleBatch, gap_rows: GapRows, tails: torch.Tensor, reason: CatchUpReason):
        """Replay ``gap_rows``' gaps into the draft; return the draft's fresh state
        (proposals from each request's last position), or None for a buffer-full
        flush: the plain step that follows starts a new gap, and the catch-up at
        resume produces the state the draft needs, so that flush only writes KV
        (``compat.fill_draft_kv``, one batched rotation instead of SGLang's
        per-request loop, no sampling, the draft's last MLP only at the compared
        rows). Either pass is also compared with the target's tokens when
        ``replays`` is on (module docstring)."""
        flush = reason is CatchUpReason.BUFFER_FULL
        side = self.side if flush else None
        timer = None if side is not None else DeviceTimer.start(self.device)
        # The log's rows are gathered on the current stream: the next plain step writes
        # over them (``forget`` below) while a side stream's flush may still be running.
        index = GapIndex.of(gap_rows, self.device)
        hidden, tokens = self.log.gather(gap_rows, index)
        ext = build_catch_up_batch(batch, gap_rows, tokens, self.req_to_token, index)
        compared = self._compared_rows(gap_rows)
        last_rows = index.last if flush or compared else None
        queued = side.queue(ext, index, hidden, tokens, tails, compared) if side else contextlib.nullcontext()
        # Named in a profiler's trace (GPU annotation), so a profile shows each catch-up's span
        # and kernels (benchmarks/profiles/summarize_trace.py); nearly free without one.
        with queued, torch.profiler.record_function(f"dynspec_catch_up[{reason.value}]"):
            timer = timer or DeviceTimer.start(self.device)
            with contextlib.ExitStack() as stack:
                seen = stack.enter_context(self.passes.top1.capture(compared[0])) if compared else None
                if flush:
                    self.passes.fill_kv(ext, hidden, tails, last_rows, compared[0] if compared else None)
                    fresh = None
                else:
                    fresh = self.passes.extend(ext, hidden, tails)
            if seen:
                self._compare(tokens, tails, last_rows, compared, seen[-1])
            timer.stop()
        self.log.forget(gap_rows.pool_indices)
        self.report(reason, len(gap_rows), gap_rows.num_tokens, timer)
        return fresh

    def _join(self) -> None:
        if self.side is not None:
            self.side.join()

    def _compared_rows(self, gap_rows: GapRows) -> tuple[torch.Tensor, int] | None:
        """``(rows, positions)``: the replayed rows whose proposal is compared
        (every ``stride``-th, from 0, so that at most ``MAX_COMPARED`` are) and how many
        of them count (each request's last row has no known answer); None if none."""
        if self.replays is None:
            return None
        total = gap_rows.num_tokens
        stride = max(1, -(-total // MAX_COMPARED))
        rows = torch.arange(0, total, stride, dtype=torch.int64, device=self.device)
        positions = rows.numel() - sum(1 for p in gap_rows.last_positions() if p % stride == 0)
        return (rows, positions) if positions > 0 else None

    def _compare(self, tokens, tails, last_rows, compared, hidden) -> None:
        """Tally the draft's top-1 at the compared rows against the target's tokens:
        the proposal at replayed row ``j`` is for the token that is the rotated
        input at ``j + 1`` (module docstring); rows that are a request's last are left
        out."""
        rows, positions = compared
        rotated = tokens.roll(-1, 0)
        rotated[last_rows] = tails.to(tokens.dtype)
        last = rows.new_zeros(tokens.numel(), dtype=torch.bool).index_fill_(0, last_rows, True)
        answers = rotated[(rows + 1).clamp_(max=tokens.numel() - 1)]
        proposals = self.passes.top1.top1(hidden)
        self.replays.add((proposals.to(answers.dtype) == answers) & ~last[rows], positions)


def new_catch_up(
    spec_worker,
    capacity: int,
    report: CatchUpReport,
    compare: bool = False,
    flush_tokens: int = 0,
    eager_draft_tokens: int = 0,
    flush_stream: bool = False,
) -> CatchUp:
    """The catch-up of ``spec_worker`` with ``capacity`` positions per request (0: none);
    ``compare``: tally the draft's proposals against the target's tokens (``replays``;
    left off for a draft model whose logits head ``compat.draft_top1`` cannot read);
    ``flush_tokens``: positions one buffer-full flush replays at most (0: no limit);
    every catch-up forward replays at most SGLang's largest prefill forward
    (``compat.prefill_forward_tokens``);
    ``eager_draft_tokens``: flushes of at least this many positions run outside SGLang's
    draft prefill graph (``compat.draft_graph_off_from``; 0: never); ``flush_stream``:
    buffer-full flushes on a side stream (``DraftCatchUp``), every one of them eager (a
    graph captured on the scheduler's stream is not replayed on another)."""
    if not capacity:
        return NoCatchUp()
    device = compat.request_to_token_table(spec_worker).device
    return DraftCatchUp(
        req_to_token=compat.request_to_token_table(spec_worker),
        capacity=capacity,
        hidden_width=compat.target_hidden_width(spec_worker),
        hidden_dtype=compat.target_hidden_dtype(spec_worker),
        passes=DraftPasses(
            *compat.draft_passes(spec_worker, 1 if flush_stream else eager_draft_tokens),
            compat.draft_top1(spec_worker) if compare else None,
        ),
        report=report,
        flush_tokens=flush_tokens,
        side=SideStream(device) if flush_stream else None,
        forward_tokens=compat.prefill_forward_tokens(spec_worker),
    )
