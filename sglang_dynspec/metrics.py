"""The plugin's own view of its modes: Prometheus metrics and switch logs.

SGLang's accept-length metrics count a plain step as a verify step that accepted no
draft, so they cannot tell the modes apart. These can. They are exported from the
scheduler process with ``prometheus_client``, the way SGLang exports its scheduler
metrics: with ``--enable-metrics`` SGLang sets ``PROMETHEUS_MULTIPROC_DIR`` before
the scheduler starts, and its HTTP server's ``/metrics`` aggregates every process.

Useful queries:

    fraction of decode steps run plain:
      rate(sglang:spec_dynamic_decode_steps_total{mode="plain"}[1m])
        / ignoring(mode) sum without(mode) (rate(sglang:spec_dynamic_decode_steps_total[1m]))
    switches per minute:
      sum(rate(sglang:spec_dynamic_switches_total[1m])) * 60
    mean accepted tokens per request on the first speculative step after a resume
    (compare with sglang:spec_accept_length, SGLang's steady-state figure):
      rate(sglang:spec_dynamic_resume_accepted_tokens_total[5m])
        / rate(sglang:spec_dynamic_resume_requests_total[5m])
    draft catch-up time per replayed position:
      rate(sglang:spec_dynamic_catch_up_seconds_sum[5m])
        / rate(sglang:spec_dynamic_catch_up_tokens_total[5m])
"""

from __future__ import annotations

import logging
from typing import Optional

from sglang_dynspec.policy import Mode, Switch

logger = logging.getLogger("sglang_dynspec")

MODE_GAUGE = "sglang:spec_dynamic_mode"
STEPS_COUNTER = "sglang:spec_dynamic_decode_steps"  # exported with a _total suffix
SWITCHES_COUNTER = "sglang:spec_dynamic_switches"  # exported with a _total suffix
PLAIN_GRAPH_COUNTER = "sglang:spec_dynamic_plain_graph_steps"  # exported with a _total suffix
CATCH_UP_COUNTER = "sglang:spec_dynamic_catch_up"  # _total, by reason
CATCH_UP_TOKENS_COUNTER = "sglang:spec_dynamic_catch_up_tokens"  # _total
CATCH_UP_SECONDS = "sglang:spec_dynamic_catch_up_seconds"  # histogram
RESUME_ACCEPTED_COUNTER = "sglang:spec_dynamic_resume_accepted_tokens"  # _total
RESUME_REQUESTS_COUNTER = "sglang:spec_dynamic_resume_requests"  # _total
CATCH_UP_REASONS = ("resume", "buffer_full", "mixed")
_CATCH_UP_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)


