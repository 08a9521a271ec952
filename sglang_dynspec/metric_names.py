"""Names, help texts and label values of the plugin's Prometheus metrics, defined once.

Pure constants (no prometheus_client, no SGLang): the exporter
(``prometheus_export``), the benchmark's scraper (``bench.scrape``), the test bed's
fake server and the tests all import them from here. Counters are exported with a
``_total`` suffix (``prometheus_client`` adds it); use :func:`total` for the series name.
"""

from __future__ import annotations

import enum

MODE_GAUGE = "sglang:spec_dynamic_mode"
STEPS_COUNTER = "sglang:spec_dynamic_decode_steps"
SWITCHES_COUNTER = "sglang:spec_dynamic_switches"
PLAIN_GRAPH_COUNTER = "sglang:spec_dynamic_plain_graph_steps"
CATCH_UP_COUNTER = "sglang:spec_dynamic_catch_up"
CATCH_UP_TOKENS_COUNTER = "sglang:spec_dynamic_catch_up_tokens"
CATCH_UP_SECONDS = "sglang:spec_dynamic_catch_up_seconds"  # histogram
RESUME_ACCEPTED_COUNTER = "sglang:spec_dynamic_resume_accepted_tokens"
RESUME_REQUESTS_COUNTER = "sglang:spec_dynamic_resume_requests"
# The goodput policy's agreed estimates (gauges, updated at each agreement).
ACCEPTANCE_GAUGE = "sglang:spec_dynamic_acceptance"  # label "source": measured / simulated / none
PREDICTED_GAUGE = "sglang:spec_dynamic_predicted_tokens_per_second"  # label "mode", at the current batch
REALIZED_GAUGE = "sglang:spec_dynamic_realized_tokens_per_second"  # label "mode", last window
# The step costs timed at start-up; labels "mode", "batch_size", "context_len".
STEP_SECONDS_GAUGE = "sglang:spec_dynamic_step_seconds"
# Measured / start-up step time as the decision uses it (weighed against the mode's other
# buckets by its samples), per mode and batch-size bucket; labels "mode", "kind" (device
# or host), "batch_max" (the bucket's upper edge).
STEP_COST_CORRECTION_GAUGE = "sglang:spec_dynamic_step_cost_correction"
PROBE_STEPS_COUNTER = "sglang:spec_dynamic_probe_steps"  # label "mode"
PENALTY_PLAIN_COUNTER = "sglang:spec_dynamic_penalty_plain_steps"
RELAXED_PENALTY_COUNTER = "sglang:spec_dynamic_relaxed_penalty_steps"

# Label values.
MODES = ("spec", "plain")  # label "mode" of STEPS_COUNTER, "to" of SWITCHES_COUNTER


class CatchUpReason(str, enum.Enum):
    """Why a draft catch-up ran (label "reason" of CATCH_UP_COUNTER)."""

    RESUME = "resume"  # before the first speculative step after plain ones
    BUFFER_FULL = "buffer_full"  # in plain mode: a request's log would overflow
    MIXED = "mixed"  # before a mixed prefill+decode step, for its decoding requests


CATCH_UP_REASONS = tuple(reason.value for reason in CatchUpReason)
# Label "source" of ACCEPTANCE_GAUGE: the scheduler's accept counters (speculating), the
# draft catch-up's replay (plain), SGLANG_SIMULATE_ACC_LEN (benchmarks), or none yet.
ACCEPTANCE_SOURCES = ("counters", "replay", "simulated", "none")

HELP = {
    MODE_GAUGE: (
        "1 if EAGLE3_DYNAMIC's last decode step speculated, 0 if it ran plain (by its policy or "
        "because a request needed per-token penalties)."
    ),
    STEPS_COUNTER: "Decode steps run by EAGLE3_DYNAMIC, by mode (spec or plain).",
    SWITCHES_COUNTER: "Mode switches of EAGLE3_DYNAMIC, by the mode switched to.",
    PLAIN_GRAPH_COUNTER: (
        "Plain decode steps of EAGLE3_DYNAMIC that replayed its plain DECODE CUDA graph "
        "(the rest ran eagerly: no graph captured, or a batch above its largest size)."
    ),
    CATCH_UP_COUNTER: (
        "Draft catch-ups of EAGLE3_DYNAMIC (one batched draft extend over positions decoded "
        "plain, at most SGLang's largest prefill forward), by reason: resume, buffer_full "
        "(in plain mode), mixed."
    ),
    CATCH_UP_TOKENS_COUNTER: "Positions replayed into the draft model by EAGLE3_DYNAMIC catch-ups.",
    CATCH_UP_SECONDS: "Device time of one EAGLE3_DYNAMIC draft catch-up.",
    RESUME_ACCEPTED_COUNTER: (
        "Tokens accepted (bonus included) on the first speculative step after each "
        "resume of EAGLE3_DYNAMIC, summed over its requests."
    ),
    RESUME_REQUESTS_COUNTER: "Requests in the first speculative step after each resume of EAGLE3_DYNAMIC.",
    ACCEPTANCE_GAUGE: (
        "EAGLE3_DYNAMIC goodput policy: expected tokens per request per speculative step (bonus "
        "included) the policy uses, by source (counters: the scheduler's accept counters while "
        "speculating; replay: the draft catch-up's agreement with the target while plain; "
        "simulated: SGLANG_SIMULATE_ACC_LEN). NaN for the sources not in use."
    ),
    PREDICTED_GAUGE: (
        "EAGLE3_DYNAMIC goodput policy: predicted output tokens/s of each mode at the decode batch "
        "size of the last estimate."
    ),
    REALIZED_GAUGE: (
        "EAGLE3_DYNAMIC goodput policy: output tokens/s measured in each mode over its last 16 "
        "decode steps (host time of decode steps run back to back, nothing between; speculative "
        "tokens from the accept counters). NaN until the mode has run."
    ),
    PROBE_STEPS_COUNTER: (
        "EAGLE3_DYNAMIC goodput policy: decode steps run in a mode only to measure it (probes), "
        "by mode: the cost of keeping the estimates current."
    ),
    PENALTY_PLAIN_COUNTER: (
        "Decode steps EAGLE3_DYNAMIC ran plain, whatever its policy said, because a request of "
        "the batch has frequency, presence or repetition penalties (--speculative-penalties exact)."
    ),
    RELAXED_PENALTY_COUNTER: (
        "Speculative decode steps of EAGLE3_DYNAMIC whose batch had a request with frequency, "
        "presence or repetition penalties: that request got EAGLE-3's per-step penalties "
        "(--speculative-penalties relaxed, the default)."
    ),
    STEP_SECONDS_GAUGE: (
        "EAGLE3_DYNAMIC: device seconds of one decode step timed at start-up, by mode, batch size "
        "and context length (the goodput policy's cost table, before online corrections)."
    ),
    STEP_COST_CORRECTION_GAUGE: (
        "EAGLE3_DYNAMIC goodput policy: measured over start-up step time as the decision uses it "
        "(a bucket measured a few times is weighed against the mode's other buckets), by mode, kind "
        "(device: the step's forward on the device; host: the time between consecutive decode steps) "
        "and batch-size bucket (batch_max: the bucket's largest batch size)."
    ),
}


def total(counter: str) -> str:
    """The exported series name of a counter (``prometheus_client`` appends ``_total``)."""
    return counter + "_total"
