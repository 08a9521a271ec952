"""The mode controller: the policy, the step telemetry and resume tracking.

The worker calls it twice per decode step: :meth:`ModeController.before_decode`
returns the mode of the step, :meth:`ModeController.after_decode` accounts for it.
The draft catch-up reports its work through :meth:`ModeController.on_catch_up`, and
its draft-vs-target tally is read back (``set_replay_source``) just before each step
at which the estimate feed agrees its inputs. Device times and accept lengths are
read by polling (``device_timer``), never by waiting, at the start of the next
decode step.

Every input of the decision is identical on every TP rank (the policy's contract);
telemetry only observes it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

from sglang_dynspec.config import Settings, build_policy
from sglang_dynspec.cost_model import StepCostTable
from sglang_dynspec.device_timer import DeferredReadings, DeviceTimer, read_later
from sglang_dynspec.estimates import AcceptCounters, EstimateFeed
from sglang_dynspec.metric_names import CatchUpReason
from sglang_dynspec.policy import Mode, ModePolicy, Switch
from sglang_dynspec.telemetry import StepStats, TelemetrySink

# Reads back the catch-up's draft-vs-target tally (``catch_up.ReplayTally.read_back``):
# given the feed's step count, closes the current window under it and returns
# (matches, positions, step it was closed at) of earlier windows whose copies have run.
ReplaySource = Callable[[int], Iterable[tuple[int, int, int]]]


def build_sinks(*, first_rank: bool, metrics_enabled: bool, labels: Mapping[str, str]) -> list[TelemetrySink]:
    """The telemetry layers of one worker: the one place that decides what is on.

    Every rank takes the same decisions, so only the first TP rank logs and exports;
    the Prometheus export also needs SGLang's ``--enable-metrics``.
    """
    if not first_rank:
        return []
    from sglang_dynspec.mode_log import ModeLog

    sinks: list[TelemetrySink] = [ModeLog()]
    if metrics_enabled:
        from sglang_dynspec.prometheus_export import PrometheusExport

        sinks.append(PrometheusExport(labels))
    return sinks


class ModeController:
    """Decides each decode step's mode and reports what happened to the sinks."""

    def __init__(
        self,
        policy: ModePolicy,
        sinks: Sequence[TelemetrySink] = (),
        feed: EstimateFeed | None = None,
        exact_penalties: bool = True,
        device: str = "cpu",
        catch_up_capacity: int = 0,
        start_timer: Callable[[], DeviceTimer] | None = None,
    ):
        self.policy = policy
        self.exact_penalties = exact_penalties
        self.stats = StepStats()
        self._sinks = (self.stats, *sinks)
        self._readings = DeferredReadings()
        # Times each decode step's forward on the device (tests inject a fake clock's).
        self._start_timer = start_timer or (lambda: DeviceTimer.start(device))
        self._catch_up_capacity = catch_up_capacity
        self._after_plain = False  # the next speculative step is the first after a resume
        self._plain_run = 0  # plain decode steps since the last speculative one
        self._step: tuple[Mode, int, float, DeviceTimer] | None = None  # the decode step in flight
        self._caught_up = False  # a catch-up ran inside the decode step in flight
        # The goodput policy's inputs (estimates.py); None for policies that need none.
        self._feed = feed if policy.needs_estimates else None
        if policy.needs_estimates and feed is None:
            raise ValueError(f"{type(policy).__name__} needs an EstimateFeed")
        self._replays: ReplaySource | None = None

    @property
    def simulated_acceptance(self) -> float | None:
        """The acceptance the policy takes from ``SGLANG_SIMULATE_ACC_LEN``, clamped as
        SGLang's verify clamps it; None when not simulated or not read."""
        return None if self._feed is None else self._feed.simulated_acceptance

    @classmethod
    def from_settings(
        cls,
        settings: Settings,
        *,
        first_rank: bool,
        metrics_enabled: bool,
        labels: Mapping[str, str],
        agree: Callable[[dict], dict],
        draft_steps: int = 3,
        max_acceptance: float = 4.0,
        device: str = "cpu",
    ) -> ModeController:
        """The controller the settings ask for: its policy, estimate feed and sinks.

        ``agree``: hands every TP rank the first rank's value of a dict (a collective
        every rank calls at the same decode step). ``draft_steps`` and ``max_acceptance``:
        the speculative configuration (``--speculative-num-steps``,
        ``--speculative-num-draft-tokens``)."""
        policy = build_policy(settings, max_acceptance=max_acceptance)
        simulated = settings.simulated_acceptance
        if simulated is not None:  # SGLang's verify accepts at most the draft tokens
            simulated = min(simulated, max_acceptance)
        feed = (
            EstimateFeed(agree=agree, draft_steps=draft_steps, simulated_acceptance=simulated)
            if policy.needs_estimates
            else None
        )
        sinks = build_sinks(first_rank=first_rank, metrics_enabled=metrics_enabled, labels=labels)
        return cls(
            policy,
            sinks,
            feed,
            exact_penalties=settings.penalties == "exact",
            device=device,
            catch_up_capacity=settings.catch_up_tokens,
        )

    def set_replay_source(self, read_back: ReplaySource) -> None:
        """Where the catch-up's replay comparisons come from (read only by a policy that
        uses estimates)."""
        self._replays = read_back

    def set_cost_table(self, table: StepCostTable) -> None:
        """The start-up step costs (identical on every rank)."""
        if self._feed is not None:
            self._feed.set_table(table)
        for sink in self._sinks:
            sink.on_cost_table(table)

    def before_decode(
        self,
        batch_size: int,
        accept_counters: Callable[[], AcceptCounters] | None = None,
        needs_per_token_penalties: bool = False,
        context_len: float = 0.0,
    ) -> Mode:
        """The mode of the decode step about to run (``batch_size``: its requests;
        ``context_len``: their mean KV length).

        ``accept_counters``: a callable giving each request's host accept counters
        (called only when the policy measures acceptance). ``needs_per_token_penalties``:
        a request of the batch has frequency, presence or repetition penalties
        (``compat.needs_per_token_penalties``); with ``--speculative-penalties exact`` the
        step runs plain without consulting the policy, whose mode and dwell stay as
        they were, so its decision applies again once no such request is left."""
        self._readings.poll()
        if self._feed is not None:
            if self._replays is not None and self._feed.agrees_next():
                # Rank-local values: they reach the policy through the agreement below.
                for matches, positions, measured_at in self._replays(self._feed.steps):
                    self._feed.on_replay(matches, positions, measured_at)
            estimates = self._feed.before_decode(batch_size, context_len, accept_counters)
            if estimates is not None:
                self.policy.update(estimates)
                for sink in self._sinks:
                    sink.on_estimates(estimates, batch_size, context_len)
                    sink.on_realized(self._feed.realized)
        if self.exact_penalties and needs_per_token_penalties:
            for sink in self._sinks:
                sink.on_penalty_plain_step()
            mode = Mode.PLAIN
        else:
            old = self.policy.mode
            catch_up_tokens = batch_size * min(self._plain_run, self._catch_up_capacity)
            mode = self.policy.decide(batch_size, context_len=context_len, catch_up_tokens=catch_up_tokens)
            if mode is not old:
                switch = Switch(self.stats.total_decode_steps, batch_size, old, mode, self.policy.last_reason)
                steps_before = dict(self.stats.decode_steps)
                for sink in self._sinks:
                    sink.on_switch(switch, steps_before)
            if mode is Mode.SPEC and needs_per_token_penalties:
                for sink in self._sinks:
                    sink.on_relaxed_penalty_step()
        if self._feed is not None:
            self._feed.after_decision(mode, batch_size, context_len)
            self._step = (mode, batch_size, context_len, self._start_timer())
            self._caught_up = False
        return mode

    def on_other_step(self) -> None:
        """A prefill, mixed or idle step ran between decode steps."""
        if self._feed is not None:
            self._feed.on_other_step()

    def after_decode(self, mode: Mode, accept_lens=None, replayed_graph: bool = False) -> None:
        """Account for a decode step just queued; ``accept_lens`` ``[bs]`` (device
        tensor) of a speculative step is read, without a sync, when it is the first
        after a resume."""
        if self._step is not None:
            step_mode, size, context, timer = self._step
            self._step = None
            timer.stop()
            feed = self._feed
            if self._caught_up:  # a catch-up's time is its own (on_catch_up)
                feed.on_catch_up_step()
            else:
                self._readings.add(
                    timer, lambda seconds: feed.on_step_device_time(step_mode, size, context, seconds)
                )
        for sink in self._sinks:
            sink.on_decode_step(mode, replayed_graph)
        if mode is Mode.PLAIN:
            self._after_plain = True
            self._plain_run += 1
        else:
            self._plain_run = 0
            if self._after_plain:
                self._after_plain = False
                if accept_lens is not None:
                    read_later(accept_lens, self._readings, self._report_resume_step)

    def on_catch_up(self, reason: CatchUpReason, requests: int, tokens: int, timer: DeviceTimer) -> None:
        """A draft catch-up was queued; its time is reported once the device has run it."""
        reason = CatchUpReason(reason).value  # the label the sinks count it under
        self._caught_up = True
        for sink in self._sinks:
            sink.on_catch_up_queued(reason, requests, tokens)
        feed = self._feed

        def done(seconds: float) -> None:
            if feed is not None:
                feed.on_catch_up_time(tokens, seconds)
            for sink in self._sinks:
                sink.on_catch_up_done(reason, requests, tokens, seconds)

        self._readings.add(timer, done)

    def on_replay(self, matches: int, positions: int) -> None:
        """A catch-up's draft agreed with the target's tokens at ``matches`` of ``positions``."""
        if self._feed is not None:
            self._feed.on_replay(matches, positions)

    def _report_resume_step(self, accept_lens: list) -> None:
        lens = [int(x) for x in accept_lens]
        for sink in self._sinks:
            sink.on_resume_step(lens)