class ModeMetrics:
    """Per-step accounting. ``export`` is False on all but the first TP rank (every
    rank takes the same decisions, so one copy is enough), and without
    ``--enable-metrics``."""

    def __init__(self, export: bool, labels: Optional[dict] = None, log_switches: bool = True):
        self.log_switches = log_switches
        self._gauge = self._steps = self._switches = self._graph_steps = None
        self._catch_ups = self._catch_up_tokens = self._catch_up_seconds = None
        self._resume_accepted = self._resume_requests = None
        # Device work whose result is read once it has completed (no sync):
        # (reason, requests, tokens, timer) of catch-ups, (accept_lens, marker) of
        # first steps after a resume.
        self._pending_catch_ups: list = []
        self._pending_resume_steps: list = []
        if not export:
            return
        # Imported here: prometheus_client must be imported after SGLang has set
        # PROMETHEUS_MULTIPROC_DIR in this process (SGLang does the same).
        from prometheus_client import Counter, Gauge, Histogram

        labels = dict(labels or {})
        names = list(labels)
        self._gauge = Gauge(
            MODE_GAUGE,
            "1 while EAGLE3_DYNAMIC speculates, 0 while it runs plain decode steps.",
            labelnames=names,
            multiprocess_mode="mostrecent",
        ).labels(**labels)
        steps = Counter(
            STEPS_COUNTER,
            "Decode steps run by EAGLE3_DYNAMIC, by mode (spec or plain).",
            labelnames=names + ["mode"],
        )
        self._steps = {m: steps.labels(**labels, mode=m.value) for m in Mode}
        switches = Counter(
            SWITCHES_COUNTER,
            "Mode switches of EAGLE3_DYNAMIC, by the mode switched to.",
            labelnames=names + ["to"],
        )
        self._switches = {m: switches.labels(**labels, to=m.value) for m in Mode}
        self._graph_steps = Counter(
            PLAIN_GRAPH_COUNTER,
            "Plain decode steps of EAGLE3_DYNAMIC that replayed its plain DECODE CUDA graph "
            "(the rest ran eagerly: no graph captured, or a batch above its largest size).",
            labelnames=names,
        ).labels(**labels)
        catch_ups = Counter(
            CATCH_UP_COUNTER,
            "Draft catch-ups of EAGLE3_DYNAMIC (one batched draft extend over the positions "
            "decoded plain), by reason: resume, buffer_full (in plain mode), mixed.",
            labelnames=names + ["reason"],
        )
        self._catch_ups = {r: catch_ups.labels(**labels, reason=r) for r in CATCH_UP_REASONS}
        self._catch_up_tokens = Counter(
            CATCH_UP_TOKENS_COUNTER,
            "Positions replayed into the draft model by EAGLE3_DYNAMIC catch-ups.",
            labelnames=names,
        ).labels(**labels)
        self._catch_up_seconds = Histogram(
            CATCH_UP_SECONDS,
            "Device time of one EAGLE3_DYNAMIC draft catch-up.",
            labelnames=names,
            buckets=_CATCH_UP_BUCKETS,
        ).labels(**labels)
        self._resume_accepted = Counter(
            RESUME_ACCEPTED_COUNTER,
            "Tokens accepted (bonus included) on the first speculative step after each "
            "resume of EAGLE3_DYNAMIC, summed over its requests.",
            labelnames=names,
        ).labels(**labels)
        self._resume_requests = Counter(
            RESUME_REQUESTS_COUNTER,
            "Requests in the first speculative step after each resume of EAGLE3_DYNAMIC.",
            labelnames=names,
        ).labels(**labels)
        self._gauge.set(1)

    def on_catch_up(self, reason: str, requests: int, tokens: int, timer) -> None:
        """A catch-up was queued; its time is read once the device has run it."""
        if self._catch_ups is not None:
            self._catch_ups[reason].inc()
            self._catch_up_tokens.inc(tokens)
        self._pending_catch_ups.append((reason, requests, tokens, timer))

    def watch_first_step_after_resume(self, accept_lens, marker) -> None:
        """Record the accept lengths of the first speculative step after a resume once
        ``marker`` (queued after that step) has completed."""
        self._pending_resume_steps.append((accept_lens, marker))

    def poll(self) -> None:
        """Account for queued device work that has completed since the last step."""
        still = []
        for reason, requests, tokens, timer in self._pending_catch_ups:
            seconds = timer.seconds()
            if seconds is None:
                still.append((reason, requests, tokens, timer))
                continue
            if self._catch_up_seconds is not None:
                self._catch_up_seconds.observe(seconds)
            if self.log_switches:
                logger.log(
                    logging.DEBUG if reason == "buffer_full" else logging.INFO,
                    "[sglang-dynspec] draft catch-up (%s): %d positions of %d requests in %.2f ms",
                    reason, tokens, requests, seconds * 1e3,
                )
        self._pending_catch_ups = still
        still = []
        for accept_lens, marker in self._pending_resume_steps:
            if marker.seconds() is None:
                still.append((accept_lens, marker))
                continue
            lens = [int(x) for x in accept_lens.tolist()]
            if self._resume_accepted is not None:
                self._resume_accepted.inc(sum(lens))
                self._resume_requests.inc(len(lens))
            if self.log_switches and lens:
                logger.info(
                    "[sglang-dynspec] first speculative step after resume: %.2f tokens accepted "
                    "per request (%d requests)", sum(lens) / len(lens), len(lens),
                )
        self._pending_resume_steps = still

    def on_step(self, mode: Mode, switch: Optional[Switch], steps: dict,
                replayed_graph: bool = False) -> None:
        if switch is not None:
            if self.log_switches:
                # ``steps`` already counts this step, which runs in the new mode.
                logger.info(
                    "[sglang-dynspec] %s -> %s at decode batch size %d (decode step %d; "
                    "steps before it: spec %d, plain %d)",
                    switch.old.value, switch.new.value, switch.batch_size, switch.step,
                    steps[Mode.SPEC] - (mode is Mode.SPEC), steps[Mode.PLAIN] - (mode is Mode.PLAIN),
                )
            if self._switches is not None:
                self._switches[switch.new].inc()
                self._gauge.set(1 if switch.new is Mode.SPEC else 0)
        if self._steps is not None:
            self._steps[mode].inc()
            if replayed_graph:
                self._graph_steps.inc()
