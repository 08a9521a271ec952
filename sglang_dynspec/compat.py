"""Every contact point with SGLang internals, in one module.

The rest of the package imports SGLang only through here, so an SGLang upgrade is a
change to this file. Supported: ``sglang>=0.5.17,<0.6``; tested on 0.5.17 (the H200)
and 0.5.23 (CI, CPU). Where the two differ, the difference is detected from the
installed code (a signature, an attribute), not from the version string, and is
named below.

Manifest of what we use, and why:

* ``SpeculativeAlgorithm`` (enum) and ``.register(...)``: register EAGLE3_DYNAMIC; the
  EAGLE3 member is the reference our spec class delegates every predicate to.
* ``spec_registry.CustomSpecAlgo`` / ``get_spec``: base class of our spec class;
  idempotent registration.
* ``plugins.hook_registry.HookRegistry``: an AFTER hook on
  ``ServerArgs.add_cli_args`` adds our flags to SGLang's own parser.
* ``EAGLEWorkerV2``: the worker we subclass. Its ``forward_batch_generation`` takes
  ``(batch, on_publish, grammar_barrier)`` on 0.5.17 and also ``pp_proxy_tensors``
  on 0.5.23 (``spec_forward_kwargs``).
* ``ScheduleBatch`` fields ``reqs, forward_mode, spec_info, spec_algorithm, input_ids,
  out_cache_loc, seq_lens, seq_lens_cpu, seq_lens_sum, req_pool_indices,
  return_logprob, has_grammar, enable_overlap`` (same names in both versions), and
  for the catch-up's EXTEND batch (``catch_up.build_catch_up_batch``) ``prefix_lens,
  extend_lens, extend_num_tokens, extend_logprob_start_lens,
  extend_input_logprob_token_ids, top_logprobs_nums, token_ids_logprobs,
  multimodal_inputs, input_embeds, decoding_reqs, chunked_req, is_extend_in_batch,
  can_run_decode_cuda_graph, sampling_info`` (both versions) and, where present,
  ``req_pool_indices_cpu, orig_seq_lens, max_seq_len_host,
  chunked_req_next_prompt_token``. A request's ``req_to_token`` row is
  ``request_pool_index`` (moved in 0.5.23).
* ``EagleDraftInput``: the spec state carried between steps; its pending token is
  ``bonus_tokens`` in both versions.
* ``GenerationBatchResult`` fields ``next_token_ids, accept_lens, new_seq_lens,
  speculative_num_draft_tokens, next_draft_input, extra_keep_alive_refs,
  logits_output.next_token_logprobs``.
* ``ModelRunner.decode_cuda_graph_runner``: the target's only decode graph is a
  TARGET_VERIFY graph when speculation is configured; a plain decode must not
  replay it (``plain_decode_graphs``).
* ``TpModelWorker.forward_batch_generation(batch, capture_hidden_mode=...)``: the
  target's plain forward + sampling; FULL capture returns the packed EAGLE-3
  auxiliary hidden states ``[bs, 3H]`` the draft catch-up needs.
* ``EagleDraftWorker._draft_extend_for_prefill(batch, target_hidden_states,
  next_token_ids)`` (same signature in both versions): the draft pass that follows
  a target prefill; the catch-up replays plain-mode positions through it, under the
  context managers the installed ``eagle_worker_v2`` itself uses around it
  (``draft_extend_contexts``: the draft-TP context is a module function of the
  parallel layout on 0.5.23 and a worker attribute on 0.5.17).
* ``get_draft_input_from_target_hidden_dim(draft_runner)`` (``eagle_utils``, both):
  the width of those auxiliary hidden states.
* ``SamplingBatchInfo`` per-request tensors (``temperatures``, ``top_ps``,
  ``top_ks``, ``min_ps``, ``sampling_seed``): sliced for the catch-up's requests.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import logging
from typing import Any, Callable, Iterator, Optional

import sglang
import torch
from sglang.srt.managers.schedule_batch import ScheduleBatch
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
from sglang.srt.plugins.hook_registry import HookRegistry, HookType
from sglang.srt.speculative.eagle_info import EagleDraftInput
from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang.srt.speculative.spec_registry import CustomSpecAlgo, get_spec

logger = logging.getLogger("sglang_dynspec")

SGLANG_VERSION: str = getattr(sglang, "__version__", "unknown")

__all__ = [
    "CaptureHiddenMode",
    "CustomSpecAlgo",
    "EAGLEWorkerV2",
    "EagleDraftInput",
    "ForwardMode",
    "ScheduleBatch",
    "SGLANG_VERSION",
    "SpeculativeAlgorithm",
    "get_spec",
]


# --------------------------------------------------------------------------- checks
# Host symbols the plugin needs beyond the imports above (which fail loudly on their
# own). Checked when the server starts, so a missing one is a start-up error that
# names it, not an AttributeError in the middle of serving.
_REQUIRED_ATTRIBUTES = (
    (SpeculativeAlgorithm, "register"),
    (SpeculativeAlgorithm, "EAGLE3"),
    (SpeculativeAlgorithm.EAGLE3, "handle_server_args"),
    (EAGLEWorkerV2, "forward_batch_generation"),
    (EagleDraftInput, "bonus_tokens"),
)


def missing_host_symbols() -> list[str]:
    """Names of SGLang internals this plugin relies on that the installed SGLang lacks."""
    missing = []
    for owner, name in _REQUIRED_ATTRIBUTES:
        if not hasattr(owner, name) and name not in getattr(owner, "__dataclass_fields__", {}):
            missing.append(f"{getattr(owner, '__qualname__', owner)}.{name}")
    return missing


# ---------------------------------------------------------------- algorithm identity
# Methods of the enum that must NOT be answered as EAGLE3 would: constructors and
# class-level API, the worker factory (ours), and methods that take the algorithm
# itself as an argument to another object (defined explicitly below).
_NOT_DELEGATED = frozenset(
    {"from_string", "register", "create_worker", "create_future_map", "get_platform_worker_cls"}
)


def eagle3_method_names() -> list[str]:
    """Public methods of SpeculativeAlgorithm that our spec class answers as EAGLE3.

    Derived from the installed enum, not listed by hand, so a predicate added in a
    later SGLang (``is_*``, ``supports_*``, ``need_topk`` ...) is covered without an edit.
    """
    names = []
    for name, value in vars(SpeculativeAlgorithm).items():
        if name.startswith("_") or name in _NOT_DELEGATED:
            continue
        if inspect.isfunction(value):
            names.append(name)
    return sorted(names)


def _answer_as_eagle3(name: str) -> Callable:
    reference = getattr(SpeculativeAlgorithm.EAGLE3, name)

    @functools.wraps(reference)
    def method(self, *args, **kwargs):
        return getattr(SpeculativeAlgorithm.EAGLE3, name)(*args, **kwargs)

    return method


def make_eagle3_like_spec_class(name: str) -> type:
    """A CustomSpecAlgo subclass that behaves exactly like the builtin EAGLE3.

    Every predicate (``is_eagle``, ``is_eagle3``, ``supports_mixed_chunk``,
    ``supports_grammar_overlap``, ``has_draft_kv``, ...), ``carries_draft_hidden_states``,
    ``need_topk``, ``build_disagg_draft_input`` and ``handle_server_args`` is answered
    by ``SpeculativeAlgorithm.EAGLE3``. The last one runs SGLang's own EAGLE-family
    argument resolution (automatic steps/topk/draft tokens, the draft checks, the
    max-running-requests default) without the plugin naming a private function.
    """
    body: dict[str, Any] = {m: _answer_as_eagle3(m) for m in eagle3_method_names()}

    def create_future_map(self, device, req_to_token_pool, *args, **kwargs):
        # The builtin passes the algorithm object into the FutureMap; pass ours.
        from sglang.srt.managers.overlap_utils import FutureMap

        return FutureMap(device, self, req_to_token_pool, *args, **kwargs)

    def get_platform_worker_cls(self):
        return None  # our factory picks the worker

    body.update(
        create_future_map=create_future_map,
        get_platform_worker_cls=get_platform_worker_cls,
        __doc__=f"{name}: answers every SpeculativeAlgorithm query as EAGLE3 does.",
    )
    return type(f"{name.title().replace('_', '')}Algorithm", (CustomSpecAlgo,), body)


def register_algorithm(name: str, *, validate_server_args: Callable, worker_factory: Callable) -> bool:
    """Register ``name`` once per process; return False if it already was."""
    if get_spec(name) is not None:
        return False
    SpeculativeAlgorithm.register(
        name,
        supports_overlap=True,
        validate_server_args=validate_server_args,
        spec_class=make_eagle3_like_spec_class(name),
    )(worker_factory)
    return True


def register_cli_args_hook(add_arguments: Callable[[Any], None]) -> None:
    """Add arguments to SGLang's server parser (both launchers, and --config files)."""

    def after_add_cli_args(result, parser, *args, **kwargs):
        add_arguments(parser)
        return result

    HookRegistry.register(
        "sglang.srt.server_args.ServerArgs.add_cli_args", after_add_cli_args, HookType.AFTER
    )


