"""What EAGLE3_DYNAMIC refuses to run on: SGLang versions, SGLang settings and drafts.

Pure Python (no torch, no SGLang): ``plugin.validate_server_args`` turns each reason
into a start-up error before weights load, and every message is unit-tested
(``tests/test_config.py``). A draft on the hub is read through ``transformers``,
imported only then.
"""

from __future__ import annotations

import json
import os
from typing import Any

from sglang_dynspec.config import ALGORITHM_NAME, FLUSH_STREAM_ENV

# The SGLang releases the plugin runs on: the distribution's dependency (setup.cfg),
# the start-up messages and the README say this; tests/test_packaging.py checks
# that they agree.
SUPPORTED_SGLANG = "sglang>=0.5.17,<0.6"


# Settings of SGLang that the plugin does not support yet. Each entry is
# (attribute, predicate on its value, the flag a user sets, why).
_UNSUPPORTED = (
    (
        "pp_size",
        lambda v: v is not None and v > 1,
        "--pp-size",
        "pipeline parallelism relays spec-only verify inputs between stages",
    ),
    (
        "enable_dp_attention",
        bool,
        "--enable-dp-attention",
        "every DP rank would have to take the same mode in the same step",
    ),
    (
        "enable_two_batch_overlap",
        bool,
        "--enable-two-batch-overlap",
        "the plain path does not split micro-batches",
    ),
    (
        "enable_pdmux",
        bool,
        "--enable-pdmux",
        "PD multiplexing runs its own decode streams",
    ),
    (
        "tokenizer_worker_num",
        lambda v: v is not None and v > 1,
        "--tokenizer-worker-num",
        "SGLang does not load plugins in multi-tokenizer HTTP workers, which then reject the algorithm name",
    ),
    (
        "disaggregation_mode",
        lambda v: v not in (None, "null"),
        "--disaggregation-mode",
        "prefill/decode disaggregation hands draft state between servers, which is not handled yet",
    ),
    (
        "speculative_adaptive",
        bool,
        "--speculative-adaptive",
        f"{ALGORITHM_NAME} already decides when to speculate; the two controllers would fight",
    ),
    (
        "enable_multi_layer_eagle",
        bool,
        "--enable-multi-layer-eagle",
        "only single-layer EAGLE-3 drafts are supported",
    ),
    (
        "enable_lora",
        bool,
        "--enable-lora",
        "the plain decode graph would re-initialise the LoRA decode-graph metadata the verify graph shares",
    ),
    (
        "lora_paths",
        bool,
        "--lora-paths",
        "the plain decode graph would re-initialise the LoRA decode-graph metadata the verify graph shares",
    ),
    (
        "dp_size",
        lambda v: v is not None and v > 1,
        "--dp-size",
        "each data-parallel replica's scheduler would export the same sglang:spec_dynamic_* series to "
        "/metrics, overwriting the others'",
    ),
    (
        "attn_cp_size",
        lambda v: v is not None and v > 1,
        "--attn-cp-size",
        "context parallelism splits a request's KV across ranks; the plain step and the draft catch-up "
        "address it one token at a time on one rank",
    ),
    (
        "page_size",
        lambda v: v is not None and v > 1,
        "--page-size",
        "the plain step and the draft catch-up are built and tested for one token per KV page",
    ),
    (
        "enable_return_hidden_states",
        bool,
        "--enable-return-hidden-states",
        "a plain step captures the target's auxiliary hidden states for the draft, so the hidden states "
        "returned would change with the mode",
    ),
    # The CUDA graph backends the plugin has run on: SGLang's defaults (decode: full, prefill:
    # breakable; the H200 runs, benchmarks/results/) and graphs off (the CPU test bed).
    # None: the flag not given, SGLang's default.
    (
        "cuda_graph_backend_decode",
        lambda v: v not in (None, "full", "disabled"),
        "--cuda-graph-backend-decode",
        "the plain decode graph and the speculative step are tested with SGLang's default decode "
        "graphs (full) and with decode graphs off (disabled); pass one of those or leave the flag out",
    ),
    (
        "cuda_graph_backend_prefill",
        lambda v: v not in (None, "breakable", "disabled"),
        "--cuda-graph-backend-prefill",
        "prompt prefills and the draft catch-up's extend passes are tested with SGLang's default "
        "prefill graphs (breakable) and with prefill graphs off (disabled); pass one of those or "
        "leave the flag out",
    ),
    (
        "enable_custom_logit_processor",
        bool,
        "--enable-custom-logit-processor",
        "plain steps would apply a request's custom logit processor and speculative verify does not, "
        "so its sampling would change with the mode",
    ),
)


