"""The goodput policy (the default): speculate exactly when it yields more tokens per second.

Pure Python (no torch, no SGLang). Per decode step, with ``B`` requests of mean context
``c``, ``a`` the expected tokens per request per speculative step (accepted drafts plus
the bonus token) and ``t_mode(B, c)`` the cost model's step time (``cost_model``):

    predicted tokens/s, speculative:  B * a / t_spec(B, c)
    predicted tokens/s, plain:        B / t_plain(B, c)
    R = a * t_plain(B, c) / t_spec(B, c)

* speculating, it turns plain when ``R < 1 - margin``, at once: going plain costs
  nothing, and a batch that grows from a few requests to many within a few steps (a
  burst of arrivals) must not be held in speculation (on the H200, 8 steps held at
  batch 64 cost their point 4%);
* plain, it speculates again when ``D * a * t_plain > (1 + margin) * (D * t_spec + C)``:
  the first ``D = min_dwell_steps`` speculative steps must also pay for the resume's
  catch-up, ``C`` = the positions to replay times the measured catch-up cost per position;
  never sooner than ``min_dwell_steps`` decode steps after the last switch, so a
  round trip plain -> spec -> plain -> spec takes more than the dwell;
* above ``--speculative-disable-batch-threshold`` (when given) it never speculates.

The margin is 2%: a wrong mode costs at most the margin where the costs are known, and
the dwell, not the margin, keeps it from flapping.

The step costs are known from the first decode step (measured at start-up), so nothing is
probed. Acceptance comes from the scheduler's accept counters while speculating and from
the draft catch-up's replay while plain (``estimates``); until either has spoken, the
policy speculates where the most a step can accept (``max_acceptance``) would pay, which
gives the counters their first measurement within a few steps.

Every input reaches the policy through :class:`Estimates`, built by the controller at
fixed decode-step counts from values every tensor-parallel rank agrees on.
"""

from __future__ import annotations

from dataclasses import dataclass

from sglang_dynspec.cost_model import CostModel
from sglang_dynspec.policy import Mode, ModePolicy


def expected_accept_length(agreement: float, draft_steps: int) -> float:
    """Tokens per request per speculative step of a chain of ``k = draft_steps`` drafts
    (top-k 1) when each draft is the target's token with probability ``p = agreement``.

    The target verifies the chain in order and keeps the drafts up to the first wrong
    one, then adds its own (bonus) token. Draft ``i`` is kept only if drafts ``1..i``
    all agree, which has probability ``p^i`` if each agrees independently with the
    same ``p``. The expected accept length is the bonus token plus the expected
    number of kept drafts:

        E = 1 + p + p^2 + ... + p^k  = (1 - p^(k+1)) / (1 - p)  (k + 1 at p = 1)

    ``p`` is measured by the draft catch-up's replay (``catch_up.ReplayTally``): the
    share of replayed positions where the draft's top-1 proposal, drafted from the
    target's own state, is the token the target decoded. That is the chain's first
    step. Later steps draft from the draft's own state and usually agree less, so
    ``E`` is an upper estimate; ``estimates.EstimateFeed`` scales it by how it compared
    with the accept counters after the last replay. With top-k > 1 (a tree) the
    target can also keep a draft that is not the top-1, so ``E`` is then a lower
    estimate of that part."""
    if not 0.0 <= agreement <= 1.0:
        raise ValueError(f"agreement must be in [0, 1], got {agreement}")
    if draft_steps < 0:
        raise ValueError(f"draft_steps must be >= 0, got {draft_steps}")
    return sum(agreement**i for i in range(draft_steps + 1))


@dataclass(frozen=True)
class GoodputSettings:
    margin: float = 0.02  # hysteresis on R around 1
    min_dwell_steps: int = 8  # fewest decode steps between two switches; D above
    speculation_bound: int | None = None  # hard bound: never speculate above it (None: no bound)
    max_acceptance: float = 4.0  # the most one speculative step can give (num_draft_tokens)

    def __post_init__(self) -> None:
        if not 0 <= self.margin < 1:
            raise ValueError(f"margin must be in [0, 1), got {self.margin}")
        if self.min_dwell_steps < 1:
            raise ValueError(f"min_dwell_steps must be >= 1, got {self.min_dwell_steps}")
        if self.speculation_bound is not None and self.speculation_bound < 1:
            raise ValueError(f"speculation_bound must be >= 1, got {self.speculation_bound}")
        if not self.max_acceptance >= 1:
            raise ValueError(f"max_acceptance must be >= 1, got {self.max_acceptance}")


