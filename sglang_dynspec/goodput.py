"""The goodput policy: speculate exactly when it yields more tokens per second.

Pure Python (no torch, no SGLang). Per decode step, with ``B`` the decode batch size:

    predicted tokens/s, speculative:  B * acceptance / t_spec(B)
    predicted tokens/s, plain:        B / t_plain(B)
    R = acceptance * t_plain(B) / t_spec(B)

``acceptance`` is the expected tokens per request per speculative step (accepted drafts
plus the bonus token); ``t_mode(B)`` the measured wall time of one decode step in that
mode at batch sizes of ``B``'s bucket. Speculating, the policy turns plain when
``R < 1 - margin``; plain, it speculates again when ``R > 1 + margin``; never sooner
than ``min_dwell_steps`` after the last switch. Where one mode has not been measured
at ``B``'s bucket yet, the policy *probes* it: it switches (dwell allowing) and stays
``min_dwell_steps`` steps, once per bucket and mode every ``reprobe_every`` decode steps.
Re-probing is also how a plain phase notices that acceptance has risen: acceptance is
only measured while speculating.

Every input reaches the policy through :class:`Estimates`, which the controller builds
at fixed decode-step counts from values every tensor-parallel rank agrees on (the
accept counters the scheduler keeps on the host, and rank 0's step times broadcast to
all ranks); between two agreements the policy sees the same snapshot on every rank.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import dataclass, field

from sglang_dynspec.policy import Mode, ModePolicy

# Upper edges of the batch-size buckets: about 1.5x apart, so a bucket's step time
# varies little inside it (the step time grows about linearly with B).
BUCKET_EDGES = (1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)


def bucket_of(batch_size: int) -> int:
    """Index of the bucket holding ``batch_size`` (sizes above the last edge share the last)."""
    return min(bisect.bisect_left(BUCKET_EDGES, batch_size), len(BUCKET_EDGES) - 1)


@dataclass(frozen=True)
class GoodputSettings:
    margin: float = 0.05  # hysteresis on R around 1
    min_dwell_steps: int = 8  # also the length of a probe
    reprobe_every: int = 4096  # decode steps between two probes of one bucket and mode
    max_spec_batch: int | None = None  # hard bound: never speculate above it (None: no bound)

    def __post_init__(self) -> None:
        if not 0 <= self.margin < 1:
            raise ValueError(f"margin must be in [0, 1), got {self.margin}")
        if self.min_dwell_steps < 1 or self.reprobe_every < 1:
            raise ValueError(f"min_dwell_steps and reprobe_every must be >= 1, got {self}")
        if self.max_spec_batch is not None and self.max_spec_batch < 1:
            raise ValueError(f"max_spec_batch must be >= 1, got {self.max_spec_batch}")


@dataclass(frozen=True)
class Estimates:
    """The agreed inputs of the goodput policy (identical on every TP rank)."""

    acceptance: float | None = None  # tokens per request per speculative step, bonus included
    acceptance_source: str = "none"  # "measured", "simulated" (SGLANG_SIMULATE_ACC_LEN) or "none"
    step_seconds: Mapping[tuple[Mode, int], float] = field(default_factory=dict)  # (mode, bucket) -> s

    def ratio(self, batch_size: int) -> float | None:
        """R = predicted speculative / plain tokens per second at ``batch_size``, or None."""
        b = bucket_of(batch_size)
        t_spec, t_plain = self.step_seconds.get((Mode.SPEC, b)), self.step_seconds.get((Mode.PLAIN, b))
        if self.acceptance is None or not t_spec or not t_plain:
            return None
        return self.acceptance * t_plain / t_spec

    def predicted_tokens_per_second(self, batch_size: int, mode: Mode) -> float | None:
        seconds = self.step_seconds.get((mode, bucket_of(batch_size)))
        if not seconds:
            return None
        per_request = 1.0 if mode is Mode.PLAIN else self.acceptance
        return None if per_request is None else batch_size * per_request / seconds


class GoodputPolicy(ModePolicy):
    """See the module docstring. ``update`` feeds it agreed estimates; ``decide`` is
    called once per decode step."""

    needs_estimates = True

    def __init__(self, settings: GoodputSettings):
        self.settings = settings
        self.mode = Mode.SPEC
        self.estimates = Estimates()
        self.last_reason = "start"
        self._step = 0
        self._since_switch = settings.min_dwell_steps
        self._visited: dict[tuple[Mode, int], int] = {}  # (mode, bucket) -> last step run there

    def update(self, estimates: Estimates) -> None:
        self.estimates = estimates

    def _wanted(self, batch_size: int) -> tuple[Mode, str]:
        s, est = self.settings, self.estimates
        if s.max_spec_batch is not None and batch_size > s.max_spec_batch:
            return Mode.PLAIN, f"batch {batch_size} above the speculation bound {s.max_spec_batch}"
        b = bucket_of(batch_size)
        other = Mode.PLAIN if self.mode is Mode.SPEC else Mode.SPEC

        def measured(mode: Mode) -> bool:
            return (mode, b) in est.step_seconds and (mode is Mode.PLAIN or est.acceptance is not None)

        if not measured(self.mode):
            return self.mode, f"measuring {self.mode.value} at batch {batch_size}"
        last_visit = self._visited.get((other, b))
        if not measured(other):
            if last_visit is None or self._step - last_visit >= s.reprobe_every:
                return other, f"probe {other.value} at batch {batch_size}"
            return self.mode, f"waiting for the {other.value} probe at batch {batch_size}"
        if last_visit is not None and self._step - last_visit >= s.reprobe_every:
            return other, f"re-probe {other.value} at batch {batch_size}"
        ratio = est.ratio(batch_size)
        if self.mode is Mode.SPEC and ratio < 1 - s.margin:
            return Mode.PLAIN, f"R = {ratio:.2f} < {1 - s.margin:.2f} at batch {batch_size}"
        if self.mode is Mode.PLAIN and ratio > 1 + s.margin:
            return Mode.SPEC, f"R = {ratio:.2f} > {1 + s.margin:.2f} at batch {batch_size}"
        return self.mode, f"R = {ratio:.2f}"

    def decide(self, batch_size: int) -> Mode:
        if batch_size < 0:
            raise ValueError(f"batch_size must be >= 0, got {batch_size}")
        wanted, reason = self._wanted(batch_size)
        if wanted is not self.mode and self._since_switch >= self.settings.min_dwell_steps:
            self.mode = wanted
            self._since_switch = 0
            self.last_reason = reason
            self.probing = "probe" in reason
        elif reason.startswith("R = "):
            self.probing = False  # the measurements now say this mode pays
        self._visited[(self.mode, bucket_of(batch_size))] = self._step
        self._since_switch += 1
        self._step += 1
        return self.mode

    def describe(self) -> str:
        s = self.settings
        bound = "" if s.max_spec_batch is None else f", never above {s.max_spec_batch} running requests"
        return (
            f"goodput policy: speculate while predicted tokens/s beat plain decode by {s.margin:.0%} "
            f"(measured acceptance and step times{bound}), at least {s.min_dwell_steps} decode steps "
            "between switches"
        )


@dataclass
class StepTimes:
    """Rank-local step-time measurements: an exponential moving average per (mode, bucket)."""

    alpha: float = 0.1
    seconds: dict[tuple[Mode, int], float] = field(default_factory=dict)

    def record(self, mode: Mode, batch_size: int, seconds: float) -> None:
        key = (mode, bucket_of(batch_size))
        old = self.seconds.get(key)
        self.seconds[key] = seconds if old is None else old + self.alpha * (seconds - old)


@dataclass
class AcceptanceMeter:
    """Tokens per request per speculative step, bonus included, as a moving average.

    Fed with the scheduler's per-request host counters (``spec_num_correct_drafts``
    and ``spec_verify_ct``, identical on every TP rank): their increase over a stretch
    of speculative steps.
    """

    alpha: float = 0.2
    value: float | None = None

    def observe(self, correct_drafts: int, verify_steps: int) -> None:
        if verify_steps <= 0:
            return
        sample = 1.0 + correct_drafts / verify_steps
        self.value = sample if self.value is None else self.value + self.alpha * (sample - self.value)