# --------------------------------------------------------------------- worker support
_SPEC_FORWARD_PARAMS = frozenset(inspect.signature(EAGLEWorkerV2.forward_batch_generation).parameters)


def spec_forward_kwargs(on_publish, grammar_barrier, pp_proxy_tensors) -> dict:
    """Keyword arguments for ``EAGLEWorkerV2.forward_batch_generation``.

    0.5.23 added ``pp_proxy_tensors``; 0.5.17 rejects it (TypeError), so it is passed
    only where the installed signature has it.
    """
    kwargs = {"on_publish": on_publish, "grammar_barrier": grammar_barrier}
    if "pp_proxy_tensors" in _SPEC_FORWARD_PARAMS:
        kwargs["pp_proxy_tensors"] = pp_proxy_tensors
    return kwargs


def is_plain_decode_candidate(batch: ScheduleBatch) -> bool:
    """A pure decode step: not prefill, not mixed prefill+decode, not a DP idle step."""
    mode = batch.forward_mode
    return mode.is_decode() and not batch.is_extend_in_batch


def tensor_parallel_rank() -> int:
    from sglang.srt.distributed.parallel_state import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank()


def metrics_enabled(server_args) -> bool:
    return bool(getattr(server_args, "enable_metrics", False))


def served_model_name(server_args) -> str:
    return str(getattr(server_args, "served_model_name", None) or getattr(server_args, "model_path", ""))


