"""The host adapter: every SGLang symbol the plugin reads, calls or sets.

The rest of the package never imports SGLang: it goes through the names below, and
every attribute it reads, calls or sets on an SGLang object is listed in
:data:`HOST_SYMBOLS`. That table is checked against the installed SGLang when the
server starts (``plugin.validate_server_args``), so a missing symbol is a start-up
error that names it and the installed version; ``tests/test_host_symbols.py`` derives
the attribute names the package uses from its source and fails on any that bypass
the table. An SGLang upgrade is a change to this file.

Supported: ``sglang>=0.5.17,<0.6``; tested on 0.5.17 (the H200) and 0.5.23 (CI,
CPU). Where the two differ, the difference is detected once, from the installed code
(a signature, an attribute), not from the version string:

* ``EAGLEWorkerV2.forward_batch_generation`` takes ``pp_proxy_tensors`` on 0.5.23 only;
* the WAR-barrier runner property and the model runner's read-done event are named
  ``last_shared_read_runner`` / ``shared_read_done_event`` on 0.5.23 and
  ``war_fastpath_runner`` / ``war_fastpath_read_done_event`` on 0.5.17;
* a request's ``req_to_token`` row is ``req.kv.req_pool_idx`` on 0.5.23 and
  ``req.req_pool_idx`` on 0.5.17;
* the draft tensor-parallel context is a module function of the draft's parallel
  layout on 0.5.23 and a draft-worker method taking the TP group on 0.5.17;
* some ``ScheduleBatch`` fields exist only in some versions (``OPTIONAL_BATCH_FIELDS``;
  e.g. ``can_run_decode_cuda_graph`` is 0.5.23's, found missing on 0.5.17 by the
  start-up check);
* the grouped-head verify kernel (``verify_mla.py``) ships with 0.5.23 only: on 0.5.17
  :data:`grouped_verify` is the plugin's copy of it (``verify_grouped_kernel``).

No CUDA graph capture, no result shaping and no timers here (``plain_graph``,
``plain_step``, ``device_timer``).
"""

from __future__ import annotations

import array
import contextlib
import dataclasses
import functools
import inspect
import itertools
import operator
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import sglang
import torch
from sglang.kernels.ops.attention import verify_splitkv
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.distributed import parallel_state
from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
from sglang.srt.layers.logits_processor import LogitsMetadata, LogitsProcessor, LogitsProcessorOutput
from sglang.srt.managers import overlap_utils
from sglang.srt.managers.schedule_batch import Req, ReqKvInfo, ScheduleBatch
from sglang.srt.managers.tp_worker import TpModelWorker
from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.mem_cache import allocation_sizing
from sglang.srt.mem_cache.allocator import BaseTokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater
from sglang.srt.model_executor.runner.base_runner import BaseRunner
from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner
from sglang.srt.models import llama_eagle3
from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3
from sglang.srt.plugins.hook_registry import HookRegistry, HookType
from sglang.srt.sampling.penaltylib import BatchedPenalizerOrchestrator
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs
from sglang.srt.speculative import eagle_utils, eagle_worker_v2, spec_registry
from sglang.srt.speculative.eagle_info import EagleDraftExtendInput, EagleDraftInput
from sglang.srt.speculative.eagle_worker_v2 import EagleDraftWorker, EAGLEWorkerV2
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang.srt.speculative.spec_registry import CustomSpecAlgo

from sglang_dynspec.device_timer import to_device

try:  # the grouped-head verify kernel: SGLang's where it ships one (0.5.23), else the plugin's copy
    from sglang.kernels.ops.attention import verify_mla as grouped_verify
except ImportError:  # SGLang 0.5.17
    from sglang_dynspec import verify_grouped_kernel as grouped_verify

SGLANG_VERSION: str = getattr(sglang, "__version__", "unknown")


# ------------------------------------------------------------------------ the table
@dataclass(frozen=True)
class HostSymbols:
    """Attributes of one SGLang class or module that the plugin reads, calls or sets.

    A name ``"a|b"`` is a version difference (either must exist); ``"a?"`` is used
    only where present.
    """

    owner: Any  # an SGLang class or module
    names: tuple[str, ...]

    @property
    def owner_name(self) -> str:
        return getattr(self.owner, "__qualname__", None) or self.owner.__name__


HOST_SYMBOLS: tuple[HostSymbols, ...] = (
    # Registration (registration.py, plugin.py).
    HostSymbols(
        SpeculativeAlgorithm, ("register", "EAGLE3", "NONE", "create_future_map", "get_platform_worker_cls?")
    ),
    HostSymbols(CustomSpecAlgo, ("handle_server_args",)),
    HostSymbols(spec_registry, ("get_spec",)),
    HostSymbols(HookRegistry, ("register",)),
    HostSymbols(HookType, ("AFTER",)),
    HostSymbols(ServerArgs, ("add_cli_args", "from_cli_args")),
    HostSymbols(overlap_utils, ("FutureMap",)),
    # Server arguments read by the plugin (plugin.py, refusals.unsupported_reason).
    HostSymbols(
        ServerArgs,
        (
            "enable_metrics",
            "served_model_name",
            "model_path",
            "speculative_algorithm",
            "speculative_draft_model_path",
            "speculative_draft_model_revision",
            "speculative_num_steps",
            "max_running_requests",
            "speculative_eagle_topk",
            "speculative_num_draft_tokens",
            "attention_backend",
            "disable_cuda_graph",
            "pp_size",
            "enable_dp_attention",
            "dp_size",
            "attn_cp_size",
            "page_size",
            "enable_return_hidden_states",
            "enable_two_batch_overlap",
            "enable_pdmux",
            "tokenizer_worker_num",
            "disaggregation_mode",
            "speculative_adaptive?",
            "enable_multi_layer_eagle?",
            "enable_lora",
            "lora_paths",
            "enable_custom_logit_processor",
            "cuda_graph_backend_decode",
            "cuda_graph_backend_prefill",
            # The draft catch-up's largest forward (prefill_forward_tokens).
            "chunked_prefill_size",
            "max_prefill_tokens",
        ),
    ),
    HostSymbols(
        parallel_state,
        (
            "get_tensor_model_parallel_rank",
            "get_tensor_model_parallel_world_size",
            "get_tp_group",
        ),
    ),
    HostSymbols(parallel_state.GroupCoordinator, ("broadcast_object", "all_gather_object")),
    # The worker we subclass, and the draft worker inside it (worker.py, catch_up.py).
    HostSymbols(
        EAGLEWorkerV2,
        (
            "forward_batch_generation",
            "init_attention_backends",
            "init_cuda_graphs",
            "target_worker",
            "draft_worker",
            "req_to_token_pool",
            "device",
            "server_args",
            "last_shared_read_runner|war_fastpath_runner",
        ),
    ),
    HostSymbols(
        EagleDraftWorker,
        ("_draft_extend_for_prefill", "draft_runner", "draft_runners", "parallel_layout|draft_tp_context"),
    ),
    HostSymbols(
        eagle_worker_v2,
        (
            "draft_tp_context?",
            "speculative_moe_backend_context",
            "speculative_moe_a2a_backend_context",
            "spec_stage_span",
        ),
    ),
    HostSymbols(eagle_utils, ("get_draft_input_from_target_hidden_dim",)),
    HostSymbols(TpModelWorker, ("forward_batch_generation", "model_runner")),
    # The target's model runner and its graphs (plain_graph.py).
    HostSymbols(
        ModelRunner,
        (
            "decode_cuda_graph_runner",
            "eager_runner?",
            "is_draft_worker",
            "recapture_decode_cuda_graph?",  # 0.5.23's fix that keep_draft_graphs_on_recapture backports
            "weight_updater",
            "attn_backend",
            "spec_algorithm",
            "init_new_workspace",
            "_get_attention_backend",
            "model_config",
            "tp_group?",  # 0.5.17's draft TP context takes it (see draft_extend_contexts)
            "forward",
            "canary_manager?",  # a KV debugging mode of both versions; fill_draft_kv defers to SGLang under it
            "shared_read_done_event|war_fastpath_read_done_event",
        ),
    ),
    HostSymbols(WeightUpdater, ("recapture_cuda_graph",)),
    HostSymbols(ModelConfig, ("dtype", "is_hybrid_swa", "linear_attn_registry_result")),
    HostSymbols(BaseRunner, ("return_hidden_states_mode",)),
    HostSymbols(DecodeCudaGraphRunner, ("max_bs",)),
    HostSymbols(CaptureHiddenMode, ("FULL", "LAST", "NULL")),
    # The draft's KV fill without proposals (fill_draft_kv).
    HostSymbols(ForwardBatch, ("init_new", "return_logprob")),
    HostSymbols(
        EagleDraftExtendInput, ("hidden_states", "num_tokens_per_req", "num_tokens_for_logprob_per_req")
    ),
    HostSymbols(ForwardMode, ("DECODE", "EXTEND", "is_decode", "is_idle")),
    # Batches: the scheduler's decode batch, the plain batch and the catch-up EXTEND
    # batch (fresh_batch.py, catch_up.py).
    HostSymbols(
        ScheduleBatch,
        (
            "reqs",
            "forward_mode",
            "spec_info",
            "spec_algorithm",
            "input_ids",
            "out_cache_loc",
            "seq_lens",
            "seq_lens_cpu",
            "seq_lens_sum",
            "req_pool_indices",
            "return_logprob",
            "has_grammar",
            "is_extend_in_batch",
            "prefix_lens",
            "extend_lens",
            "extend_num_tokens",
            "extend_logprob_start_lens",
            "extend_input_logprob_token_ids",
            "top_logprobs_nums",
            "token_ids_logprobs",
            "multimodal_inputs",
            "input_embeds",
            "decoding_reqs",
            "chunked_req",
            "sampling_info",
            "can_run_decode_cuda_graph?",
            "req_pool_indices_cpu?",
            "orig_seq_lens?",
            "chunked_req_next_prompt_token?",
        ),
    ),
    HostSymbols(ReqKvInfo, ("req_pool_idx?",)),  # 0.5.23's home of the request's row
    HostSymbols(
        Req,
        (
            "kv|req_pool_idx",
            "rid",
            "spec_num_correct_drafts",
            "spec_verify_ct",
            "origin_input_ids",
            "output_ids",
        ),
    ),
    HostSymbols(ReqToTokenPool, ("req_to_token",)),
    HostSymbols(
        SamplingBatchInfo,
        (
            "temperatures",
            "top_ps",
            "top_ks",
            "min_ps",
            "sampling_seed",
            "grammars",
            "need_min_p_sampling",
            "penalizer_orchestrator",
            "acc_additive_penalties",
            "acc_scaling_penalties",
        ),
    ),
    HostSymbols(BatchedPenalizerOrchestrator, ("is_required",)),
    # Results and the speculative state carried between steps (plain_step.py).
    HostSymbols(
        EagleDraftInput,
        (
            "bonus_tokens",
            "topk_p",
            "topk_index",
            "hidden_states",
            "draft_probs",
            "capture_hidden_mode",
            "num_tokens_per_req",
            "num_tokens_for_logprob_per_req",
        ),
    ),
    HostSymbols(
        GenerationBatchResult,
        (
            "next_token_ids",
            "accept_lens",
            "new_seq_lens",
            "speculative_num_draft_tokens",
            "speculative_output_stride?",
            "next_draft_input",
            "extra_keep_alive_refs",
            "logits_output",
            "can_run_cuda_graph",
        ),
    ),
    HostSymbols(
        LogitsProcessorOutput,
        ("hidden_states", "next_token_logprobs", "customized_info", "next_token_logits"),
    ),
    # The draft's top-1 proposals at replayed positions (draft_top1): the draft model's
    # logits head and its hot-token map (EAGLE-3's d2t).
    HostSymbols(EagleDraftWorker, ("hot_token_id",)),
    HostSymbols(ModelRunner, ("model",)),
    HostSymbols(LlamaForCausalLMEagle3, ("logits_processor", "lm_head")),
    # A buffer-full flush leaves out the draft's last MLP (draft_last_layer).
    HostSymbols(LlamaForCausalLMEagle3, ("model",)),
    HostSymbols(llama_eagle3.LlamaModel, ("layers",)),
    HostSymbols(llama_eagle3.LlamaDecoderLayer, ("mlp",)),
    # ... which takes effect only outside the draft's prefill CUDA graph (draft_graph_off_from).
    HostSymbols(ModelRunner, ("prefill_cuda_graph_runner",)),
    # The target's verify attention through SGLang's split-KV verify kernel (use_split_kv_verify).
    HostSymbols(ModelRunner, ("decode_attn_backend",)),
    HostSymbols(TritonAttnBackend, ("use_verify_splitkv", "enable_deterministic", "use_mla")),
    HostSymbols(verify_splitkv, ("VerifySplitKV", "MIN_N_SPLITS", "MAX_N_SPLITS")),
    HostSymbols(TritonAttnBackend, ("req_to_token_pool", "num_draft_tokens", "num_head", "v_head_dim")),
    HostSymbols(verify_splitkv.VerifySplitKV, ("_alloc", "att_out")),
    # ... and the grouped-head kernel first, in the slot the backend calls (GroupedThenPerHead).
    HostSymbols(TritonAttnBackend, ("verify_splitkv_fwd", "num_kv_head")),
    HostSymbols(grouped_verify, ("verify_shared_kv_fwd", "VerifyMLA", "MAX_N_SPLITS", "block_config")),
    HostSymbols(grouped_verify.VerifyMLA, ("_alloc", "att_out")),
    # ... and the per-head kernel's split count by batch size (per_head_verify_splits_by_batch).
    HostSymbols(verify_splitkv, ("can_handle", "_get_vk")),
    # The draft extend's attention through the same kernel (use_split_kv_draft_extend): the
    # slot the draft's triton backend calls for every extend.
    HostSymbols(EagleDraftWorker, ("draft_extend_attn_backend", "draft_runner")),
    HostSymbols(TritonAttnBackend, ("extend_attention_fwd",)),
    HostSymbols(LogitsMetadata, ("forward_mode",)),
    # The draft extend's LM head at the last accepted rows only (LogitsAtLastAccepted).
    HostSymbols(ForwardBatch, ("forward_mode", "spec_info", "next_token_logits_buffer")),
    HostSymbols(ForwardMode, ("is_draft_extend_v2",)),
    HostSymbols(EagleDraftExtendInput, ("select_index", "num_accept_tokens", "num_front_tokens?")),
    # Step-cost calibration: the synthetic decode batch and the limits of the grid
    # (synthetic_decode_batch, synthetic_batch_limits, decode_graph_batch_sizes).
    HostSymbols(EAGLEWorkerV2, ("token_to_kv_pool_allocator", "topk")),
    HostSymbols(EagleDraftWorker, ("cuda_graph_runner", "cuda_graph_runner_for_draft_extend")),
    HostSymbols(ModelRunner, ("max_running_requests",)),
    HostSymbols(ModelConfig, ("context_len", "vocab_size")),
    HostSymbols(DecodeCudaGraphRunner, ("capture_bs",)),
    HostSymbols(ReqToTokenPool, ("free_slots", "device")),
    HostSymbols(BaseTokenToKVPoolAllocator, ("size", "page_size")),
    HostSymbols(allocation_sizing, ("get_alloc_reserve_per_decode",)),
    HostSymbols(eagle_utils, ("get_draft_recurrent_hidden_state_spec",)),
    HostSymbols(ScheduleBatch, ("init_new",)),
    HostSymbols(SamplingParams, ("normalize",)),
    HostSymbols(SamplingBatchInfo, ("from_schedule_batch", "copy_for_forward")),
)