def unsupported_reason(server_args: Any) -> str | None:
    """Why this SGLang configuration cannot run EAGLE3_DYNAMIC, or None.

    Reads attributes only (works on ServerArgs, its resolving view, or a stub).
    """
    for attr, is_set, option, why in _UNSUPPORTED:
        value = getattr(server_args, attr, None)
        if is_set(value):
            return (
                f"{option} ({attr}={value!r}) is not supported with "
                f"--speculative-algorithm {ALGORITHM_NAME} ({why})"
            )
    return None


def settings_error(settings: Any, server_args: Any) -> str | None:
    """Why these plugin settings cannot run with this SGLang configuration, or None."""
    tp_size = getattr(server_args, "tp_size", None) or 1
    if settings.flush_stream and tp_size > 1:
        return (
            f"{FLUSH_STREAM_ENV}=1 is not supported with --tp-size {tp_size}: a flush on its own stream "
            "would run its all-reduces beside the plain step's; unset it or use --tp-size 1"
        )
    return None


def target_model_error(model_path: str, hybrid_swa: bool, linear_attention: bool) -> str | None:
    """Refuse a target whose KV is not one full-attention pool: the plain step writes
    and the draft catch-up replays one full-attention KV slot per token; hybrid models
    keep sliding-window or recurrent state beside it, which neither updates."""
    kinds = [
        kind
        for kind, present in (
            ("hybrid sliding-window attention", hybrid_swa),
            ("linear-attention (Mamba, GDN) layers", linear_attention),
        )
        if present
    ]
    if not kinds:
        return None
    return (
        f"--model-path {model_path}: a target with {' and '.join(kinds)} is not supported with "
        f"--speculative-algorithm {ALGORITHM_NAME} (its plain step and draft catch-up address one "
        "full-attention KV pool, one slot per token); use --speculative-algorithm EAGLE3"
    )


def draft_architecture_error(draft_path: str | None, architectures: list | None) -> str | None:
    """Check that the draft is an EAGLE-3 model; return an error message or None."""
    if not draft_path:
        return (
            f"--speculative-draft-model-path is required with --speculative-algorithm "
            f"{ALGORITHM_NAME}: pass an EAGLE-3 draft (architecture such as "
            "LlamaForCausalLMEagle3)"
        )
    if not architectures or not any("Eagle3" in a for a in architectures):
        return (
            f"--speculative-draft-model-path {draft_path} is not an EAGLE-3 draft "
            f"(its config.json lists architectures {architectures!r}); "
            f"--speculative-algorithm {ALGORITHM_NAME} accepts only EAGLE-3 drafts, whose "
            "architecture name contains 'Eagle3' (e.g. LlamaForCausalLMEagle3)"
        )
    return None


def draft_architectures(path: str, revision=None) -> list | None:
    """The ``architectures`` list of the draft's config.json (local dir or hub id)."""
    local = os.path.join(path, "config.json")
    if os.path.isfile(local):
        with open(local) as f:
            return json.load(f).get("architectures")
    if os.path.isdir(path):
        return None  # a directory without config.json is not a model
    from transformers import PretrainedConfig

    config_dict, _ = PretrainedConfig.get_config_dict(path, revision=revision)
    return config_dict.get("architectures")