def decode_batch_size(batch: ScheduleBatch) -> int:
    """Requests in the decode batch: ``len(batch.reqs)``, identical on every TP rank."""
    return len(batch.reqs)


class PlainDecodeGraph:
    """A plain DECODE CUDA graph runner for the target, with its own attention backend.

    With speculation configured, the target's only decode graph is a TARGET_VERIFY
    graph ``num_draft_tokens`` wide. This one is captured after it, while the model
    runner briefly reports no speculative algorithm: that makes SGLang's own
    ``DecodeCudaGraphRunner`` capture forward mode DECODE, one token per request,
    with no spec input (the same construction SGLang's ``--speculative-adaptive``
    uses for its extra verify graphs). The attention backend is new because
    capturing initialises the backend's graph state, which would otherwise clobber
    the verify graph's buffers.
    """

    def __init__(self, runner, attn_backend, memory_bytes: int):
        self.runner = runner
        self.attn_backend = attn_backend
        self.memory_bytes = memory_bytes  # device memory the capture took


def _full_hidden_runner_class(base: type) -> type:
    """``base`` with its hidden-state capture pinned to FULL.

    A decode graph captures the hidden-state mode the server was started with
    (``return_hidden_states_mode``, NULL unless hidden states are requested), and a
    forward that asks for more does not replay it. The draft catch-up needs the
    target's auxiliary hidden states from every plain step, so the plain graph must
    produce them. BaseRunner assigns the attribute in ``__init__``; the setter
    ignores that assignment.
    """

    def get_mode(self):
        return CaptureHiddenMode.FULL

    def set_mode(self, value):
        pass

    return type(
        "PlainDecodeCudaGraphRunner",
        (base,),
        {"return_hidden_states_mode": property(get_mode, set_mode), "__doc__": _full_hidden_runner_class.__doc__},
    )


