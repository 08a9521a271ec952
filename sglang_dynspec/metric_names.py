"""Names, help texts and label values of the plugin's Prometheus metrics, defined once.

Pure constants (no prometheus_client, no SGLang): the exporter
(``prometheus_export``), the benchmark's scraper (``bench.scrape``), the test bed's
fake server and the tests all import them from here. Counters are exported with a
``_total`` suffix (``prometheus_client`` adds it); use :func:`total` for the series name.
"""

from __future__ import annotations

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
STEP_SECONDS_GAUGE = "sglang:spec_dynamic_step_seconds"  # labels "mode", "batch_max" (a bucket's upper edge)
PROBE_STEPS_COUNTER = "sglang:spec_dynamic_probe_steps"  # label "mode"
PENALTY_PLAIN_COUNTER = "sglang:spec_dynamic_penalty_plain_steps"

# Label values.
MODES = ("spec", "plain")  # label "mode" of STEPS_COUNTER, "to" of SWITCHES_COUNTER
CATCH_UP_REASONS = ("resume", "buffer_full", "mixed")  # label "reason" of CATCH_UP_COUNTER
ACCEPTANCE_SOURCES = ("measured", "simulated", "none")  # label "source" of ACCEPTANCE_GAUGE

HELP = {
    MODE_GAUGE: "1 while EAGLE3_DYNAMIC speculates, 0 while it runs plain decode steps.",
    STEPS_COUNTER: "Decode steps run by EAGLE3_DYNAMIC, by mode (spec or plain).",
    SWITCHES_COUNTER: "Mode switches of EAGLE3_DYNAMIC, by the mode switched to.",
    PLAIN_GRAPH_COUNTER: (
        "Plain decode steps of EAGLE3_DYNAMIC that replayed its plain DECODE CUDA graph "
        "(the rest ran eagerly: no graph captured, or a batch above its largest size)."
    ),
    CATCH_UP_COUNTER: (
        "Draft catch-ups of EAGLE3_DYNAMIC (one batched draft extend over the positions "
        "decoded plain), by reason: resume, buffer_full (in plain mode), mixed."
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
        "included), by source (measured from the scheduler's accept counters, or simulated)."
    ),
    PREDICTED_GAUGE: (
        "EAGLE3_DYNAMIC goodput policy: predicted output tokens/s of each mode at the decode batch "
        "size of the last estimate."
    ),
    PROBE_STEPS_COUNTER: (
        "EAGLE3_DYNAMIC goodput policy: decode steps run in a mode only to measure it (probes), "
        "by mode: the cost of keeping the estimates current."
    ),
    PENALTY_PLAIN_COUNTER: (
        "Decode steps EAGLE3_DYNAMIC ran plain, whatever its policy said, because a request of "
        "the batch has frequency, presence or repetition penalties (--speculative-penalties exact)."
    ),
    STEP_SECONDS_GAUGE: (
        "EAGLE3_DYNAMIC goodput policy: measured seconds per decode step, by mode and batch-size "
        "bucket (batch_max: the bucket's largest batch size)."
    ),
}


def total(counter: str) -> str:
    """The exported series name of a counter (``prometheus_client`` appends ``_total``)."""
    return counter + "_total"
