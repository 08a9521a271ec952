"""Prometheus export of the plugin's modes, from the scheduler process.

SGLang's accept-length metrics count a plain step as a verify step that accepted no
draft, so they cannot tell the modes apart. These can. They are exported with
``prometheus_client``, the way SGLang exports its scheduler metrics: with
``--enable-metrics`` SGLang sets ``PROMETHEUS_MULTIPROC_DIR`` before the scheduler
starts, and its HTTP server's ``/metrics`` aggregates every process. Names and help
texts live in ``metric_names``.

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

from collections.abc import Mapping, Sequence

from sglang_dynspec import metric_names as names
from sglang_dynspec.cost_model import BUCKET_EDGES
from sglang_dynspec.policy import Mode, Switch
from sglang_dynspec.telemetry import TelemetrySink

_CATCH_UP_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)


class PrometheusExport(TelemetrySink):
    """The plugin's series, labelled with ``labels`` (e.g. ``model_name``)."""

    def __init__(self, labels: Mapping[str, str], registry=None):
        """``registry``: where the series are registered (default: the process-wide one
        SGLang's ``/metrics`` collects; tests pass their own)."""
        # Imported here: prometheus_client must be imported after SGLang has set
        # PROMETHEUS_MULTIPROC_DIR in this process (SGLang does the same).
        from prometheus_client import REGISTRY, Counter, Gauge, Histogram

        registry = REGISTRY if registry is None else registry

        labels = dict(labels)
        keys = list(labels)

        def counter(name, extra=None):
            return Counter(
                name, names.HELP[name], labelnames=keys + ([extra] if extra else []), registry=registry
            )

        self._mode = Gauge(
            names.MODE_GAUGE,
            names.HELP[names.MODE_GAUGE],
            labelnames=keys,
            multiprocess_mode="mostrecent",
            registry=registry,
        ).labels(**labels)
        steps = counter(names.STEPS_COUNTER, "mode")
        self._steps = {m: steps.labels(**labels, mode=m.value) for m in Mode}
        switches = counter(names.SWITCHES_COUNTER, "to")
        self._switches = {m: switches.labels(**labels, to=m.value) for m in Mode}
        self._graph_steps = counter(names.PLAIN_GRAPH_COUNTER).labels(**labels)
        catch_ups = counter(names.CATCH_UP_COUNTER, "reason")
        self._catch_ups = {r: catch_ups.labels(**labels, reason=r) for r in names.CATCH_UP_REASONS}
        self._catch_up_tokens = counter(names.CATCH_UP_TOKENS_COUNTER).labels(**labels)
        self._catch_up_seconds = Histogram(
            names.CATCH_UP_SECONDS,
            names.HELP[names.CATCH_UP_SECONDS],
            labelnames=keys,
            buckets=_CATCH_UP_BUCKETS,
            registry=registry,
        ).labels(**labels)
        self._resume_accepted = counter(names.RESUME_ACCEPTED_COUNTER).labels(**labels)
        self._resume_requests = counter(names.RESUME_REQUESTS_COUNTER).labels(**labels)
        self._labels = labels

        def gauge(name, extra):
            return Gauge(
                name,
                names.HELP[name],
                labelnames=keys + extra,
                multiprocess_mode="mostrecent",
                registry=registry,
            )

        self._penalty_plain_steps = counter(names.PENALTY_PLAIN_COUNTER).labels(**labels)
        self._relaxed_penalty_steps = counter(names.RELAXED_PENALTY_COUNTER).labels(**labels)
        probes = counter(names.PROBE_STEPS_COUNTER, "mode")
        self._probe_steps = {m: probes.labels(**labels, mode=m.value) for m in Mode}
        self._acceptance = gauge(names.ACCEPTANCE_GAUGE, ["source"])
        self._predicted = gauge(names.PREDICTED_GAUGE, ["mode"])
        self._realized = gauge(names.REALIZED_GAUGE, ["mode"])
        self._step_seconds = gauge(names.STEP_SECONDS_GAUGE, ["mode", "batch_size", "context_len"])
        self._corrections = gauge(names.STEP_COST_CORRECTION_GAUGE, ["mode", "kind", "batch_max"])
        self._mode.set(1)

    def on_decode_step(self, mode: Mode, replayed_graph: bool) -> None:
        self._steps[mode].inc()
        self._mode.set(1 if mode is Mode.SPEC else 0)  # forced-plain steps included
        if replayed_graph:
            self._graph_steps.inc()

    def on_switch(self, switch: Switch, steps_before: Mapping[Mode, int]) -> None:
        self._switches[switch.new].inc()
        self._mode.set(1 if switch.new is Mode.SPEC else 0)

    def on_catch_up_queued(self, reason: str, requests: int, tokens: int) -> None:
        self._catch_ups[reason].inc()
        self._catch_up_tokens.inc(tokens)

    def on_catch_up_done(self, reason: str, requests: int, tokens: int, seconds: float) -> None:
        self._catch_up_seconds.observe(seconds)

    def on_resume_step(self, accept_lens: Sequence[int]) -> None:
        self._resume_accepted.inc(sum(accept_lens))
        self._resume_requests.inc(len(accept_lens))

    def on_penalty_plain_step(self) -> None:
        self._penalty_plain_steps.inc()

    def on_relaxed_penalty_step(self) -> None:
        self._relaxed_penalty_steps.inc()

    def on_probe_step(self, mode: Mode) -> None:
        self._probe_steps[mode].inc()

    def on_estimates(self, estimates, batch_size: int, context_len: float) -> None:
        for source in names.ACCEPTANCE_SOURCES:
            value = estimates.acceptance if source == estimates.acceptance_source else None
            self._acceptance.labels(**self._labels, source=source).set(
                float("nan") if value is None else value
            )
        for mode in Mode:
            predicted = estimates.predicted_tokens_per_second(batch_size, context_len, mode)
            self._predicted.labels(**self._labels, mode=mode.value).set(
                float("nan") if predicted is None else predicted
            )
        if estimates.costs is not None:
            for (kind, mode, bucket), ratio in estimates.costs.ratios().items():
                self._corrections.labels(
                    **self._labels, mode=mode.value, kind=kind, batch_max=str(BUCKET_EDGES[bucket])
                ).set(ratio)

    def on_realized(self, tokens_per_second: Mapping[Mode, float | None]) -> None:
        for mode in Mode:
            rate = tokens_per_second.get(mode)
            self._realized.labels(**self._labels, mode=mode.value).set(float("nan") if rate is None else rate)

    def on_cost_table(self, table) -> None:
        for p in table.points:
            self._step_seconds.labels(
                **self._labels,
                mode=p.mode.value,
                batch_size=str(p.batch_size),
                context_len=str(p.context_len),
            ).set(p.seconds)
