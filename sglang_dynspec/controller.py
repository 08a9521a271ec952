"""The mode controller: the policy, the step telemetry and resume tracking.

The worker calls it twice per decode step: :meth:`ModeController.before_decode`
returns the mode of the step, :meth:`ModeController.after_decode` accounts for it.
The draft catch-up reports its work through :meth:`ModeController.on_catch_up`.
Device times and accept lengths are read by polling (``device_timer``), never by
waiting, at the start of the next decode step.

Every input of the decision is identical on every TP rank (the policy's contract);
telemetry only observes it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from sglang_dynspec.device_timer import DeferredReadings, DeviceTimer, read_later
from sglang_dynspec.estimates import AcceptCounters, EstimateFeed
from sglang_dynspec.policy import Mode, ModePolicy, Switch
from sglang_dynspec.telemetry import StepStats, TelemetrySink


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
        self, policy: ModePolicy, sinks: Sequence[TelemetrySink] = (), feed: EstimateFeed | None = None
    ):
        self.policy = policy
        self.stats = StepStats()
        self._sinks = (self.stats, *sinks)
        self._readings = DeferredReadings()
        self._after_plain = False  # the next speculative step is the first after a resume
        # The goodput policy's inputs (estimates.py); None for policies that need none.
        self._feed = feed if policy.needs_estimates else None
        if policy.needs_estimates and feed is None:
            raise ValueError(f"{type(policy).__name__} needs an EstimateFeed")

    def before_decode(
        self,
        batch_size: int,
        accept_counters: Callable[[], AcceptCounters] | None = None,
        plain_required: bool = False,
    ) -> Mode:
        """The mode of the decode step about to run (``batch_size``: its requests).

        ``accept_counters``: a callable giving each request's host accept counters
        (called only when the policy measures acceptance). ``plain_required``: a
        request of the batch must decode plain (``compat.needs_per_token_penalties``);
        the step runs plain without consulting the policy, whose mode and dwell stay as
        they were, so its decision applies again once no such request is left."""
        self._readings.poll()
        if self._feed is not None:
            estimates = self._feed.before_decode(batch_size, accept_counters)
            if estimates is not None:
                self.policy.update(estimates)
                for sink in self._sinks:
                    sink.on_estimates(estimates, batch_size)
        if plain_required:
            for sink in self._sinks:
                sink.on_penalty_plain_step()
            if self._feed is not None:
                self._feed.after_decision(Mode.PLAIN, batch_size)
            return Mode.PLAIN
        old = self.policy.mode
        mode = self.policy.decide(batch_size)
        if mode is not old:
            switch = Switch(self.stats.total_decode_steps, batch_size, old, mode, self.policy.last_reason)
            steps_before = dict(self.stats.decode_steps)
            for sink in self._sinks:
                sink.on_switch(switch, steps_before)
        if self._feed is not None:
            self._feed.after_decision(mode, batch_size)
        return mode

    def on_other_step(self) -> None:
        """A prefill, mixed or idle step ran between decode steps."""
        if self._feed is not None:
            self._feed.on_other_step()

    def after_decode(self, mode: Mode, accept_lens=None, replayed_graph: bool = False) -> None:
        """Account for a decode step just queued; ``accept_lens`` ``[bs]`` (device
        tensor) of a speculative step is read, without a sync, when it is the first
        after a resume."""
        for sink in self._sinks:
            sink.on_decode_step(mode, replayed_graph)
        if self.policy.probing:
            for sink in self._sinks:
                sink.on_probe_step(mode)
        if mode is Mode.PLAIN:
            self._after_plain = True
        elif self._after_plain:
            self._after_plain = False
            if accept_lens is not None:
                read_later(accept_lens, self._readings, self._report_resume_step)

    def on_catch_up(self, reason: str, requests: int, tokens: int, timer: DeviceTimer) -> None:
        """A draft catch-up was queued; its time is reported once the device has run it."""
        for sink in self._sinks:
            sink.on_catch_up_queued(reason, requests, tokens)

        def done(seconds: float) -> None:
            for sink in self._sinks:
                sink.on_catch_up_done(reason, requests, tokens, seconds)

        self._readings.add(timer, done)

    def _report_resume_step(self, accept_lens: list) -> None:
        lens = [int(x) for x in accept_lens]
        for sink in self._sinks:
            sink.on_resume_step(lens)