def capture_plain_decode_graph(model_runner, capture_hidden: bool = True) -> Optional[PlainDecodeGraph]:
    """Capture the plain decode graph; None when the target runs without CUDA decode graphs.

    ``capture_hidden``: the graph also outputs the packed auxiliary hidden states
    (needed by the draft catch-up).
    """
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner

    if not torch.cuda.is_available() or not isinstance(
        model_runner.decode_cuda_graph_runner, DecodeCudaGraphRunner
    ):
        # Graphs disabled, or another device's graph runner (CPU graphs, NPU...):
        # plain steps run eagerly.
        return None

    free_before = torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else 0
    saved_workspace_flag = model_runner.init_new_workspace
    try:
        attn_backend = model_runner._get_attention_backend(init_new_workspace=True)
    finally:
        model_runner.init_new_workspace = saved_workspace_flag
    saved_algorithm = model_runner.spec_algorithm
    model_runner.spec_algorithm = SpeculativeAlgorithm.NONE
    runner_cls = _full_hidden_runner_class(DecodeCudaGraphRunner) if capture_hidden else DecodeCudaGraphRunner
    try:
        runner = runner_cls(model_runner, attn_backend=attn_backend)  # captures
    finally:
        model_runner.spec_algorithm = saved_algorithm
    free_after = torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else 0
    return PlainDecodeGraph(runner, attn_backend, max(0, free_before - free_after))


# The model runner attribute holding the event the scheduler's WAR barrier waits on
# after a forward (0.5.23 renamed it), and the worker property naming that runner.
_READ_DONE_EVENT = (
    "shared_read_done_event" if hasattr(EAGLEWorkerV2, "last_shared_read_runner")
    else "war_fastpath_read_done_event"
)
WAR_RUNNER_PROPERTY = (
    "last_shared_read_runner" if hasattr(EAGLEWorkerV2, "last_shared_read_runner")
    else "war_fastpath_runner"
)


@contextlib.contextmanager
def plain_decode_graphs(model_runner, plain_graph: Optional[PlainDecodeGraph]) -> Iterator[None]:
    """Route the target's decode forward away from its TARGET_VERIFY CUDA graph.

    With speculation configured, ``decode_cuda_graph_runner`` holds a graph captured
    for ``num_draft_tokens`` tokens per request, and ``can_run_graph`` does not check
    the forward mode: a plain DECODE would be replayed on it and fail with "size of
    tensor a (bs*ndt) must match ... (bs)". For one forward, the plain graph and its
    backend are swapped in (or no graph: eager). Race-free because the scheduler runs
    one forward at a time in this process; ``finally`` restores both.
    """
    saved = (model_runner.decode_cuda_graph_runner, model_runner.attn_backend)
    if plain_graph is None:
        model_runner.decode_cuda_graph_runner = None
    else:
        model_runner.decode_cuda_graph_runner = plain_graph.runner
        model_runner.attn_backend = plain_graph.attn_backend
    # A read-done event left by an earlier verify replay would let the scheduler's
    # WAR barrier pass before this forward has read req_to_token: start clean.
    setattr(model_runner, _READ_DONE_EVENT, None)
    try:
        yield
    finally:
        model_runner.decode_cuda_graph_runner, model_runner.attn_backend = saved


