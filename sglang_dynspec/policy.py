"""When to speculate: the policy interface and the threshold policy.

Pure Python on purpose (no torch, no SGLang) so it can be tested exhaustively and
so every tensor-parallel rank, fed the same replicated inputs, takes the same
decision. A policy's inputs must be identical on every TP rank (the decode batch
size is); it never reads clocks, memory or anything rank-local, because a rank that
decided differently would deadlock the next collective.

``ThresholdPolicy`` is a hysteresis switch on the running decode batch size.
Rules, evaluated once per decode step, before the step runs:

* speculating, ``batch_size > disable_above`` and the dwell allows -> plain decode;
* plain decode, ``batch_size <= enable_at_or_below`` and the dwell allows -> speculate;
* otherwise the mode is kept. Between the two thresholds this is hysteresis: a
  batch that hovers around one threshold does not flap.

"The dwell allows" means at least ``min_dwell_steps`` decode steps have run since
the last switch. Upstream engines switch on a memoryless per-step lookup and flap
when one prefill pushes the count across the line (vLLM #49548); the two
thresholds plus the dwell are what this module adds.
"""

from __future__ import annotations

import abc
import enum
from dataclasses import dataclass


class Mode(str, enum.Enum):
    """How one decode step runs."""

    SPEC = "spec"  # EAGLE-3: draft, verify, draft-extend
    PLAIN = "plain"  # one target decode on a fresh non-speculative batch


@dataclass(frozen=True)
class Switch:
    """A mode change, reported once, at the step where it takes effect."""

    step: int  # decode step index (0-based) that runs in the new mode
    batch_size: int
    old: Mode
    new: Mode
    reason: str = ""  # the policy's words for why


class ModePolicy(abc.ABC):
    """Decides the mode of each decode step.

    The controller calls :meth:`decide` exactly once per decode step, before it runs.
    Prefill and mixed steps do not count: they take SGLang's own path in either mode.
    A policy starts in ``Mode.SPEC``.
    """

    mode: Mode = Mode.SPEC
    last_reason: str = ""  # why the last switch happened (for the switch log)
    needs_estimates: bool = False  # True: feed it ``update(estimates)`` (goodput.Estimates)
    probing: bool = False  # the current mode was entered to measure it, not because it pays

    def update(self, estimates) -> None:  # noqa: B027 (a no-op on purpose: most policies need none)
        """New agreed estimates (only policies with ``needs_estimates`` use them)."""

    @abc.abstractmethod
    def decide(self, batch_size: int, context_len: float = 0.0, catch_up_tokens: int = 0) -> Mode:
        """Return the mode of this decode step (and remember it as ``self.mode``).

        ``batch_size``: the step's requests; ``context_len``: their mean KV length;
        ``catch_up_tokens``: positions a resume would replay into the draft now."""

    @abc.abstractmethod
    def describe(self) -> str:
        """One line for the start-up log: what the policy does with its settings."""


@dataclass(frozen=True)
class SwitchThresholds:
    """The threshold policy's three knobs, already validated (see ``config``)."""

    disable_above: int  # N: plain while the decode batch exceeds N
    enable_at_or_below: int  # M < N: speculate again at or below M
    min_dwell_steps: int  # K: fewest decode steps between two switches

    def __post_init__(self) -> None:
        if self.disable_above < 0 or self.enable_at_or_below < 0 or self.min_dwell_steps < 0:
            raise ValueError(f"thresholds must be non-negative, got {self}")
        if self.enable_at_or_below >= self.disable_above:
            raise ValueError(
                f"enable_at_or_below ({self.enable_at_or_below}) must be below "
                f"disable_above ({self.disable_above})"
            )


class ThresholdPolicy(ModePolicy):
    """Hysteresis on the decode batch size with a minimum dwell (module docstring)."""

    def __init__(self, thresholds: SwitchThresholds, initial: Mode = Mode.SPEC):
        self.thresholds = thresholds
        self.mode = initial
        # Steps since the last switch. Starts "long ago" so the very first decode
        # step may already switch: the dwell protects against flapping, and there
        # is nothing to flap from yet.
        self._since_switch = thresholds.min_dwell_steps

    def wanted_mode(self, batch_size: int) -> Mode:
        """The mode the thresholds ask for, ignoring the dwell."""
        t = self.thresholds
        if self.mode is Mode.SPEC and batch_size > t.disable_above:
            return Mode.PLAIN
        if self.mode is Mode.PLAIN and batch_size <= t.enable_at_or_below:
            return Mode.SPEC
        return self.mode

    def decide(self, batch_size: int, context_len: float = 0.0, catch_up_tokens: int = 0) -> Mode:
        if batch_size < 0:
            raise ValueError(f"batch_size must be >= 0, got {batch_size}")
        wanted = self.wanted_mode(batch_size)
        if wanted is not self.mode and self._since_switch >= self.thresholds.min_dwell_steps:
            t = self.thresholds
            self.last_reason = (
                f"batch {batch_size} > {t.disable_above}"
                if wanted is Mode.PLAIN
                else f"batch {batch_size} <= {t.enable_at_or_below}"
            )
            self.mode = wanted
            self._since_switch = 0
        self._since_switch += 1
        return self.mode

    def describe(self) -> str:
        t = self.thresholds
        return (
            f"plain decode above {t.disable_above} running requests, EAGLE-3 again at or "
            f"below {t.enable_at_or_below}, at least {t.min_dwell_steps} decode steps between switches"
        )
