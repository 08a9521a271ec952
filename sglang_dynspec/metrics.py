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


class ModeMetrics:
    """Per-step accounting. ``export`` is False on all but the first TP rank (every
    rank takes the same decisions, so one copy is enough), and without
    ``--enable-metrics``."""

    def __init__(self, export: bool, labels: Optional[dict] = None, log_switches: bool = True):
        self.log_switches = log_switches
        self._gauge = self._steps = self._switches = self._graph_steps = None
        if not export:
            return
        # Imported here: prometheus_client must be imported after SGLang has set
        # PROMETHEUS_MULTIPROC_DIR in this process (SGLang does the same).
        from prometheus_client import Counter, Gauge

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
        self._gauge.set(1)

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