def run_target_decode(target_worker, batch: ScheduleBatch, capture_hidden: bool):
    """One plain forward + sampling of the target model on ``batch``.

    ``capture_hidden``: FULL capture, so ``logits_output.hidden_states`` holds the
    packed EAGLE-3 auxiliary hidden states ``[bs, 3H]`` (as a verify forward returns
    them). Otherwise SGLang derives the mode from the batch (hidden states only when
    a request asked for them).
    """
    mode = CaptureHiddenMode.FULL if capture_hidden else None
    return target_worker.forward_batch_generation(batch, capture_hidden_mode=mode)


def target_hidden_width(spec_worker) -> int:
    """Width of the target hidden states the draft consumes (3H for EAGLE-3 aux mode)."""
    from sglang.srt.speculative.eagle_utils import get_draft_input_from_target_hidden_dim

    return int(get_draft_input_from_target_hidden_dim(spec_worker.draft_worker.draft_runner))


def target_hidden_dtype(spec_worker) -> torch.dtype:
    return spec_worker.target_worker.model_runner.model_config.dtype


def request_pool_index(req) -> int:
    """The request's ``req_to_token`` row: ``req.kv.req_pool_idx`` on 0.5.23,
    ``req.req_pool_idx`` on 0.5.17."""
    kv = getattr(req, "kv", None)
    if kv is not None and hasattr(kv, "req_pool_idx"):
        return kv.req_pool_idx
    return req.req_pool_idx


def request_pool_size(spec_worker) -> int:
    return int(spec_worker.req_to_token_pool.req_to_token.shape[0])


_SAMPLING_ROW_FIELDS = ("temperatures", "top_ps", "top_ks", "min_ps", "sampling_seed")


def slice_sampling_info(sampling_info, rows: torch.Tensor):
    """A shallow copy of ``sampling_info`` keeping ``rows`` of its per-request tensors.

    Only what the draft's proposal step reads (temperatures and seeds, under
    rejection sampling) has to be right; penalties, biases and grammar masks apply
    to the target's sampling, which the catch-up does not run.
    """
    if sampling_info is None:
        return None
    sliced = copy.copy(sampling_info)
    for name in _SAMPLING_ROW_FIELDS:
        value = getattr(sampling_info, name, None)
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            setattr(sliced, name, value[rows])
    sliced.grammars = None
    return sliced


def draft_extend_contexts(spec_worker) -> contextlib.ExitStack:
    """The context managers the installed EAGLEWorkerV2 enters around a draft extend.

    Taken from the ``eagle_worker_v2`` module itself, so they are the ones that
    version uses: the draft tensor-parallel context (a function of the draft's
    parallel layout on 0.5.23, a worker attribute taking the TP group on 0.5.17),
    the speculative MoE backend contexts and the ``draft_extend`` trace span.
    """
    from sglang.srt.speculative import eagle_worker_v2 as host

    draft_worker = spec_worker.draft_worker
    stack = contextlib.ExitStack()
    if hasattr(draft_worker, "parallel_layout"):
        stack.enter_context(host.draft_tp_context(draft_worker.parallel_layout))
    else:
        stack.enter_context(draft_worker.draft_tp_context(draft_worker.draft_runner.tp_group))
    stack.enter_context(host.speculative_moe_backend_context())
    stack.enter_context(host.speculative_moe_a2a_backend_context())
    stack.enter_context(host.spec_stage_span("draft_extend"))
    return stack


def run_draft_extend(spec_worker, extend_batch: ScheduleBatch, target_hidden: torch.Tensor,
                     tail_tokens: torch.Tensor) -> EagleDraftInput:
    """Run the draft's prefill pass over ``extend_batch``; return its next-draft state.

    ``target_hidden`` ``[num_tokens, 3H]``: the target's aux hidden state at each
    extended position; ``tail_tokens`` ``[bs]``: each request's pending token (the
    token after its last extended position). The pass rotates the inputs by one,
    writes the draft KV at ``extend_batch.out_cache_loc`` and returns ``topk_p``,
    ``topk_index`` and ``hidden_states`` of each request's last position.
    """
    with draft_extend_contexts(spec_worker):
        return spec_worker.draft_worker._draft_extend_for_prefill(
            extend_batch, target_hidden, tail_tokens
        )


