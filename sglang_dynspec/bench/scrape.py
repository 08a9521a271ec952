"""Scraping the server's Prometheus ``/metrics`` endpoint.

SGLang exposes ``/metrics`` when launched with ``--enable-metrics``.  The
EAGLE3_DYNAMIC plugin adds, from the scheduler process (names from
``sglang_dynspec.metric_names``):

* ``sglang:spec_dynamic_mode`` (gauge): 1 = speculating, 0 = plain decode;
* ``sglang:spec_dynamic_decode_steps_total{mode="spec"|"plain"}`` (counter);
* ``sglang:spec_dynamic_switches_total{to="spec"|"plain"}`` (counter);
* ``sglang:spec_dynamic_catch_up_total{reason=...}``,
  ``sglang:spec_dynamic_catch_up_tokens_total`` and the histogram
  ``sglang:spec_dynamic_catch_up_seconds`` (draft catch-ups);
* ``sglang:spec_dynamic_resume_accepted_tokens_total`` and
  ``sglang:spec_dynamic_resume_requests_total`` (the first speculative step after
  each resume);

and SGLang itself exports ``sglang:num_running_reqs`` (gauge).

SGLang attaches extra labels (``model_name``, ``tp_rank``, ``pp_rank``,
``engine_type`` ...), so one logical metric may appear as several series.
Counters and ``num_running_reqs`` are *summed* over those labels (keeping
``mode``/``to``).  Counter sums over several TP ranks are a multiple of the
per-rank count, which is harmless because the tool only looks at increments.
The mode gauge is *not* summed (two TP ranks speculating would read 2): all
ranks switch together, so the tool takes the maximum and additionally reports
``mode_consistent=False`` if the series disagree.

Samples are matched by their sample name (``..._total``), not by family name,
because ``prometheus_client``'s parser strips ``_total`` from counter family
names while some exporters do not.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from sglang_dynspec.metric_names import (
    ACCEPTANCE_GAUGE,
    CATCH_UP_COUNTER,
    CATCH_UP_SECONDS,
    CATCH_UP_TOKENS_COUNTER,
    MODE_GAUGE,
    PENALTY_PLAIN_COUNTER,
    PLAIN_GRAPH_COUNTER,
    PROBE_STEPS_COUNTER,
    RESUME_ACCEPTED_COUNTER,
    RESUME_REQUESTS_COUNTER,
    STEP_SECONDS_GAUGE,
    STEPS_COUNTER,
    SWITCHES_COUNTER,
    total,
)

MODE = MODE_GAUGE
STEPS = total(STEPS_COUNTER)
SWITCHES = total(SWITCHES_COUNTER)
PLAIN_GRAPH = total(PLAIN_GRAPH_COUNTER)
RUNNING = "sglang:num_running_reqs"  # SGLang's own gauge
CATCH_UPS = total(CATCH_UP_COUNTER)
CATCH_UP_TOKENS = total(CATCH_UP_TOKENS_COUNTER)
CATCH_UP_SECONDS_SUM = CATCH_UP_SECONDS + "_sum"
CATCH_UP_SECONDS_COUNT = CATCH_UP_SECONDS + "_count"
RESUME_ACCEPTED = total(RESUME_ACCEPTED_COUNTER)
RESUME_REQUESTS = total(RESUME_REQUESTS_COUNTER)
PROBE_STEPS = total(PROBE_STEPS_COUNTER)
PENALTY_PLAIN_STEPS = total(PENALTY_PLAIN_COUNTER)
_SUMMED = {
    PROBE_STEPS: "probe_steps",
    PENALTY_PLAIN_STEPS: "penalty_plain_steps",
    CATCH_UP_TOKENS: "catch_up_tokens",
    CATCH_UP_SECONDS_SUM: "catch_up_seconds_sum",
    CATCH_UP_SECONDS_COUNT: "catch_up_timed",
    RESUME_ACCEPTED: "resume_accepted_tokens",
    RESUME_REQUESTS: "resume_requests",
}


@dataclass
class MetricsSnapshot:
    """The metrics the benchmark cares about; ``None`` = not exported."""

    mode: int | None = None
    mode_consistent: bool = True
    steps_spec: float | None = None
    steps_plain: float | None = None
    switches_to_plain: float | None = None
    switches_to_spec: float | None = None
    plain_graph_steps: float | None = None
    num_running_reqs: float | None = None
    catch_ups: dict[str, float] | None = None  # by reason
    catch_up_tokens: float | None = None
    catch_up_seconds_sum: float | None = None
    catch_up_timed: float | None = None  # catch-ups whose device time is in the sum
    resume_accepted_tokens: float | None = None
    resume_requests: float | None = None
    probe_steps: float | None = None  # goodput: decode steps run only to measure a mode
    penalty_plain_steps: float | None = None  # plain for per-token penalties, not by the policy
    acceptance: float | None = None  # the goodput policy's estimate
    acceptance_source: str | None = None
    # The goodput policy's step-time table: {(mode, batch_max): seconds}.
    step_costs: list[dict] | None = None  # the start-up cost table (STEP_SECONDS_GAUGE rows)

    @property
    def has_plugin_metrics(self) -> bool:
        return self.mode is not None or self.steps_spec is not None

    @property
    def resume_accept_length(self) -> float | None:
        """Mean accepted tokens per request on the first speculative step after a resume."""
        if not self.resume_requests:
            return None
        return self.resume_accepted_tokens / self.resume_requests

    def as_dict(self) -> dict[str, object]:
        return {
            "mode": self.mode,
            "steps_spec": self.steps_spec,
            "steps_plain": self.steps_plain,
            "switches_to_plain": self.switches_to_plain,
            "switches_to_spec": self.switches_to_spec,
            "plain_graph_steps": self.plain_graph_steps,
            "num_running_reqs": self.num_running_reqs,
            "catch_ups": self.catch_ups,
            "catch_up_tokens": self.catch_up_tokens,
            "catch_up_seconds_sum": self.catch_up_seconds_sum,
            "catch_up_timed": self.catch_up_timed,
            "resume_accepted_tokens": self.resume_accepted_tokens,
            "resume_requests": self.resume_requests,
        }


def _add(d: dict[str, float], key: str, v: float) -> None:
    d[key] = d.get(key, 0.0) + v


def parse_metrics(text: str) -> MetricsSnapshot:
    """Extract a :class:`MetricsSnapshot` from Prometheus text exposition.

    Raises ``ValueError`` if the text is not parseable Prometheus format.
    """
    steps: dict[str, float] = {}
    switches: dict[str, float] = {}
    modes = []
    running: float | None = None
    plain_graph = 0.0
    catch_ups: dict[str, float] = {}
    summed: dict[str, float] = {}
    acceptance: tuple[float, str | None] | None = None
    step_costs: list[dict] = []
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == MODE:
                modes.append(s.value)
            elif s.name == STEPS:
                _add(steps, s.labels.get("mode", ""), s.value)
            elif s.name == SWITCHES:
                _add(switches, s.labels.get("to", ""), s.value)
            elif s.name == PLAIN_GRAPH:
                plain_graph += s.value
            elif s.name == RUNNING:
                running = (running or 0.0) + s.value
            elif s.name == CATCH_UPS:
                _add(catch_ups, s.labels.get("reason", ""), s.value)
            elif s.name in _SUMMED:
                _add(summed, _SUMMED[s.name], s.value)
            elif s.name == ACCEPTANCE_GAUGE and s.value == s.value:  # NaN: no estimate from this source
                acceptance = (s.value, s.labels.get("source"))
            elif s.name == STEP_SECONDS_GAUGE and s.value == s.value:
                step_costs.append(
                    {
                        "mode": s.labels.get("mode", ""),
                        "batch_size": int(s.labels.get("batch_size", "0")),
                        "context_len": int(s.labels.get("context_len", "0")),
                        "seconds": s.value,
                    }
                )
    snap = MetricsSnapshot(num_running_reqs=running)
    if acceptance is not None:
        snap.acceptance, snap.acceptance_source = acceptance
    if step_costs:
        snap.step_costs = step_costs
    if modes:
        snap.mode = int(max(modes) > 0.5)
        snap.mode_consistent = len({int(m > 0.5) for m in modes}) == 1
    if modes or steps or switches:
        # The plugin is there.  A counter (or label value) with no sample has
        # simply not been incremented yet: prometheus_client only exports
        # label sets that were touched, so read it as 0.
        snap.steps_spec = steps.get("spec", 0.0)
        snap.steps_plain = steps.get("plain", 0.0)
        snap.switches_to_plain = switches.get("plain", 0.0)
        snap.switches_to_spec = switches.get("spec", 0.0)
        snap.plain_graph_steps = plain_graph
        snap.catch_ups = catch_ups
        for field in _SUMMED.values():
            setattr(snap, field, summed.get(field, 0.0))
    return snap


async def fetch_metrics(session, base_url: str, timeout_s: float = 5.0) -> MetricsSnapshot | None:
    """GET ``{base_url}/metrics`` and parse it.

    Returns ``None`` if the endpoint does not exist (server started without
    ``--enable-metrics``); network errors propagate to the caller.
    """
    async with session.get(base_url + "/metrics", timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
        if resp.status == 404:
            return None
        resp.raise_for_status()
        text = await resp.text()
    return parse_metrics(text)


class MetricsPoller:
    """Polls ``/metrics`` at a fixed period and keeps the samples.

    Each sample is stamped with the midpoint of the HTTP round trip on the
    ``time.perf_counter`` clock, the same clock the load generator uses for
    token arrivals, so the two timelines can be aligned exactly.
    """

    def __init__(self, session, base_url: str, period_s: float, on_sample=None):
        self.session = session
        self.base_url = base_url
        self.period_s = period_s
        self.on_sample = on_sample
        self.samples: list[tuple[float, MetricsSnapshot | None]] = []
        self.errors = 0
        self.last_error: str | None = None
        #: True once a scrape succeeded, False if the first one found no
        #: ``/metrics`` (404) or failed, None before the first scrape.
        self.available: bool | None = None

    async def poll_once(self) -> None:
        t0 = time.perf_counter()
        snap: MetricsSnapshot | None
        try:
            snap = await fetch_metrics(self.session, self.base_url)
        except (asyncio.TimeoutError, aiohttp.ClientError, ValueError) as e:
            # A scrape can time out or fail under heavy load; keep polling,
            # the timeline just gets a sample with no values.
            snap = None
            self.errors += 1
            self.last_error = repr(e)
        t = (t0 + time.perf_counter()) / 2
        if snap is not None:
            self.available = True
        elif self.available is None:
            self.available = False
        self.samples.append((t, snap))
        if self.on_sample is not None:
            self.on_sample(t, snap)

    async def run(self, stop) -> None:
        """Poll until the ``asyncio.Event`` ``stop`` is set, then poll once
        more so the last switch is bracketed."""
        next_t = time.perf_counter()
        while not stop.is_set():
            await self.poll_once()
            next_t += self.period_s
            delay = next_t - time.perf_counter()
            if delay < 0:  # scrape slower than the period: don't burst
                next_t = time.perf_counter()
                delay = 0
            try:
                await asyncio.wait_for(stop.wait(), timeout=delay)
            except asyncio.TimeoutError:
                pass
        await self.poll_once()