def table_names(table: tuple[HostSymbols, ...] = HOST_SYMBOLS) -> frozenset[str]:
    """Every attribute name the table lists (alternatives split, markers dropped)."""
    return frozenset(alt for entry in table for name in entry.names for alt in name.rstrip("?").split("|"))


@functools.cache
def _class_source(cls: type) -> str:
    try:
        return inspect.getsource(cls)
    except (OSError, TypeError):
        return ""


def _has_attribute(owner: Any, name: str) -> bool:
    """A class or module attribute, a dataclass field, an annotation, or an instance
    attribute assigned (``self.name = ...``, or ``self.name, self.other = ...``)
    somewhere in the class's own source."""
    if hasattr(owner, name) or name in getattr(owner, "__dataclass_fields__", {}):
        return True
    if not inspect.isclass(owner):
        return False
    attr = re.escape(name)
    assigned = re.compile(rf"\bself\.{attr}\s*(:[^=\n]+)?=(?!=)")
    # ... or one target of a tuple assignment (``self.a, self.b = ...``).
    unpacked = re.compile(rf"^\s*(self\.\w+\s*,\s*)*self\.{attr}\s*(,\s*self\.\w+\s*)*=(?!=)", re.M)
    for cls in owner.__mro__:
        if name in getattr(cls, "__annotations__", {}):
            return True
        source = _class_source(cls) if cls.__module__.startswith("sglang") else ""
        if assigned.search(source) or unpacked.search(source):
            return True
    return False


def missing_host_symbols(table: tuple[HostSymbols, ...] = HOST_SYMBOLS) -> list[str]:
    """Names in ``table`` that the installed SGLang lacks (optional ones excepted)."""
    missing = []
    for entry in table:
        for name in entry.names:
            if name.endswith("?"):
                continue
            if not any(_has_attribute(entry.owner, alt) for alt in name.split("|")):
                missing.append(f"{entry.owner_name}.{name}")
    return missing


# ------------------------------------------------------------- version differences
_SPEC_FORWARD_PARAMS = frozenset(inspect.signature(EAGLEWorkerV2.forward_batch_generation).parameters)
_NEW_WAR_NAMES = hasattr(EAGLEWorkerV2, "last_shared_read_runner")
# The worker property naming the runner whose read-done event the scheduler's WAR
# barrier waits on, and the model-runner attribute holding that event.
WAR_RUNNER_PROPERTY = "last_shared_read_runner" if _NEW_WAR_NAMES else "war_fastpath_runner"
READ_DONE_EVENT = "shared_read_done_event" if _NEW_WAR_NAMES else "war_fastpath_read_done_event"
# SGLang 0.5.17 recaptures every runner's decode graph on
# update_weights_from_disk(recapture_cuda_graph=True), the EAGLE draft's too, and
# that capture raises for a draft runner (decode_cuda_graph_runner.py:277, "This
# should not happen"), killing the scheduler (benchmarks/results/h200-20261201-parity/).
# 0.5.23 skips draft runners that own no decode graph
# (ModelRunner.recapture_decode_cuda_graph).
_DRAFT_RECAPTURE_SKIPPED_UPSTREAM = hasattr(ModelRunner, "recapture_decode_cuda_graph")
# ScheduleBatch fields the catch-up batch sets only where the installed version has them.
OPTIONAL_BATCH_FIELDS = frozenset(
    name
    for name in (
        "req_pool_indices_cpu",
        "orig_seq_lens",
        "chunked_req_next_prompt_token",
        "can_run_decode_cuda_graph",
    )
    if name in ScheduleBatch.__dataclass_fields__
)


def target_attention_kinds(spec_worker) -> tuple[bool, bool]:
    """``(hybrid sliding-window attention, linear-attention layers)`` of the target, as
    SGLang's ModelConfig derives them (``refusals.target_model_error``)."""
    model_config = spec_worker.target_worker.model_runner.model_config
    return bool(model_config.is_hybrid_swa), model_config.linear_attn_registry_result is not None


def weight_storages(model_runner) -> tuple:
    """Where the runner's model keeps each parameter and buffer: ``(name, data pointer,
    shape, dtype)``. A captured CUDA graph reads these addresses, so an update that leaves
    them all in place (it wrote into the same storage) leaves the graph valid."""
    model = model_runner.model
    tensors = [*model.named_parameters(), *model.named_buffers()]
    return tuple((name, t.data_ptr(), tuple(t.shape), t.dtype) for name, t in tensors)


# WeightUpdater methods that write, or may move, the model's weights. Every SGLang
# version routes its HTTP and Engine updates (disk, tensor, distributed, IPC) through
# ``update_weights_from_*`` on 0.5.17; 0.5.23 also loads a distributed update with
# ``load_weights_from_distributed`` (after ``receive_weights_from_distributed``, which
# only fills receive buffers) and wraps tensor and distributed loads in a weight-update
# session whose ``begin_weight_update`` / ``end_weight_update`` unpack and repack the
# weights (``restore_weights_before_loading``, ``postprocess_weights``).
WEIGHT_WRITE_PREFIXES = ("update_weights_from_", "load_weights_from_")
WEIGHT_SESSION_METHODS = ("begin_weight_update", "end_weight_update")


def is_weight_write(method_name: str) -> bool:
    """Whether calling this ``WeightUpdater`` method may change what the weights hold or
    where they live (so a captured graph must be checked after it)."""
    return method_name.startswith(WEIGHT_WRITE_PREFIXES) or method_name in WEIGHT_SESSION_METHODS


def keep_draft_graphs_on_recapture(spec_worker) -> int:
    """Backport 0.5.23's recapture rule to the draft runners: a weight update with
    ``recapture_cuda_graph=True`` recaptures a draft runner's decode graph only if it
    owns one. Returns how many runners' updaters were changed (0 where SGLang has it)."""
    if _DRAFT_RECAPTURE_SKIPPED_UPSTREAM:
        return 0
    changed = 0
    for runner in spec_worker.draft_worker.draft_runners:
        updater = runner.weight_updater
        recapture = _recapture_if_owning_decode_graph(runner, updater.recapture_cuda_graph)
        # WeightUpdater is a frozen dataclass on 0.5.17: a copy with the one field replaced.
        runner.weight_updater = dataclasses.replace(updater, recapture_cuda_graph=recapture)
        changed += 1
    return changed


