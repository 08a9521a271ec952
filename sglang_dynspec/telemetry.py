"""What the controller reports, and the pure statistics layer.

The controller reports each event once to a list of sinks (:class:`TelemetrySink`).
Three layers implement it, each in its own module:

* :class:`StepStats` (here): pure counters, always on; the controller reads the
  steps before a switch from it, and tests read it directly;
* ``mode_log.ModeLog``: the log lines (first TP rank only);
* ``prometheus_export.PrometheusExport``: ``/metrics`` (first TP rank, with
  ``--enable-metrics``).

Which sinks a worker gets is decided in one place, ``controller.build_sinks``.
Pure Python: no torch, no SGLang, no prometheus_client.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from sglang_dynspec.metric_names import CATCH_UP_REASONS
from sglang_dynspec.policy import Mode, Switch


class TelemetrySink:
    """Receives the controller's events; every method is a no-op unless overridden."""

    def on_decode_step(self, mode: Mode, replayed_graph: bool) -> None:
        """A decode step ran in ``mode`` (``replayed_graph``: the plain graph replayed)."""

    def on_switch(self, switch: Switch, steps_before: Mapping[Mode, int]) -> None:
        """The step about to run is the first in ``switch.new``; ``steps_before``
        counts the decode steps of each mode before it."""

    def on_catch_up_queued(self, reason: str, requests: int, tokens: int) -> None:
        """A draft catch-up was queued on the device."""

    def on_catch_up_done(self, reason: str, requests: int, tokens: int, seconds: float) -> None:
        """A queued catch-up completed on the device, in ``seconds`` of device time."""

    def on_resume_step(self, accept_lens: Sequence[int]) -> None:
        """Accepted tokens (bonus included) per request of the first speculative step
        after a resume, read once the device has run it."""

    def on_estimates(self, estimates, batch_size: int, context_len: float) -> None:
        """The goodput policy got new agreed estimates (``goodput.Estimates``) at a decode
        step of ``batch_size`` requests of mean context ``context_len``."""

    def on_realized(self, tokens_per_second: Mapping[Mode, float | None]) -> None:
        """Output tokens/s measured in each mode over the goodput policy's last agreement
        window (``estimates.EstimateFeed.realized``; None: not measured yet)."""

    def on_cost_table(self, table) -> None:
        """The step costs timed at start-up (``cost_model.StepCostTable``)."""

    def on_penalty_plain_step(self) -> None:
        """The decode step about to run is plain because a request needs per-token
        penalties (``--speculative-penalties exact``), not by the policy."""

    def on_relaxed_penalty_step(self) -> None:
        """The decode step about to run speculates although a request needs per-token
        penalties (``--speculative-penalties relaxed``): it gets EAGLE-3's per-step ones."""

    def on_probe_step(self, mode: Mode) -> None:
        """The decode step just run was part of a probe (the policy measuring ``mode``)."""


@dataclass
class StepStats(TelemetrySink):
    """Counts of everything the controller reported, per mode and reason."""

    decode_steps: dict[Mode, int] = field(default_factory=lambda: dict.fromkeys(Mode, 0))
    switches: dict[Mode, int] = field(default_factory=lambda: dict.fromkeys(Mode, 0))  # by mode switched to
    plain_graph_steps: int = 0
    catch_ups: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATCH_UP_REASONS, 0))
    catch_up_tokens: int = 0
    catch_ups_timed: int = 0
    catch_up_seconds: float = 0.0
    resume_steps: int = 0
    resume_requests: int = 0
    resume_accepted_tokens: int = 0
    probe_steps: dict[Mode, int] = field(default_factory=lambda: dict.fromkeys(Mode, 0))
    penalty_plain_steps: int = 0  # plain because a request needs per-token penalties
    relaxed_penalty_steps: int = 0  # speculative with such a request (per-step penalties)

    @property
    def total_decode_steps(self) -> int:
        return sum(self.decode_steps.values())

    def on_decode_step(self, mode: Mode, replayed_graph: bool) -> None:
        self.decode_steps[mode] += 1
        self.plain_graph_steps += bool(replayed_graph)

    def on_switch(self, switch: Switch, steps_before: Mapping[Mode, int]) -> None:
        self.switches[switch.new] += 1

    def on_penalty_plain_step(self) -> None:
        self.penalty_plain_steps += 1

    def on_relaxed_penalty_step(self) -> None:
        self.relaxed_penalty_steps += 1

    def on_probe_step(self, mode: Mode) -> None:
        self.probe_steps[mode] += 1

    def on_catch_up_queued(self, reason: str, requests: int, tokens: int) -> None:
        self.catch_ups[reason] += 1
        self.catch_up_tokens += tokens

    def on_catch_up_done(self, reason: str, requests: int, tokens: int, seconds: float) -> None:
        self.catch_ups_timed += 1
        self.catch_up_seconds += seconds

    def on_resume_step(self, accept_lens: Sequence[int]) -> None:
        self.resume_steps += 1
        self.resume_requests += len(accept_lens)
        self.resume_accepted_tokens += sum(accept_lens)