@dataclass(frozen=True)
class Estimates:
    """The agreed inputs of the goodput policy (identical on every TP rank)."""

    costs: CostModel | None = None
    acceptance: float | None = None  # tokens per request per speculative step, bonus included
    acceptance_source: str = "none"  # one of metric_names.ACCEPTANCE_SOURCES
    catch_up_seconds_per_token: float = 0.0  # device time of a catch-up per replayed position

    def step_seconds(self, mode: Mode, batch_size: int, context_len: float) -> float | None:
        return None if self.costs is None else self.costs.seconds(mode, batch_size, context_len)

    def ratio(self, batch_size: int, context_len: float, acceptance: float | None = None) -> float | None:
        """R = predicted speculative / plain tokens per second, or None if a cost is unknown."""
        a = self.acceptance if acceptance is None else acceptance
        t_spec = self.step_seconds(Mode.SPEC, batch_size, context_len)
        t_plain = self.step_seconds(Mode.PLAIN, batch_size, context_len)
        if a is None or not t_spec or not t_plain:
            return None
        return a * t_plain / t_spec

    def predicted_tokens_per_second(self, batch_size: int, context_len: float, mode: Mode) -> float | None:
        seconds = self.step_seconds(mode, batch_size, context_len)
        per_request = 1.0 if mode is Mode.PLAIN else self.acceptance
        if not seconds or per_request is None:
            return None
        return batch_size * per_request / seconds


def crossover_batch_size(
    estimates: Estimates, acceptance: float, context_len: float, max_batch_size: int, margin: float = 0.0
) -> int | None:
    """The smallest batch size at which plain decode beats speculation (R < 1 - margin)
    at ``acceptance`` and ``context_len``; None if speculation pays up to ``max_batch_size``."""
    for b in range(1, max_batch_size + 1):
        r = estimates.ratio(b, context_len, acceptance)
        if r is not None and r < 1 - margin:
            return b
    return None


class GoodputPolicy(ModePolicy):
    """See the module docstring. ``update`` feeds it agreed estimates; ``decide`` is
    called once per decode step."""

    needs_estimates = True

    def __init__(self, settings: GoodputSettings):
        self.settings = settings
        self.mode = Mode.SPEC
        self.estimates = Estimates()
        self.last_reason = "start"
        self.last_ratio: float | None = None
        self._since_switch = settings.min_dwell_steps

    def update(self, estimates: Estimates) -> None:
        self.estimates = estimates

    def _wanted(self, batch_size: int, context_len: float, catch_up_tokens: int) -> tuple[Mode, str]:
        s, est = self.settings, self.estimates
        if s.speculation_bound is not None and batch_size > s.speculation_bound:
            return Mode.PLAIN, f"batch {batch_size} above the speculation bound {s.speculation_bound}"
        t_spec = est.step_seconds(Mode.SPEC, batch_size, context_len)
        t_plain = est.step_seconds(Mode.PLAIN, batch_size, context_len)
        if not t_spec or not t_plain:
            self.last_ratio = None
            return self.mode, "no step costs"
        known = est.acceptance is not None
        a = est.acceptance if known else s.max_acceptance
        ratio = self.last_ratio = a * t_plain / t_spec
        what = (
            f"R = {ratio:.2f} at batch {batch_size}, context {context_len:.0f}, "
            f"step {t_spec * 1e3:.2f} ms spec / {t_plain * 1e3:.2f} ms plain"
        ) + (
            f" (acceptance {a:.2f}, {est.acceptance_source})"
            if known
            else " (acceptance not measured yet: the most a step can accept)"
        )
        if self.mode is Mode.SPEC:
            return (Mode.PLAIN, what) if ratio < 1 - s.margin else (Mode.SPEC, what)
        dwell = s.min_dwell_steps
        catch_up = catch_up_tokens * est.catch_up_seconds_per_token
        if dwell * a * t_plain > (1 + s.margin) * (dwell * t_spec + catch_up):
            return Mode.SPEC, what
        return Mode.PLAIN, what

    def decide(self, batch_size: int, context_len: float = 0.0, catch_up_tokens: int = 0) -> Mode:
        if batch_size < 0:
            raise ValueError(f"batch_size must be >= 0, got {batch_size}")
        wanted, reason = self._wanted(batch_size, context_len, catch_up_tokens)
        leaving = self.mode is Mode.SPEC  # no dwell before going plain (module docstring)
        if wanted is not self.mode and (leaving or self._since_switch >= self.settings.min_dwell_steps):
            self.mode = wanted
            self._since_switch = 0
            self.last_reason = reason
        self._since_switch += 1
        return self.mode

    def describe(self) -> str:
        s = self.settings
        bound = "" if s.speculation_bound is None else f", never above {s.speculation_bound} running requests"
        return (
            f"goodput policy: speculate while predicted tokens/s beat plain decode by {s.margin:.0%} "
            f"(step costs timed at start-up and corrected online; acceptance from the accept counters "
            f"and the catch-up's replay{bound}), at least {s.min_dwell_steps} decode steps before a resume"
        )