@dataclass(frozen=True)
class VerifyAttention:
    """Which kernel an attention phase runs (the target's verify, the draft extend), and why
    (the start-up log)."""

    split_kv: bool  # a split-KV verify kernel on the target's triton backends
    note: str
    warning: bool = False  # asked for and not used for a reason the operator can change


class ZeroedSplitKVScratch(verify_splitkv.VerifySplitKV):
    """SGLang's split-KV verify with its partial outputs zeroed when allocated.

    The kernel's second stage reads every split's partial output and weighs the splits
    that held no keys by 0; their rows are never written, so a fresh ``torch.empty``
    buffer holding a NaN or an infinity would reach the attention output (NaN x 0).
    Once zeroed, every value in the buffer is finite: written splits store a finite
    mean. (With NaN in a fresh buffer, 3 of the 4 shapes of tests/test_split_kv_verify.py
    came out NaN on the CPU.)
    """

    def _alloc(self, max_bs):
        super()._alloc(max_bs)
        self.att_out.zero_()


def with_float32_partials(verify_class: type) -> type:
    """``verify_class`` (a grouped-head verify, ``VerifyMLA``) with each split's partial
    output kept in float32, as the per-head kernel keeps it (SGLang's grouped kernel
    stores bf16 to halve the scratch's traffic). In bf16 the partials are rounded once
    more before the output is, which put the output further from a float32 reference
    than the prefill kernel's (tests/test_split_kv_verify.py measures both). Only splits
    that held keys are read back, so the buffer needs no zeroing."""

    class Float32Partials(verify_class):
        def _alloc(self, max_bs):
            super()._alloc(max_bs)
            self.att_out = torch.empty_like(self.att_out, dtype=torch.float32)

    Float32Partials.__name__ = Float32Partials.__qualname__ = f"Float32Partials{verify_class.__name__}"
    return Float32Partials


Float32PartialsGroupedVerify = with_float32_partials(grouped_verify.VerifyMLA)


# The per-head kernel's split count (SGLANG_DYNSPEC_SPLIT_KV_SPLITS_BY_BATCH). SGLang picks
# it from kv_indices.shape[0] / batch size, the mean prefix only where the index buffer
# holds just the batch's rows: a captured verify graph's buffer is sized for every request
# at the longest context, so every replay ran 16 splits. In CUDA-graph replay on the H100
# (8B attention shape, 32 layers; benchmarks/results/h100-20261205-a5a50b8/splitkv.jsonl,
# split_kv_graph_indices_in_graph against split_kv_in_graph) 16 splits were slower than
# 4 at every prefix from batch 64 up and at prefixes to 1024 at batch 16, and faster only
# at batch 1-16 with long prefixes. The batch size is static in a graph, so the count
# follows it: the most splits (SGLang's bounds, powers of two) that keep stage 1 near
# this many programs.
SPLIT_KV_PROGRAMS = 4096