class DeviceTimer:
    """Wall time of work queued on the current device stream, read without a sync.

    On CUDA two events bracket the work and ``seconds()`` returns None until the
    second has completed; elsewhere the work ran synchronously and host time is it.
    """

    def __init__(self, start_event, start_time: float):
        self._start, self._end = start_event, None
        self._t0, self._t1 = start_time, None

    @classmethod
    def start(cls, device) -> "DeviceTimer":
        import time

        if torch.device(device).type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return cls(event, 0.0)
        return cls(None, time.perf_counter())

    @classmethod
    def marker(cls, device) -> "DeviceTimer":
        """Completes (``seconds()`` is not None) once the work queued so far has run."""
        timer = cls.start(device)
        timer.stop()
        return timer

    def stop(self) -> None:
        import time

        if self._start is not None:
            self._end = torch.cuda.Event(enable_timing=True)
            self._end.record()
        else:
            self._t1 = time.perf_counter()

    def seconds(self) -> Optional[float]:
        if self._start is None:
            return None if self._t1 is None else self._t1 - self._t0
        if self._end is None or not self._end.query():
            return None
        return self._start.elapsed_time(self._end) / 1000.0


_DRAFT_STATE_FIELDS = ("topk_p", "topk_index", "hidden_states", "draft_probs")


def with_draft_state_rows(draft_input: EagleDraftInput, rows: torch.Tensor,
                          fresh: EagleDraftInput) -> None:
    """Point ``draft_input``'s draft state at new tensors whose ``rows`` come from ``fresh``.

    Out of place: the old tensors may be rows gathered from the overlap scheduler's
    FutureMap or shared with a previous result. Only ``draft_input``'s attributes
    are rebound (it is this step's object), never a tensor written.
    """
    for name in _DRAFT_STATE_FIELDS:
        old, new = getattr(draft_input, name, None), getattr(fresh, name, None)
        if old is None or new is None:
            continue
        setattr(draft_input, name, old.index_copy(0, rows, new.to(old.dtype)))


def pending_tokens(draft_input: EagleDraftInput) -> torch.Tensor:
    """# [bs] the last target-sampled token of each request, not yet in the KV cache."""
    return draft_input.bonus_tokens


def plain_step_draft_input(next_tokens: torch.Tensor, previous: EagleDraftInput) -> EagleDraftInput:
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


def finish_plain_result(out, plain_batch: ScheduleBatch, draft_input: EagleDraftInput):
    """Shape a plain forward's result as the v2 scheduler expects a spec result.

    One token per request: ``accept_lens`` of ones (a tensor: the scheduler copies it
    to the host and asserts it is there), row stride 1, ``new_seq_lens`` = committed
    length + 1, and logprobs in the spec layout ``[bs, max_accept] = [bs, 1]``.
    """
    next_tokens = out.next_token_ids  # [bs]
    bs = next_tokens.shape[0]
    out.accept_lens = torch.ones(bs, dtype=torch.int32, device=next_tokens.device)
    out.new_seq_lens = plain_batch.seq_lens  # [bs], a new tensor (see fresh_batch)
    out.speculative_num_draft_tokens = 1
    if hasattr(out, "speculative_output_stride"):
        out.speculative_output_stride = 1
    logits = out.logits_output
    if plain_batch.return_logprob and logits is not None and logits.next_token_logprobs is not None:
        logits.next_token_logprobs = logits.next_token_logprobs.view(-1, 1)
    out.next_draft_input = plain_step_draft_input(next_tokens, draft_input)
    # The overlap scheduler keeps the inputs of a launched forward alive for two
    # iterations; these are the tensors this step created.
    out.extra_keep_alive_refs = [plain_batch.input_ids, plain_batch.out_cache_loc, plain_batch.seq_lens]
    return out