def split_kv_splits(batch_size: int, query_heads: int) -> int:
    """The per-head split-KV kernel's split count for a verify of ``batch_size`` requests:
    a power of two in SGLang's ``[MIN_N_SPLITS, MAX_N_SPLITS]``, the largest with
    ``batch_size * query_heads * splits <= SPLIT_KV_PROGRAMS`` (the smallest if none)."""
    cap = min(verify_splitkv.MAX_N_SPLITS, SPLIT_KV_PROGRAMS // max(1, batch_size * query_heads))
    splits = verify_splitkv.MIN_N_SPLITS
    while splits * 2 <= cap:
        splits *= 2
    return splits


def per_head_verify_splits_by_batch(
    q_extend,
    k_extend,
    v_extend,
    o_extend,
    k_buffer,
    v_buffer,
    qo_indptr,
    kv_indptr,
    kv_indices,
    custom_mask,
    is_causal,
    mask_indptr,
    max_len_extend,
    k_scale,
    v_scale,
    sm_scale=None,
    logit_cap=0.0,
    skip_prefix_custom_mask=True,
    sliding_window_size=-1,
    sinks=None,
    window_kv_offsets=None,
    xai_temperature_len=-1,
    max_bs=None,
) -> bool:
    """SGLang's ``verify_splitkv_fwd`` (same arguments, same result: True if it wrote
    ``o_extend``, False for a shape the backend must send to its prefill kernel) with the
    split count from :func:`split_kv_splits` instead of the index buffer's length. Reads
    only shapes and Python values, as SGLang's does: it runs inside the verify graph."""
    if not verify_splitkv.can_handle(
        q_extend,
        k_extend,
        v_extend,
        k_buffer,
        v_buffer,
        qo_indptr,
        kv_indptr,
        kv_indices,
        custom_mask,
        is_causal,
        mask_indptr,
        max_len_extend,
        sliding_window_size=sliding_window_size,
        sinks=sinks,
        logit_cap=logit_cap,
        xai_temperature_len=xai_temperature_len,
    ):
        return False
    bs = qo_indptr.shape[0] - 1
    h_q, head_dim = q_extend.shape[1], q_extend.shape[2]
    if sm_scale is None:
        sm_scale = 1.0 / head_dim**0.5
    scales = []
    for scale in (k_scale, v_scale):  # a float or a 0-d tensor, as SGLang coerces them
        try:
            scales.append(float(scale))
        except (TypeError, ValueError):
            scales.append(1.0)
    kernel = verify_splitkv._get_vk(
        max(max_bs or bs, bs),
        h_q,
        k_extend.shape[1],
        head_dim,
        v_extend.shape[2],
        int(max_len_extend),
        q_extend.device,
        n_splits=split_kv_splits(bs, h_q),
    )
    kernel(
        q_extend,
        k_extend.contiguous(),
        v_extend.contiguous(),
        k_buffer,
        v_buffer,
        qo_indptr,
        kv_indptr,
        kv_indices,
        sm_scale,
        o_out=o_extend,
        k_scale=scales[0],
        v_scale=scales[1],
    )
    return True


class GroupedThenPerHead:
    """A target triton backend's ``verify_splitkv_fwd``: the grouped-head kernel
    (``grouped_verify.verify_shared_kv_fwd``) where it serves the verify's shape, else
    SGLang's per-head split-KV kernel, which falls back to the prefill kernel for what it
    cannot serve. Each returns False, without writing, for a shape it declines, which is
    what the backend's call site expects of this slot."""

    def __init__(self, per_head: Callable[..., bool]):
        self.per_head = per_head
        self.grouped = torch.compiler.disable(grouped_verify.verify_shared_kv_fwd)

    def __call__(self, *args, **kwargs) -> bool:
        return self.grouped(*args, **kwargs) or self.per_head(*args, **kwargs)


# Device memory left free once the split-KV scratch is allocated: the target's and the
# draft's CUDA graphs and the plain decode graph are captured after it (as for the catch-up
# buffer, catch_up.CATCH_UP_MEMORY_HEADROOM).
SPLIT_KV_MEMORY_HEADROOM = 1 << 30


def _next_power_of_2(n: int) -> int:  # triton.next_power_of_2
    return 1 << (int(n) - 1).bit_length()


def split_kv_scratch_bytes(backend, grouped: bool = False) -> int:
    """Device memory the split-KV verify allocates at most for ``backend``.

    SGLang's per-head kernel: one ``VerifySplitKV`` per split count it picks (powers of
    two from ``MIN_N_SPLITS`` to ``MAX_N_SPLITS``: graph replays take the largest, eager
    verifies one by context), each holding fp32 partial outputs and log-sum-exps for every
    request row of the pool. With ``grouped``, also the grouped-head kernel's one
    ``Float32PartialsGroupedVerify``: ``MAX_N_SPLITS`` fp32 partials per request row and
    query head, its draft rows padded as ``VerifyMLA`` pads them (a head block times the
    padded draft length covers at least 16 rows, for ``tl.dot``)."""
    splits = sum(
        1 << i for i in range(16) if verify_splitkv.MIN_N_SPLITS <= 1 << i <= verify_splitkv.MAX_N_SPLITS
    )
    rows, heads, dv = backend.req_to_token_pool.size, backend.num_head, backend.v_head_dim
    draft_rows = _next_power_of_2(backend.num_draft_tokens)
    total = splits * rows * heads * draft_rows * (dv + 1) * 4
    if grouped:
        # The head block as grouped_verify._get_vmla picks it (by head dimension; a
        # smaller group of query heads per KV head shrinks it to the group).
        block_h = grouped_verify.block_config(dv)[0]
        group = heads // backend.num_kv_head
        if group < heads and group % block_h:
            block_h = group
        padded = max(_next_power_of_2(-(-16 // block_h)), draft_rows)
        total += rows * heads * grouped_verify.MAX_N_SPLITS * padded * (dv + 1) * 4
    return total


def free_device_memory(device) -> int | None:
    """Free bytes on ``device`` (CUDA), None elsewhere."""
    if torch.device(device).type != "cuda":
        return None
    return torch.cuda.mem_get_info(device)[0]


def _target_triton_backends(spec_worker) -> list:
    runner = spec_worker.target_worker.model_runner
    backends = {id(b): b for b in (runner.attn_backend, getattr(runner, "decode_attn_backend", None))}
    return [b for b in backends.values() if isinstance(b, TritonAttnBackend)]


def _split_kv_refusal(model: str, backends: list, backend, flag: str, topk: int) -> VerifyAttention | None:
    """Why the split-KV kernel cannot serve ``model``'s (``"target"`` or ``"draft"``)
    attention, or None where it can: it is the triton backend's kernel (``flag`` picks
    the backend), computes a causal chain (the verify's mask only with topk 1), and is not
    built for MLA's cache layout (SGLang 0.5.17's per-head kernel has no check for it;
    0.5.23 added one: it faulted on the GPU)."""
    if not backends:
        return VerifyAttention(
            False,
            f"not used: the {model}'s attention backend is {type(backend).__name__}; the split-KV kernel "
            f"is the triton backend's ({flag} triton)",
        )
    if topk != 1:
        return VerifyAttention(
            False,
            f"not used: --speculative-eagle-topk {topk}; the split-KV kernel computes a causal chain, "
            "the verify's mask only with --speculative-eagle-topk 1",
        )
    if any(b.use_mla for b in backends):
        return VerifyAttention(
            False,
            f"not used: the {model} uses multi-head latent attention (MLA), whose cache layout the "
            "split-KV kernel is not built for",
        )
    return None


def _scratch_fits_on_every_rank(
    needed: int, device, gather: Callable[[Any], list] | None
) -> tuple[bool, int | None]:
    """Whether ``needed`` bytes of scratch leave :data:`SPLIT_KV_MEMORY_HEADROOM` free on
    every tensor-parallel rank (agreed through ``gather``, default an all-gather over the
    TP group, so that all ranks run the same kernel), and this rank's free bytes (None
    off CUDA, where it always fits)."""
    free = free_device_memory(device)
    fits = free is None or needed == 0 or needed + SPLIT_KV_MEMORY_HEADROOM <= free
    return all((gather or gather_across_tensor_parallel_ranks)(fits)), free


def use_split_kv_verify(
    spec_worker,
    gather: Callable[[Any], list] | None = None,
    grouped: bool = False,
    splits_by_batch: bool = False,
) -> VerifyAttention:
    """Route the target's TARGET_VERIFY attention through SGLang's split-KV verify kernel
    (``TritonAttnBackend.use_verify_splitkv``, which SGLang sets only on AMD gfx95), and
    with ``grouped`` through the grouped-head kernel first (:class:`GroupedThenPerHead`
    in the backend's ``verify_splitkv_fwd`` slot); with ``splits_by_batch`` the per-head
    kernel splits each prefix by :func:`split_kv_splits`
    (:func:`per_head_verify_splits_by_batch` in that slot, behind the grouped kernel).

    Call after the target's attention backends exist and before its CUDA graphs are
    captured (``EAGLEWorkerV2.init_attention_backends``): a captured verify graph keeps
    the kernel it captured. Both kernels compute causal attention over the prefix and
    the draft tokens, which is the verify's tree mask only for a chain
    (``--speculative-eagle-topk 1``); per call they fall back to the prefill kernel for
    what they cannot serve (sliding window, sinks, logit cap, ragged drafts). Not for
    MLA targets: SGLang 0.5.17's per-head kernel has no check for their shape (0.5.23
    added one: it faulted on the GPU).

    Every tensor-parallel rank calls it at the same point: whether the scratch fits is
    agreed through ``gather`` (default: an all-gather over the TP group), so all ranks
    run the same kernel."""
    backends = _target_triton_backends(spec_worker)
    runner = spec_worker.target_worker.model_runner
    refusal = _split_kv_refusal(
        "target", backends, runner.attn_backend, "--attention-backend", spec_worker.topk
    )
    if refusal is not None:
        return refusal
    # One cache per kernel module, shared by the backends.
    needed = max(split_kv_scratch_bytes(b, grouped) for b in backends)
    scratch = f"{needed / 2**20:.0f} MiB of scratch for {backends[0].req_to_token_pool.size} request rows"
    fits_everywhere, free = _scratch_fits_on_every_rank(needed, spec_worker.device, gather)
    if not fits_everywhere:
        here = f"{free / 2**20:.0f} MiB are free here" if free is not None else "it fits here"
        return VerifyAttention(
            False,
            f"not used: it would take up to {scratch} on each tensor-parallel rank, and on at least one "
            f"rank that does not fit with {SPLIT_KV_MEMORY_HEADROOM >> 20} MiB to spare for the CUDA graphs "
            f"once SGLang sized its KV pool ({here}); lower --max-running-requests or --mem-fraction-static "
            "to use it",
            warning=True,
        )
    # SGLang's caches build their kernel objects by these module names at the first verify.
    verify_splitkv.VerifySplitKV = ZeroedSplitKVScratch
    if grouped:
        grouped_verify.VerifyMLA = Float32PartialsGroupedVerify
    for backend in backends:
        backend.use_verify_splitkv = True
        if splits_by_batch and not isinstance(backend.verify_splitkv_fwd, GroupedThenPerHead):
            backend.verify_splitkv_fwd = torch.compiler.disable(per_head_verify_splits_by_batch)
        if grouped and not isinstance(backend.verify_splitkv_fwd, GroupedThenPerHead):
            backend.verify_splitkv_fwd = GroupedThenPerHead(backend.verify_splitkv_fwd)
    if any(backend.enable_deterministic for backend in backends):
        return VerifyAttention(
            True,
            "set, but --enable-deterministic-inference runs SGLang's deterministic extend kernel "
            "before it, so the verify keeps that kernel",
        )
    per_head = (
        "SGLang's per-head split-KV kernel (verify_splitkv.py)"
        if grouped
        else "SGLang's split-KV verify kernel (verify_splitkv.py)"
    )
    if splits_by_batch:
        per_head += (
            f" with {verify_splitkv.MIN_N_SPLITS}-{verify_splitkv.MAX_N_SPLITS} splits per prefix by batch size "
            f"(about {SPLIT_KV_PROGRAMS} programs)"
        )
    kernel = (
        "the grouped-head verify kernel (a KV head's keys read once for its query heads), "
        f"{per_head} for the shapes it declines,"
        if grouped
        else per_head
    )
    return VerifyAttention(True, f"{kernel} on the target, up to {scratch}")


def verify_attention_kernel(spec_worker) -> str:
    """``"grouped-split-kv"`` or ``"split-kv"`` if the target's verify runs a split-KV
    kernel (``-splits-by-batch`` added where the per-head kernel's split count follows the
    batch size), else ``"sglang"`` (its default), with ``"+draft-extend-split-kv"`` where
    the draft extend runs it too (:func:`use_split_kv_draft_extend`); part of the
    step-cost cache key: the kernels set a speculative step's cost."""
    draft = (
        "+draft-extend-split-kv"
        if any(
            isinstance(b.extend_attention_fwd, SplitKVThenPrefill)
            for b in _draft_extend_triton_backends(spec_worker)
        )
        else ""
    )
    backends = [b for b in _target_triton_backends(spec_worker) if b.use_verify_splitkv]
    if not backends:
        return "sglang" + draft
    # The per-head slot, behind the grouped kernel where it is installed; torch.compiler.disable
    # keeps the function it wraps as __wrapped__.
    slots = [b.verify_splitkv_fwd for b in backends]
    per_head = [getattr(s, "per_head", s) for s in slots]
    name = "grouped-split-kv" if any(isinstance(s, GroupedThenPerHead) for s in slots) else "split-kv"
    if any(getattr(s, "__wrapped__", s) is per_head_verify_splits_by_batch for s in per_head):
        name += "-splits-by-batch"
    return name + draft


# What the draft extend's calls of the prefill kernel may carry for the split-KV kernel to
# serve them: options it takes as they are, and options it serves only at these values
# (0.5.23's chunked and fused-prefix paths ask for a log-sum-exp, or skip a part).
SPLIT_KV_OPTIONS = frozenset(
    {"logit_cap", "sliding_window_size", "sinks", "window_kv_offsets", "xai_temperature_len"}
)
PREFILL_ONLY_OPTIONS = {
    "lse_extend": None,
    "skip_prefix": False,
    "skip_extend": False,
    "identity_kv_indices": False,
    "page_size": 1,
    "score_mod": None,
    "aux_tensors": None,
}
IGNORED_OPTIONS = frozenset({"extend_seq_lens_cpu", "skip_prefix_custom_mask"})  # no meaning without a mask


class SplitKVThenPrefill:
    """A draft triton backend's ``extend_attention_fwd`` (SGLang's prefill kernel, same
    arguments): an extend of the same few tokens per request with a causal mask runs the
    split-KV verify kernel, everything else the prefill kernel.

    The draft extend after every verify is such an extend: ``num_draft_tokens`` positions
    per request over its prefix, causal, no mask (SGLang's DRAFT_EXTEND_V2). SGLang routes
    only the target's TARGET_VERIFY to the split-KV kernel; the prefill kernel walks each
    request's prefix serially per query head, as it did in the verify. Served: the longest
    extend exactly ``max_tokens`` (the draft length, so that the kernel object SGLang caches
    per length is the verify's, scratch included; a prompt keeps the prefill kernel, whose
    tiles suit it), no custom mask, causal, and only options that the split-KV kernel
    computes the same way (:data:`SPLIT_KV_OPTIONS`); the kernel's own ``can_handle`` then
    declines ragged rows and the rest. Reads only shapes and Python values: it runs inside
    the draft extend's CUDA graph."""

    def __init__(
        self, prefill: Callable[..., Any], split_kv: Callable[..., bool], max_tokens: int, max_bs: int
    ):
        self.prefill, self.split_kv = prefill, split_kv
        self.max_tokens, self.max_bs = max_tokens, max_bs

    def serves(self, custom_mask, is_causal, max_len_extend, options: dict) -> bool:
        return (
            custom_mask is None
            and is_causal is True
            and isinstance(max_len_extend, int)
            and max_len_extend == self.max_tokens
            and all(
                name in SPLIT_KV_OPTIONS
                or name in IGNORED_OPTIONS
                or (name in PREFILL_ONLY_OPTIONS and value == PREFILL_ONLY_OPTIONS[name])
                for name, value in options.items()
            )
        )

    def __call__(
        self,
        q_extend,
        k_extend,
        v_extend,
        o_extend,
        k_buffer,
        v_buffer,
        qo_indptr,
        kv_indptr,
        kv_indices,
        custom_mask,
        is_causal,
        mask_indptr,
        max_len_extend,
        k_scale,
        v_scale,
        sm_scale=None,
        **options,
    ):
        args = (q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices)
        if self.serves(custom_mask, is_causal, max_len_extend, options) and self.split_kv(
            *args,
            custom_mask,
            is_causal,
            mask_indptr,
            max_len_extend,
            k_scale,
            v_scale,
            sm_scale,
            **{name: value for name, value in options.items() if name in SPLIT_KV_OPTIONS},
            max_bs=self.max_bs,
        ):
            return None
        return self.prefill(
            *args, custom_mask, is_causal, mask_indptr, max_len_extend, k_scale, v_scale, sm_scale, **options
        )


def _draft_extend_triton_backends(spec_worker) -> list:
    draft_worker = spec_worker.draft_worker
    candidates = (draft_worker.draft_extend_attn_backend, draft_worker.draft_runner.attn_backend)
    backends = {id(b): b for b in candidates if b is not None}
    return [b for b in backends.values() if isinstance(b, TritonAttnBackend)]


def _scratch_key(backend) -> tuple:
    """What sizes SGLang's cached split-KV kernel object: backends that agree share one."""
    return (
        backend.req_to_token_pool.size,
        backend.num_head,
        backend.num_kv_head,
        backend.v_head_dim,
        backend.num_draft_tokens,
    )


def use_split_kv_draft_extend(
    spec_worker,
    gather: Callable[[Any], list] | None = None,
    splits_by_batch: bool = False,
) -> VerifyAttention:
    """Route the draft extend's attention through SGLang's split-KV verify kernel
    (:class:`SplitKVThenPrefill` in the draft's triton backends' prefill-kernel slot),
    the per-head kernel with ``splits_by_batch`` as for the target. Call where
    :func:`use_split_kv_verify` is called (before the draft's CUDA graphs are captured),
    after it: a draft whose attention has the target's shape shares the target's scratch,
    otherwise its own is checked against free memory, agreed across ranks through
    ``gather``. Under the same conditions as the target's: triton backend, topk 1, no MLA;
    deterministic inference runs SGLang's deterministic kernel before either."""
    backends = _draft_extend_triton_backends(spec_worker)
    draft_backend = spec_worker.draft_worker.draft_runner.attn_backend
    refusal = _split_kv_refusal(
        "draft", backends, draft_backend, "--speculative-draft-attention-backend", spec_worker.topk
    )
    if refusal is not None:
        return refusal
    shared = {_scratch_key(b) for b in _target_triton_backends(spec_worker) if b.use_verify_splitkv}
    own = {_scratch_key(b): b for b in backends if _scratch_key(b) not in shared}
    needed = sum(split_kv_scratch_bytes(b) for b in own.values())
    if not _scratch_fits_on_every_rank(needed, spec_worker.device, gather)[0]:
        return VerifyAttention(
            False,
            f"not used: its scratch ({needed / 2**20:.0f} MiB, the draft's attention shape differs from the "
            f"target's) does not fit on every tensor-parallel rank with {SPLIT_KV_MEMORY_HEADROOM >> 20} MiB "
            "to spare for the CUDA graphs; lower --max-running-requests or --mem-fraction-static to use it",
            warning=True,
        )
    verify_splitkv.VerifySplitKV = ZeroedSplitKVScratch
    split_kv = per_head_verify_splits_by_batch if splits_by_batch else verify_splitkv.verify_splitkv_fwd
    for backend in backends:
        if not isinstance(backend.extend_attention_fwd, SplitKVThenPrefill):
            backend.extend_attention_fwd = SplitKVThenPrefill(
                backend.extend_attention_fwd,
                torch.compiler.disable(split_kv),
                max_tokens=backend.num_draft_tokens,
                max_bs=backend.req_to_token_pool.size,
            )
    scratch = "the target's scratch" if not own else f"up to {needed / 2**20:.0f} MiB of scratch of its own"
    if any(backend.enable_deterministic for backend in backends):
        return VerifyAttention(
            True,
            "set, but --enable-deterministic-inference runs SGLang's deterministic extend kernel "
            "before it, so the draft extend keeps that kernel",
        )
    splits = " with its split count by batch size" if splits_by_batch else ""
    return VerifyAttention(
        True,
        f"SGLang's split-KV verify kernel (verify_splitkv.py){splits} for the draft extend's "
        f"{backends[0].num_draft_tokens} positions per request, {scratch}",
    )


class LogitsAtLastAccepted(torch.nn.Module):
    """Stands in for the draft model's ``logits_processor``: in the draft extend after a
    verify (``DRAFT_EXTEND_V2``) the LM head runs only at each request's last accepted
    row, the one row per request whose logits and hidden state the worker keeps (its
    ``select_index`` in ``_draft_extend_for_decode``, both versions), instead of at all
    ``--speculative-num-draft-tokens`` rows.

    Why: the other rows' logits are computed and dropped. SGLang 0.5.23's draft-extend
    graph does the same (its runner sets ``EagleDraftExtendInput.select_index``, which
    both versions' logits processors honour); 0.5.17's does not, and neither version's
    eager path does. Where the host has set ``select_index`` already, nothing changes.
    Measured on the H100 (benchmarks/results/h100-20261208b-ec34cd2/): the step's ITL
    p50 moved by at most 0.2 ms at C=32-128, within the run's spread, so it is off by
    default (config.LAST_ACCEPTED_LOGITS_ENV).

    The kept rows go back to their places in a tensor of every row's size (the logits
    buffer the forward was given, where it has that shape), so the worker's own gather
    finds them; the other rows are never read (zeros outside a CUDA graph, where the
    new tensor would otherwise hold whatever the allocator gave, for SGLang's optional
    NaN probe of the whole tensor). The logits of a kept row are the same arithmetic on
    fewer rows: a GEMM of another height may round differently, which can change a
    draft proposal, never an output token (the target verifies every proposal)."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, hidden_states, lm_head, logits_metadata, *args, **kwargs):
        spec = getattr(logits_metadata, "spec_info", None)
        if (
            not isinstance(logits_metadata, ForwardBatch)
            or not logits_metadata.forward_mode.is_draft_extend_v2()
            or not isinstance(spec, EagleDraftExtendInput)
            or spec.select_index is not None
            or spec.num_accept_tokens is None
            or spec.num_tokens_per_req <= 1
            or getattr(spec, "num_front_tokens", 0)  # 0.5.17's widened window: other rows
        ):
            return self.inner(input_ids, hidden_states, lm_head, logits_metadata, *args, **kwargs)
        rows, width = hidden_states.shape[0], spec.num_tokens_per_req
        kept = rows // width
        select = (
            torch.arange(kept, dtype=torch.int64, device=hidden_states.device) * width
            + spec.num_accept_tokens[:kept].to(torch.int64)
            - 1
        )
        spec.select_index = select
        try:
            out = self.inner(input_ids, hidden_states, lm_head, logits_metadata, *args, **kwargs)
        finally:
            spec.select_index = None
        logits = out.next_token_logits
        if logits is None or logits.shape[0] != kept:  # an autotuning dummy run: no logits
            return out
        buffer = logits_metadata.next_token_logits_buffer
        if (
            buffer is not None
            and tuple(buffer.shape) == (rows, logits.shape[1])
            and buffer.dtype == logits.dtype
        ):
            full = buffer
        elif logits.is_cuda and torch.cuda.is_current_stream_capturing():
            full = logits.new_empty((rows, logits.shape[1]))
        else:
            full = logits.new_zeros((rows, logits.shape[1]))
        out.next_token_logits = full.index_copy_(0, select, logits)
        hidden = out.hidden_states
        if hidden is not None and hidden.shape[0] == kept:  # LAST capture (the graph's) prunes it too
            out.hidden_states = hidden.new_empty((rows, *hidden.shape[1:])).index_copy_(0, select, hidden)
        return out


def draft_extend_logits_rows(spec_worker) -> str:
    """``"last-accepted"`` where :func:`use_last_accepted_logits` wrapped the draft's logits
    processor, else ``"all"``; part of the step-cost cache key (a table timed without it
    was read by a server with it on an H100, 2026-12-08)."""
    model = spec_worker.draft_worker.draft_runner.model
    return (
        "last-accepted"
        if isinstance(getattr(model, "logits_processor", None), LogitsAtLastAccepted)
        else "all"
    )


def use_last_accepted_logits(spec_worker) -> str:
    """Wrap the draft model's logits processor in :class:`LogitsAtLastAccepted` (before
    the draft-extend graph is captured, which records it). Returns a note for the log."""
    model = spec_worker.draft_worker.draft_runner.model
    inner = getattr(model, "logits_processor", None)
    if isinstance(inner, LogitsAtLastAccepted):
        return "already in place"
    if not isinstance(inner, LogitsProcessor):
        return f"not used: the draft model ({type(model).__name__}) has no SGLang logits processor to wrap"
    model.logits_processor = LogitsAtLastAccepted(inner)
    return (
        f"the draft extend after each verify computes the draft's logits at each request's last accepted "
        f"position only (1 of {spec_worker.server_args.speculative_num_draft_tokens} positions per request)"
    )


def _recapture_if_owning_decode_graph(runner, recapture: Callable[[], None]) -> Callable[[], None]:
    def recapture_decode_graph() -> None:
        graph = runner.decode_cuda_graph_runner
        if runner.is_draft_worker and (graph is None or graph is getattr(runner, "eager_runner", None)):
            return
        recapture()

    return recapture_decode_graph


def spec_forward_kwargs(on_publish, grammar_barrier, pp_proxy_tensors) -> dict:
    """Keyword arguments for ``EAGLEWorkerV2.forward_batch_generation`` (0.5.17 rejects
    ``pp_proxy_tensors``, so it is passed only where the installed signature has it)."""
    kwargs = {"on_publish": on_publish, "grammar_barrier": grammar_barrier}
    if "pp_proxy_tensors" in _SPEC_FORWARD_PARAMS:
        kwargs["pp_proxy_tensors"] = pp_proxy_tensors
    return kwargs


# A request's ``req_to_token`` row: ``req.kv.req_pool_idx`` on 0.5.23,
# ``req.req_pool_idx`` on 0.5.17. Resolved once: the catch-up reads it for every
# request of every plain step.
request_pool_index: Callable[[Req], int] = operator.attrgetter(
    "kv.req_pool_idx" if _has_attribute(ReqKvInfo, "req_pool_idx") else "req_pool_idx"
)


def request_pool_indices(reqs) -> list[int]:
    """The ``req_to_token`` row of each request."""
    return list(map(request_pool_index, reqs))


def set_optional_batch_fields(batch: ScheduleBatch, **values) -> None:
    """Set those of ``values`` that are fields of the installed ``ScheduleBatch``."""
    for name, value in values.items():
        if name in OPTIONAL_BATCH_FIELDS:
            setattr(batch, name, value)


def draft_extend_contexts(spec_worker) -> contextlib.ExitStack:
    """The context managers the installed ``eagle_worker_v2`` enters around a draft
    extend: the draft tensor-parallel context, the speculative MoE backend contexts and
    the ``draft_extend`` trace span."""
    draft_worker = spec_worker.draft_worker
    stack = contextlib.ExitStack()
    if hasattr(draft_worker, "parallel_layout"):
        stack.enter_context(eagle_worker_v2.draft_tp_context(draft_worker.parallel_layout))
    else:
        stack.enter_context(draft_worker.draft_tp_context(draft_worker.draft_runner.tp_group))
    stack.enter_context(eagle_worker_v2.speculative_moe_backend_context())
    stack.enter_context(eagle_worker_v2.speculative_moe_a2a_backend_context())
    stack.enter_context(eagle_worker_v2.spec_stage_span("draft_extend"))
    return stack


# --------------------------------------------------------------------- registration
def is_registered(name: str) -> bool:
    return spec_registry.get_spec(name) is not None


def register_algorithm(
    name: str, spec_class: type, *, validate_server_args: Callable, worker_factory: Callable
):
    """Register ``name`` with SGLang's speculative-algorithm registry."""
    SpeculativeAlgorithm.register(
        name, supports_overlap=True, validate_server_args=validate_server_args, spec_class=spec_class
    )(worker_factory)


def register_cli_args_hook(add_arguments: Callable[[Any], None]) -> None:
    """Add arguments to SGLang's server parser (both launchers, and --config files)."""

    def after_add_cli_args(result, parser, *args, **kwargs):
        add_arguments(parser)
        return result

    HookRegistry.register(
        "sglang.srt.server_args.ServerArgs.add_cli_args", after_add_cli_args, HookType.AFTER
    )


def register_parsed_args_hook(check: Callable[[Any, Any], None]) -> None:
    """Call ``check(server_args, namespace)`` once the command line became ServerArgs
    (``ServerArgs.from_cli_args``, both launchers): what the plugin must say about flags
    it added whatever the algorithm."""

    def after_from_cli_args(server_args, *args, **kwargs):
        check(server_args, args[-1] if args else kwargs.get("args"))
        return server_args

    HookRegistry.register(
        "sglang.srt.server_args.ServerArgs.from_cli_args", after_from_cli_args, HookType.AFTER
    )


def new_future_map(device, algorithm, req_to_token_pool, *args, **kwargs):
    """The overlap scheduler's FutureMap for ``algorithm`` (our spec class instance)."""
    return overlap_utils.FutureMap(device, algorithm, req_to_token_pool, *args, **kwargs)


# ------------------------------------------------------------------------ accessors
def tensor_parallel_rank() -> int:
    return parallel_state.get_tensor_model_parallel_rank()


def agree_across_tensor_parallel_ranks(obj):
    """``obj`` as the first TP rank has it, on every TP rank (a broadcast over the TP
    group's CPU group; every rank must call it at the same point)."""
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return obj
    return parallel_state.get_tp_group().broadcast_object(obj, src=0)


def gather_across_tensor_parallel_ranks(obj) -> list:
    """Every TP rank's ``obj``, in rank order, on every TP rank (an all-gather over the TP
    group's CPU group; every rank must call it at the same point)."""
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return [obj]
    return parallel_state.get_tp_group().all_gather_object(obj)


def accept_counters(batch: ScheduleBatch) -> list[tuple[object, int, int]]:
    """``(rid, correct drafts, verify steps)`` of each request: the scheduler's host
    counters (identical on every TP rank), advanced by every speculative and plain step."""
    return [(req.rid, req.spec_num_correct_drafts, req.spec_verify_ct) for req in batch.reqs]


def metrics_enabled(server_args) -> bool:
    return bool(getattr(server_args, "enable_metrics", False))


def model_path(server_args) -> str:
    return str(server_args.model_path)


def served_model_name(server_args) -> str:
    return str(getattr(server_args, "served_model_name", None) or getattr(server_args, "model_path", ""))


def is_decode_step(batch: ScheduleBatch) -> bool:
    """A pure decode step: not prefill, not mixed prefill+decode, not a DP idle step."""
    return batch.forward_mode.is_decode() and not batch.is_extend_in_batch


def is_idle_step(batch: ScheduleBatch) -> bool:
    return batch.forward_mode.is_idle()


def decode_batch_size(batch: ScheduleBatch) -> int:
    """Requests in the decode batch: ``len(batch.reqs)``, identical on every TP rank."""
    return len(batch.reqs)


def mean_context_len(batch: ScheduleBatch) -> float:
    """Mean KV length of the decode batch's requests, from host values identical on every
    TP rank (the requests' token lists; ``seq_lens_sum`` is often None at decode)."""
    reqs = batch.reqs
    if not reqs:
        return 0.0
    return sum(len(r.origin_input_ids) + len(r.output_ids) for r in reqs) / len(reqs)


def step_cost_key(spec_worker, grid) -> dict:
    """What a start-up step-cost table is valid for (``cost_cache``): the device, the
    target and draft, SGLang and plugin versions, the speculative shape, the parallel
    layout and the timed grid."""
    import torch

    from sglang_dynspec import __version__

    args = spec_worker.server_args
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {
        "device": device,
        "sglang": SGLANG_VERSION,
        "plugin": __version__,
        "target": str(args.model_path),
        "draft": str(args.speculative_draft_model_path),
        "dtype": str(target_hidden_dtype(spec_worker)),
        "spec": [args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens],
        "tp": parallel_state.get_tensor_model_parallel_world_size(),
        "attention": str(getattr(args, "attention_backend", None)),
        "verify_attention": verify_attention_kernel(spec_worker),
        "draft_extend_logits": draft_extend_logits_rows(spec_worker),
        "cuda_graph": not getattr(args, "disable_cuda_graph", False),
        "grid": [list(grid[0]), list(grid[1])],
    }


def prefill_forward_tokens(spec_worker) -> int:
    """The most tokens SGLang puts in one prefill forward: ``--chunked-prefill-size``, or
    ``--max-prefill-tokens`` where chunked prefill is off. SGLang leaves device memory
    for the activations of a forward of that size, so a draft catch-up forward held
    within it needs no memory SGLang did not plan for."""
    args = spec_worker.server_args
    chunk = args.chunked_prefill_size
    return int(chunk) if chunk is not None and chunk > 0 else int(args.max_prefill_tokens)


def max_running_requests(spec_worker) -> int:
    """The most requests a decode batch can hold: ``--max-running-requests`` when given,
    else the request pool's rows."""
    given = getattr(spec_worker.server_args, "max_running_requests", None)
    return int(given) if given else request_pool_size(spec_worker)


def draft_steps(server_args) -> int:
    """Draft steps per speculative step (``--speculative-num-steps``); a step accepts at
    most this many drafts plus the bonus token."""
    return int(server_args.speculative_num_steps)


def needs_per_token_penalties(batch: ScheduleBatch) -> bool:
    """True if a request of ``batch`` uses frequency, presence or repetition penalties.

    SGLang's EAGLE verify applies the penalties accumulated before the step to every
    drafted position ("a relaxed version of penalties for speculative decoding",
    ``eagle_utils.eagle_sample``), so the tokens accepted within one speculative step
    do not penalise each other; a plain step applies them per token, as a
    non-speculative server does. Host state, identical on every TP rank: the batch a
    worker gets carries the penalties accumulated for the forward
    (``SamplingBatchInfo.copy_for_forward`` drops the orchestrator), set exactly when a
    request needs them.
    """
    info = batch.sampling_info
    if info is None:
        return False
    if info.acc_additive_penalties is not None or info.acc_scaling_penalties is not None:
        return True
    orchestrator = info.penalizer_orchestrator
    return bool(orchestrator is not None and orchestrator.is_required)


def pending_tokens(draft_input: EagleDraftInput):
    """``[bs]`` the last target-sampled token of each request, not yet in the KV cache."""
    return draft_input.bonus_tokens


def target_hidden_width(spec_worker) -> int:
    """Width of the target hidden states the draft consumes (3H for EAGLE-3 aux mode)."""
    return int(eagle_utils.get_draft_input_from_target_hidden_dim(spec_worker.draft_worker.draft_runner))


def target_hidden_dtype(spec_worker):
    return spec_worker.target_worker.model_runner.model_config.dtype


def request_to_token_table(spec_worker):
    """``[pool_size, max_context]`` the KV slot of each request row's positions."""
    return spec_worker.req_to_token_pool.req_to_token


def request_pool_size(spec_worker) -> int:
    return int(request_to_token_table(spec_worker).shape[0])


def draft_passes(spec_worker, eager_from: int = 0) -> tuple[Callable, Callable]:
    """``(run_draft_extend, fill_draft_kv)`` bound to ``spec_worker`` (the catch-up's two
    passes); ``eager_from``: see :func:`fill_draft_kv`."""
    return (
        functools.partial(run_draft_extend, spec_worker),
        functools.partial(fill_draft_kv, spec_worker, eager_from=eager_from),
    )


# --------------------------------------------------------------------------- calls
def new_attention_backend(model_runner):
    """A new attention backend for the target, with its own workspace (graph capture
    initialises a backend's graph state, which must not clobber the verify graph's)."""
    saved = model_runner.init_new_workspace
    try:
        return model_runner._get_attention_backend(init_new_workspace=True)
    finally:
        model_runner.init_new_workspace = saved


def target_decode(spec_worker):
    """``run_target_decode`` bound to ``spec_worker``'s target (``plain_step.PlainDecoder``)."""
    target_worker = spec_worker.target_worker
    return functools.partial(run_target_decode, target_worker)


def run_target_decode(target_worker, batch: ScheduleBatch, draft_input, capture_hidden: bool):
    """One plain forward + sampling of the target model on ``batch`` (the fresh plain
    batch), its result shaped as the v2 scheduler expects a speculative step's
    (:func:`spec_shaped_result`; ``draft_input``: the speculative batch's draft state).
    Returns ``(result, aux_hidden)``.

    ``capture_hidden``: FULL capture, so ``aux_hidden`` holds the packed EAGLE-3
    auxiliary hidden states ``[bs, 3H]`` (as a verify forward returns them); else None
    and SGLang derives the capture mode from the batch.
    """
    mode = CaptureHiddenMode.FULL if capture_hidden else None
    out = target_worker.forward_batch_generation(batch, capture_hidden_mode=mode)
    aux_hidden = out.logits_output.hidden_states if out.logits_output is not None else None
    return spec_shaped_result(out, batch, draft_input), aux_hidden


def spec_shaped_result(out: GenerationBatchResult, plain_batch: ScheduleBatch, draft_input):
    """Shape a plain forward's result as the v2 scheduler expects a spec result.

    One token per request: ``accept_lens`` of ones, row stride 1, ``new_seq_lens`` =
    committed length + 1, and logprobs in the spec layout ``[bs, max_accept] = [bs, 1]``.
    ``accept_lens`` is made on the host: the scheduler only reads it there (both
    versions' ``copy_to_cpu`` pass a host tensor through and the result processor
    asserts it is on the host), so a plain step needs no fill kernel and no copy back.
    """
    next_tokens = out.next_token_ids  # [bs]
    bs = next_tokens.shape[0]
    out.accept_lens = torch.ones(bs, dtype=torch.int32)
    out.new_seq_lens = plain_batch.seq_lens  # [bs], a new tensor (see fresh_batch)
    out.speculative_num_draft_tokens = 1
    if hasattr(out, "speculative_output_stride"):  # not on every version
        out.speculative_output_stride = 1
    logits = out.logits_output
    if plain_batch.return_logprob and logits is not None and logits.next_token_logprobs is not None:
        logits.next_token_logprobs = logits.next_token_logprobs.view(-1, 1)
    out.next_draft_input = plain_step_draft_input(next_tokens, draft_input)
    # The overlap scheduler keeps the inputs of a launched forward alive for two
    # iterations; these are the tensors this step created.
    out.extra_keep_alive_refs = [plain_batch.input_ids, plain_batch.out_cache_loc, plain_batch.seq_lens]
    return out


def plain_step_draft_input(next_tokens: torch.Tensor, previous) -> EagleDraftInput:
    """The spec state handed to the next step after a plain step.

    ``next_tokens`` becomes the pending token, as a verify step's bonus would. The
    draft's top-k and hidden state are carried over from the last speculative step
    (``previous``), in both schedulers:

    * synchronous: batch filtering and merging slice ``topk_p``, ``topk_index`` and
      ``hidden_states`` unconditionally;
    * overlap: ``FutureMap.stash`` writes them back unconditionally on 0.5.17
      (``payload.topk_p.to(...)``: None crashes) and when present on 0.5.23. The
      incoming tensors were gathered from the FutureMap for this step, so writing
      them back keeps its rows as they were.
    """
    new = EagleDraftInput(
        bonus_tokens=next_tokens,
        capture_hidden_mode=CaptureHiddenMode.LAST,
        num_tokens_per_req=1,
        num_tokens_for_logprob_per_req=1,
    )
    new.topk_p = previous.topk_p
    new.topk_index = previous.topk_index
    new.hidden_states = previous.hidden_states
    new.draft_probs = previous.draft_probs
    return new


def run_draft_extend(spec_worker, extend_batch: ScheduleBatch, target_hidden, tail_tokens) -> EagleDraftInput:
    """Run the draft's prefill pass over ``extend_batch``; return its next-draft state.

    ``target_hidden`` ``[num_tokens, 3H]``: the target's aux hidden state at each
    extended position; ``tail_tokens`` ``[bs]``: each request's pending token. The
    pass (``EagleDraftWorker._draft_extend_for_prefill``, the one that follows a
    target prefill, same signature in both versions) rotates the inputs by one,
    writes the draft KV at ``extend_batch.out_cache_loc`` and returns ``topk_p``,
    ``topk_index`` and ``hidden_states`` of each request's last position.
    """
    with draft_extend_contexts(spec_worker):
        return spec_worker.draft_worker._draft_extend_for_prefill(extend_batch, target_hidden, tail_tokens)


def draft_last_layer(spec_worker):
    """The EAGLE-3 draft's last decoder layer, whose MLP a buffer-full flush leaves out
    (``fill_draft_kv``), or None for a draft model of another class (then flushes run
    the whole forward)."""
    model = spec_worker.draft_worker.draft_runner.model
    if not isinstance(model, LlamaForCausalLMEagle3):
        return None
    layer = model.model.layers[-1]
    return layer if isinstance(getattr(layer, "mlp", None), torch.nn.Module) else None


class MlpAtRows(torch.nn.Module):
    """Stands in for the draft's last MLP during a flush: ``mlp`` at ``rows`` (the
    positions whose proposal the flush compares with the target's token), the input
    passed through everywhere else (None: at no row).

    Why this is safe: every draft K/V a forward writes is computed before the last
    layer's MLP (layer ``i``'s K and V come from its input, which the MLPs of layers
    before ``i`` produce), and the last MLP's output feeds only the final norm, the
    logits and the captured hidden state, which a flush does not use except at the
    compared rows. Leaving it out removes most of a one-layer draft's arithmetic per
    replayed position (its MLP is about 60% of it on the Llama-3.1-8B draft)."""

    def __init__(self, mlp: torch.nn.Module, rows: torch.Tensor | None):
        super().__init__()
        self.mlp, self.rows = mlp, rows

    def forward(self, hidden: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if self.rows is None or self.rows.numel() == 0:
            return hidden
        return hidden.index_copy(0, self.rows, self.mlp(hidden.index_select(0, self.rows), *args, **kwargs))


@contextlib.contextmanager
def last_mlp_only_at(layer, rows: torch.Tensor | None) -> Iterator[None]:
    """Within the block ``layer.mlp`` is :class:`MlpAtRows` (``layer``: from
    ``draft_last_layer``; None: nothing changes)."""
    if layer is None:
        yield
        return
    mlp = layer.mlp
    layer.mlp = MlpAtRows(mlp, rows)
    try:
        yield
    finally:
        layer.mlp = mlp


@contextlib.contextmanager
def draft_graph_off_from(spec_worker, num_tokens: int, eager_from: int) -> Iterator[None]:
    """Within the block the draft's forwards run eagerly, outside SGLang's draft prefill
    CUDA graph, if ``num_tokens`` is at least ``eager_from`` (0: never). That graph
    replays the draft's last MLP at every row as captured, so :class:`MlpAtRows` takes
    nothing off a forward it covers (up to 8,192 tokens on the H200 with SGLang 0.5.17;
    ``config.EAGER_DRAFT_TOKENS_ENV``). Both versions' ``ModelRunner._forward_raw`` run an
    EXTEND eagerly when the runner's ``prefill_cuda_graph_runner`` is None."""
    runner = spec_worker.draft_worker.draft_runner
    graph = getattr(runner, "prefill_cuda_graph_runner", None)
    if not eager_from or num_tokens < eager_from or graph is None:
        yield
        return
    runner.prefill_cuda_graph_runner = None
    try:
        yield
    finally:
        runner.prefill_cuda_graph_runner = graph


@contextlib.contextmanager
def draft_last_mlp_only_at(
    spec_worker, rows: torch.Tensor | None, num_tokens: int, eager_from: int
) -> Iterator[None]:
    """Within the block the draft's last MLP runs only at ``rows`` (:func:`last_mlp_only_at`),
    and a forward of ``num_tokens`` runs outside the draft's prefill graph from ``eager_from``
    tokens (:func:`draft_graph_off_from`), where that cut takes effect. A draft model of
    another class: nothing changes (no cut, so no reason to leave the graph)."""
    layer = draft_last_layer(spec_worker)
    if layer is None:
        yield
        return
    with draft_graph_off_from(spec_worker, num_tokens, eager_from), last_mlp_only_at(layer, rows):
        yield


def extend_last_rows(batch: ScheduleBatch) -> torch.Tensor | None:
    """``[bs]`` the index of each request's last token in a prefill or mixed batch's
    flat token layout (the layout of SGLang's draft pass after the target's prefill),
    on the batch's device; None for a batch without extend lengths (idle)."""
    lens = batch.extend_lens
    if not lens or batch.input_ids is None:
        return None
    # Through pinned memory: a plain ``.to(device)`` would synchronize the stream at
    # every prefill and mixed step (to_device).
    return to_device([end - 1 for end in itertools.accumulate(lens)], torch.int64, batch.input_ids.device)


@contextlib.contextmanager
def draft_mlp_at_last_rows(spec_worker, batch: ScheduleBatch, eager_from: int = 0) -> Iterator[None]:
    """Within the block (a prefill or mixed step through SGLang's EAGLE-3 path), the
    draft's last MLP runs only at each request's last token: the draft pass after the
    target's prefill keeps the logits and hidden state of that token alone (hidden
    capture LAST, no logprobs, in both versions' ``_draft_extend_for_prefill``), and
    every draft K/V comes before that MLP (:class:`MlpAtRows`). From ``eager_from``
    tokens (0: never) that pass runs outside the draft's prefill graph, where the cut
    takes effect (:func:`draft_graph_off_from`). An idle step: nothing changes."""
    rows = None if is_idle_step(batch) else extend_last_rows(batch)
    if rows is None:
        yield
        return
    with draft_last_mlp_only_at(spec_worker, rows, len(batch.input_ids), eager_from):
        yield


def fill_draft_kv(
    spec_worker,
    extend_batch: ScheduleBatch,
    target_hidden,
    tail_tokens,
    last_rows,
    compared_rows=None,
    *,
    eager_from: int = 0,
) -> None:
    """Write the draft KV of ``extend_batch``'s positions; no proposals.

    What ``run_draft_extend`` does, less what a catch-up that drops its proposals
    does not need: SGLang's pass rotates the inputs request by request (a Python loop
    of two launches per request, the host-bound part of a catch-up flush:
    benchmarks/profiles/plain-mode-3b-20261201.md) and then samples proposals. Here
    the rotation is one shifted copy and one scatter (``last_rows`` ``[bs]``: the
    index of each request's last position in ``extend_batch.input_ids``; the
    ``tail_tokens`` go there), the forward captures no hidden state and nothing is
    sampled. The draft forward itself is SGLang's: the same ``ForwardBatch`` and
    ``EagleDraftExtendInput`` as ``_draft_extend_for_prefill`` builds (multimodal
    inputs and DSA seeding, which a catch-up never has, aside), with the draft's last
    MLP computed only at ``compared_rows`` (``MlpAtRows``; the rows whose proposal a
    replay tally reads; None: none), outside the draft's prefill graph from
    ``eager_from`` tokens (:func:`draft_graph_off_from`; 0: wherever SGLang uses it).
    Under SGLang's KV canary (a debugging mode that wraps that forward) it defers to
    ``run_draft_extend``.
    """
    draft_worker = spec_worker.draft_worker
    draft_runner = draft_worker.draft_runner
    if getattr(draft_runner, "canary_manager", None) is not None:
        run_draft_extend(spec_worker, extend_batch, target_hidden, tail_tokens)
        return
    tokens = extend_batch.input_ids
    rotated = tokens.roll(-1, 0)  # each position's input is the next position's token ...
    rotated[last_rows] = tail_tokens.to(tokens.dtype)  # ... and each request's last, its pending one
    extend_batch.input_ids = rotated
    extend_batch.spec_info = EagleDraftExtendInput(
        hidden_states=target_hidden, num_tokens_per_req=1, num_tokens_for_logprob_per_req=1
    )
    with (
        draft_extend_contexts(spec_worker),
        draft_last_mlp_only_at(spec_worker, compared_rows, len(rotated), eager_from),
    ):
        forward_batch = ForwardBatch.init_new(
            extend_batch,
            draft_runner,
            capture_hidden_mode=CaptureHiddenMode.NULL,
            return_hidden_states_before_norm=False,
        )
        forward_batch.return_logprob = False
        draft_runner.forward(forward_batch)


class DraftTop1:
    """The draft's top-1 proposal at chosen positions of a draft forward, in target ids.

    What the draft would propose at a position is the argmax of its logits there. A
    catch-up's forward (an EXTEND) computes logits at each request's last position
    only, so :meth:`capture` records the input of the draft model's logits head (its
    final, normed hidden state, ``[num_tokens, H]``) at the chosen rows, through a
    forward pre-hook on the model's ``LogitsProcessor`` (removed on exit); :meth:`top1`
    then runs that same ``LogitsProcessor`` on those rows alone, as a DECODE batch (its
    ``lm_head``, tensor-parallel gather, scaling and softcap; in chunks, so at most
    ``CHUNK`` rows of logits exist at once), takes the argmax and maps draft-vocab ids
    to target ids through the draft worker's hot-token map (EAGLE-3's ``d2t``; None
    where the draft shares the target's vocabulary), as SGLang's draft does before
    proposing (``EagleDraftWorker.draft_forward``). Device tensors in and out.
    """

    CHUNK = 256

    def __init__(self, processor, lm_head, hot_token_id):
        self._processor, self._lm_head, self._hot = processor, lm_head, hot_token_id

    @contextlib.contextmanager
    def capture(self, rows: torch.Tensor) -> Iterator[list]:
        """Within the block, each forward of the draft model appends the logits head's
        input at ``rows`` to the yielded list (empty if the head did not run eagerly)."""
        seen: list = []

        def hook(_module, args, kwargs):
            hidden = args[1] if len(args) > 1 else kwargs["hidden_states"]
            seen.append(hidden.index_select(0, rows))

        handle = self._processor.register_forward_pre_hook(hook, with_kwargs=True)
        try:
            yield seen
        finally:
            handle.remove()

    def top1(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[n]`` target token ids: the draft's argmax at each row of ``hidden`` ``[n, H]``."""
        metadata = LogitsMetadata(forward_mode=ForwardMode.DECODE)
        ids = [
            self._processor(None, chunk, self._lm_head, metadata).next_token_logits.argmax(dim=-1)
            for chunk in hidden.split(self.CHUNK)
        ]
        ids = torch.cat(ids) if ids else torch.empty(0, dtype=torch.int64, device=hidden.device)
        return ids if self._hot is None else self._hot[ids]


def draft_top1(spec_worker) -> DraftTop1 | None:
    """The draft's top-1 reader (:class:`DraftTop1`), or None for a draft model without
    a ``LogitsProcessor`` and ``lm_head`` of its own (then nothing is compared)."""
    draft_worker = spec_worker.draft_worker
    model = draft_worker.draft_runner.model
    processor, lm_head = getattr(model, "logits_processor", None), getattr(model, "lm_head", None)
    if not isinstance(processor, LogitsProcessor) or lm_head is None:
        return None
    return DraftTop1(processor, lm_head, getattr(draft_worker, "hot_token_id", None))


def tag_step_mode(result: GenerationBatchResult, key: str, mode: str) -> None:
    """Report ``mode`` as this decode step's ``key`` for every request of ``result``.

    SGLang appends ``logits_output.customized_info[key][i]`` to request ``i``'s
    ``customized_info`` at each step and returns the list in the response's
    ``meta_info[key]`` (both versions). One entry per decode step, not per token: a
    non-streamed response has every entry; a streamed one is sliced by token offsets,
    so its chunks miss some.
    """
    logits = result.logits_output
    if logits is None:
        return
    n = int(result.next_token_ids.shape[0]) if result.next_token_ids is not None else 0
    info = dict(logits.customized_info or {})
    info[key] = [mode] * n
    logits.customized_info = info


# =================================================================================
# Step-cost calibration: synthetic speculative decode batches (step_timing.py).
#
# At start-up, before any request, both decode modes are timed on a decode batch
# built here, exactly as the scheduler hands one to the worker (SGLang 0.5.17 and
# 0.5.23 alike: a ScheduleBatch; neither has a ModelWorkerBatch). Nothing is being
# served yet, so every request-pool row and every KV slot is free: the batch points
# free rows at KV slots without allocating them (garbage KV is harmless: a request
# reads only positions it wrote) and puts the rows back on exit.
# =================================================================================


@dataclass
class SyntheticDecodeBatch:
    """A speculative decode batch of ``batch_size`` requests at ``context_len``
    committed tokens each, reusable for any number of steps (:meth:`next_batch`)."""

    batch: ScheduleBatch
    fields: dict  # the batch's dataclass fields as built, restored before each step
    draft_tensors: tuple  # bonus_tokens, topk_p, topk_index, hidden_states

    def next_batch(self) -> ScheduleBatch:
        """The batch as the scheduler would hand it in: every field as built (a
        speculative step rebinds several; the scheduler's ``_forward_isolation``
        restores them the same way) and a new draft input over the same tensors."""
        for name, value in self.fields.items():
            setattr(self.batch, name, value)
        self.batch.spec_info = _draft_input(*self.draft_tensors)
        return self.batch


def _draft_input(bonus_tokens, topk_p, topk_index, hidden_states) -> EagleDraftInput:
    # The state a prefill's draft extend (``_draft_extend_for_prefill``) hands the
    # first decode step, field for field (no rejection sampling: no draft_probs).
    draft_input = EagleDraftInput(
        bonus_tokens=bonus_tokens,
        capture_hidden_mode=CaptureHiddenMode.LAST,
        num_tokens_per_req=1,
        num_tokens_for_logprob_per_req=1,
    )
    draft_input.topk_p = topk_p
    draft_input.topk_index = topk_index
    draft_input.hidden_states = hidden_states
    return draft_input


def speculative_kv_reserve() -> int:
    """KV positions past the committed length that a speculative decode step may
    touch: what the scheduler reserves per request before each decode step
    (``eagle_prepare_for_decode``: draft, verify and draft-extend windows, doubled
    for the overlap lag; page-aligned trees included)."""
    return int(allocation_sizing.get_alloc_reserve_per_decode())


def synthetic_batch_limits(spec_worker) -> tuple[int, int]:
    """``(max batch size, max context length)`` of a synthetic decode batch: the free
    request-pool rows and the scheduler's max running requests; the model's context
    length, less the speculative reserve where a ``req_to_token`` row is too short
    to hold it."""
    pool = spec_worker.req_to_token_pool
    runner = spec_worker.target_worker.model_runner
    page = int(spec_worker.token_to_kv_pool_allocator.page_size)
    max_batch = min(len(pool.free_slots), int(runner.max_running_requests))
    row_width = int(pool.req_to_token.shape[1])
    max_context = min(int(runner.model_config.context_len), row_width - speculative_kv_reserve() - page)
    return max(0, max_batch), max(0, max_context)


def decode_graph_batch_sizes(spec_worker, plain_runner=None) -> list[int] | None:
    """The batch sizes every CUDA decode graph of both modes captured: the target's
    verify graph, the draft's decode and draft-extend graphs and ``plain_runner``
    (the plain decode graph's runner, or None). None when none is a CUDA graph (the
    steps run eagerly: CPU, or graphs disabled). A batch up to the largest replays
    the next captured size (padded); one beyond it runs eagerly, which serving never
    does, and with ``--disable-cuda-graph-padding`` only the captured sizes replay."""
    draft_worker = spec_worker.draft_worker
    runners = (
        spec_worker.target_worker.model_runner.decode_cuda_graph_runner,
        draft_worker.cuda_graph_runner,
        draft_worker.cuda_graph_runner_for_draft_extend,
        plain_runner,
    )
    captured = [set(r.capture_bs) for r in runners if isinstance(r, DecodeCudaGraphRunner)]
    if not captured:
        return None
    return sorted(set.intersection(*captured))


def _calibration_request(i: int, vocab_size: int) -> Req:
    # Greedy (temperature 0 becomes top_k 1), one prompt token: the worker reads a
    # request's rid, sampling parameters and feature flags, never its tokens.
    params = SamplingParams(max_new_tokens=1, temperature=0.0)
    params.normalize(None)
    return Req(
        rid=f"sglang-dynspec-calibration-{i}",
        origin_input_text="",
        origin_input_ids=array.array("q", [0]),
        sampling_params=params,
        vocab_size=vocab_size,
    )


@contextlib.contextmanager
def synthetic_decode_batch(spec_worker, batch_size: int, context_len: int) -> Iterator[SyntheticDecodeBatch]:
    """A speculative DECODE batch of ``batch_size`` greedy requests with
    ``context_len`` committed tokens each, as ``EAGLEWorkerV2.forward_batch_generation``
    and the plugin's plain step receive one on both SGLang versions. Only at start-up
    (every request-pool row and KV slot free); leaves no trace.

    * requests: real ``Req`` objects (``ForwardBatch.init_new`` and the sampling info
      read them), never added to the pool or a cache;
    * rows: the last ``batch_size`` free ``req_to_token`` rows (where the pool
      allocates from), not taken from its free list; each points positions
      ``[0, context_len + reserve)`` (:func:`speculative_kv_reserve`) at distinct KV
      slots, page-aligned, wrapping around the KV pool when the batch needs more
      slots than it has. The rows' previous contents are put back on exit; nothing is
      allocated from the KV allocator;
    * ``seq_lens`` = ``context_len`` with its host mirror (``seq_lens_cpu``,
      ``seq_lens_sum``), ``input_ids`` / ``out_cache_loc`` None: the state
      ``eagle_prepare_for_decode`` leaves;
    * greedy ``SamplingBatchInfo``, the forward-only copy the scheduler hands in;
    * ``spec_info``: an ``EagleDraftInput`` shaped as after a prefill: ``bonus_tokens``
      int32 ``[bs]``, ``topk_p`` float32 ``[bs, topk]`` (uniform), ``topk_index``
      int64 ``[bs, topk]``, ``hidden_states`` ``[bs, H]`` zeros in the draft's
      recurrent width and dtype.
    """
    if batch_size < 1 or context_len < 1:
        raise ValueError(f"batch_size and context_len must be >= 1, got {batch_size}, {context_len}")
    max_batch, max_context = synthetic_batch_limits(spec_worker)
    if batch_size > max_batch or context_len > max_context:
        raise ValueError(
            f"a synthetic decode batch of {batch_size} x {context_len} exceeds the limits "
            f"{max_batch} x {max_context} (free request rows or max running requests x context length)"
        )
    pool = spec_worker.req_to_token_pool
    allocator = spec_worker.token_to_kv_pool_allocator
    model_config = spec_worker.target_worker.model_runner.model_config
    device = pool.device
    req_to_token = pool.req_to_token

    rows = list(pool.free_slots[-batch_size:])
    page = int(allocator.page_size)
    slots = int(allocator.size) // page * page  # usable KV slots: [page, page + slots)
    span = -(-(context_len + speculative_kv_reserve()) // page) * page  # positions per row, whole pages
    rows_device = torch.tensor(rows, dtype=torch.int64, device=device)
    positions = torch.arange(batch_size * span, dtype=torch.int64, device=device)
    saved = req_to_token[rows_device, :span].clone()
    req_to_token[rows_device, :span] = (
        (page + positions % slots).view(batch_size, span).to(req_to_token.dtype)
    )
    try:
        vocab_size = int(model_config.vocab_size)
        reqs = [_calibration_request(i, vocab_size) for i in range(batch_size)]
        batch = ScheduleBatch.init_new(
            reqs=reqs,
            req_to_token_pool=pool,
            token_to_kv_pool_allocator=allocator,
            tree_cache=None,
            model_config=model_config,
            enable_overlap=False,  # read by the scheduler only
            spec_algorithm=spec_worker.target_worker.model_runner.spec_algorithm,
        )
        batch.forward_mode = ForwardMode.DECODE
        batch.req_pool_indices = rows_device
        batch.seq_lens = torch.full((batch_size,), context_len, dtype=torch.int64, device=device)
        batch.seq_lens_cpu = torch.full((batch_size,), context_len, dtype=torch.int64)
        batch.seq_lens_sum = batch_size * context_len
        batch.input_ids = None
        batch.out_cache_loc = None
        batch.multimodal_inputs = [None] * batch_size
        set_optional_batch_fields(
            batch,
            req_pool_indices_cpu=torch.tensor(rows, dtype=torch.int64),
            orig_seq_lens=batch.seq_lens.to(torch.int32),
        )
        batch.sampling_info = SamplingBatchInfo.from_schedule_batch(batch, vocab_size).copy_for_forward()

        topk = int(spec_worker.topk)
        hidden_size, hidden_dtype = eagle_utils.get_draft_recurrent_hidden_state_spec(
            spec_worker.draft_worker.draft_runner
        )
        draft_tensors = (
            (torch.arange(batch_size, dtype=torch.int32, device=device) % vocab_size),
            torch.full((batch_size, topk), 1.0 / topk, dtype=torch.float32, device=device),
            torch.arange(topk, dtype=torch.int64, device=device).expand(batch_size, topk).contiguous(),
            None
            if hidden_size is None
            else torch.zeros((batch_size, int(hidden_size)), dtype=hidden_dtype, device=device),
        )
        fields = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
        yield SyntheticDecodeBatch(batch, fields, draft_tensors)
    finally:
        req_to_token[rows_device, :span] = saved


def run_speculative_decode(spec_worker, batch: ScheduleBatch) -> GenerationBatchResult:
    """SGLang's own speculative decode step on ``batch`` (draft, verify, draft extend),
    as ``DynamicEagleWorker`` runs it when it speculates, without the plugin's
    controller or catch-up."""
    return EAGLEWorkerV2.forward_batch_generation(spec_worker, batch, **spec_forward_kwargs(None, None, None))
