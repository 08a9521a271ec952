"""SGLang plugin of the CPU test bed: runs the spec-v2 overlap scheduler on CPU.

Registered as entry point ``dynspec_testbed`` in group ``sglang.srt.plugins`` by the
``sglang-dynspec-testbed`` distribution (``testbed/``; a serving install of
``sglang-dynspec`` does not have it), so SGLang's ``load_plugins()`` runs
``register()`` in the launcher *and* in every spawned scheduler process. It still
changes nothing unless asked (``SGLANG_DYNSPEC_TESTBED=1``), so that installing the
test bed for the tests never alters another server on the same machine.

Environment variables (booleans read with ``sglang_dynspec.config.env_bool``:
1/true/yes/on or 0/false/no/off)
    ``SGLANG_DYNSPEC_TESTBED=1``
        Arms the plugin. ``python -m dynspec_testbed.serve`` sets it.
    ``SGLANG_DYNSPEC_TESTBED_DRAFT_KV_DIR=<dir>``
        Writes the draft KV rows of every finished request under ``<dir>``
        (``draft_kv.py``), for the catch-up tests.
    ``SGLANG_DYNSPEC_TESTBED_HOST_READS=<file>``
        Counts the tensor reads to the host made by the plugin's own code during
        its steps (``host_reads.py``), for the no-host-sync test.
    ``SGLANG_DYNSPEC_TESTBED_SPLIT_KV_LOG=1``
        Logs once per process when SGLang's split-KV verify kernel runs
        (``verify_splitkv.VerifySplitKV.__call__``; the plugin's zeroed-scratch class
        inherits it), and once when the grouped-head verify kernel runs
        (``compat.grouped_verify.VerifyMLA.__call__``, which the plugin's
        float32-partials class inherits), so a test can tell those kernels from the
        prefill kernel they replace, which gives the same tokens.
    ``SGLANG_DYNSPEC_TESTBED_OVERLAP=1``
        Runs EAGLE-family speculative decoding (EAGLE, EAGLE3 and plugin
        algorithms whose spec class answers ``is_eagle()``, e.g. EAGLE3_DYNAMIC)
        with the overlap scheduler on CPU. SGLang turns overlap off on CPU for two
        reasons, each lifted here:

        * ``FutureMap._resolve_spec_extras`` (``managers/overlap_utils.py``) calls
          the Triton kernel ``gather_spec_extras``, which has no CPU driver. It is
          replaced by a PyTorch gather with the same contract.
        * ``_handle_eagle_family`` calls ``_disable_overlap_schedule_for_cpu``,
          which declares ``disable_overlap_schedule=True`` on any CPU server. That
          rule is skipped for EAGLE-family algorithms. Hooking the rule rather than
          ``_handle_eagle_family`` keeps working when a plugin's spec class imports
          ``_handle_eagle_family`` itself, since the rule is looked up as a module
          global at call time, and an explicit ``--disable-overlap-schedule`` still
          wins.

Tensor parallelism on the CPU (``--tp-size 2``, with ``SGLANG_CPU_OMP_THREADS_BIND``
giving each rank its cores): SGLang 0.5.23's process groups ask for a PyNccl
communicator unless an out-of-tree platform opts out, and on the CPU engine that fails
("Expected a cuda device, but got: cpu"). Once armed, the plugin makes
``init_model_parallel_group`` default ``use_pynccl`` to False, so the groups
communicate over gloo (their CPU group), as a CPU server must.

The patches go through SGLang's ``HookRegistry``, whose ``_propagate_patch``
also rebinds ``overlap_utils``' own ``from ... import gather_spec_extras``.
``serve.py`` checks after argument resolution that overlap really stayed on
(``assert_overlap_kept``); the PyTorch gather logs once per process when used.
"""

import logging
import os

import torch

from sglang_dynspec.config import env_bool

logger = logging.getLogger(__name__)

TESTBED_ENV = "SGLANG_DYNSPEC_TESTBED"
OVERLAP_ENV = "SGLANG_DYNSPEC_TESTBED_OVERLAP"
SPLIT_KV_LOG_ENV = "SGLANG_DYNSPEC_TESTBED_SPLIT_KV_LOG"
SPLIT_KV_RAN = "sglang_dynspec test bed: split-KV verify kernel ran"
GROUPED_VERIFY_RAN = "sglang_dynspec test bed: grouped-head verify kernel ran"

GATHER_SPEC_EXTRAS = "sglang.kernels.ops.speculative.gather_spec_extras.gather_spec_extras"
CPU_OVERLAP_RULE = "sglang.srt.arg_groups.speculative_hook._disable_overlap_schedule_for_cpu"
INIT_GROUP = "sglang.srt.distributed.parallel_state.init_model_parallel_group"

_registered = False
_gather_used = False


def overlap_requested() -> bool:
    return env_bool(TESTBED_ENV, False) and env_bool(OVERLAP_ENV, False)


def register() -> None:
    """Entry point. Idempotent: SGLang may call plugins more than once per process."""
    global _registered
    if _registered or not env_bool(TESTBED_ENV, False):
        return
    from dynspec_testbed import draft_kv, host_reads

    if os.environ.get(draft_kv.DUMP_DIR_ENV):
        draft_kv.register_hooks()
    if os.environ.get(host_reads.HOST_READS_ENV):
        host_reads.install_from_environ()
    if env_bool(SPLIT_KV_LOG_ENV, False):
        _log_split_kv_calls()
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(INIT_GROUP, _groups_without_pynccl, HookType.AROUND)
    if overlap_requested():
        HookRegistry.register(GATHER_SPEC_EXTRAS, gather_spec_extras_torch, HookType.REPLACE)
        HookRegistry.register(CPU_OVERLAP_RULE, _keep_overlap_for_eagle_family, HookType.AROUND)
    _registered = True


def _log_split_kv_calls() -> None:
    from sglang.kernels.ops.attention import verify_splitkv

    from sglang_dynspec.compat import grouped_verify

    _log_first_call(verify_splitkv.VerifySplitKV, SPLIT_KV_RAN)
    _log_first_call(grouped_verify.VerifyMLA, GROUPED_VERIFY_RAN)


def _log_first_call(kernel_class, message: str) -> None:
    call = kernel_class.__call__
    logged = False

    def logging_call(self, *args, **kwargs):
        nonlocal logged
        if not logged:
            logged = True
            logger.info("%s (pid %d)", message, os.getpid())
        return call(self, *args, **kwargs)

    kernel_class.__call__ = logging_call


def _groups_without_pynccl(original, group_ranks, local_rank, backend, use_pynccl=None, *args, **kwargs):
    """``init_model_parallel_group`` with ``use_pynccl`` False unless a caller asks for it."""
    return original(group_ranks, local_rank, backend, bool(use_pynccl), *args, **kwargs)


def gather_spec_extras_torch(
    indices: torch.Tensor,  # [m] rows to gather
    topk_p_buf: torch.Tensor,  # [rows, ...]
    topk_index_buf: torch.Tensor,  # [rows, ...]
    output_tokens_buf: torch.Tensor,  # [rows, ...]
    hidden_states_buf,  # [rows, ...] or None when hidden states are not captured
):
    """PyTorch version of the fused Triton ``gather_spec_extras``: the rows
    ``indices`` of each buffer, as new tensors ``[m, *buf.shape[1:]]``."""
    global _gather_used
    if not _gather_used:
        _gather_used = True
        logger.info("sglang_dynspec test bed: torch gather_spec_extras in use (pid %d)", os.getpid())
    rows = indices.to(torch.int64)
    hidden_states = None if hidden_states_buf is None else hidden_states_buf[rows]
    return topk_p_buf[rows], topk_index_buf[rows], output_tokens_buf[rows], hidden_states


def _is_eagle_family(server_args) -> bool:
    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    algorithm = resolving_view(server_args).speculative_algorithm
    return algorithm is not None and SpeculativeAlgorithm.from_string(algorithm).is_eagle()


def _keep_overlap_for_eagle_family(original, server_args):
    if _is_eagle_family(server_args):
        logger.warning(
            "sglang_dynspec test bed: keeping the overlap scheduler on for speculative "
            "decoding on CPU (%s=1)",
            OVERLAP_ENV,
        )
        return None
    return original(server_args)


def assert_overlap_kept(server_args) -> None:
    """Raise if overlap was requested for an EAGLE-family server but resolution
    still turned it off (e.g. the hook did not apply after an SGLang change).

    ``server_args`` is the raw record after ``resolve_once()``; an explicit
    ``--disable-overlap-schedule`` is respected and not an error.
    """
    from sglang.srt.arg_groups.overrides import resolved_view

    if not overlap_requested() or server_args.disable_overlap_schedule:
        return
    if not _is_eagle_family(server_args):
        return
    if resolved_view(server_args).disable_overlap_schedule:
        deciders = [
            source
            for source, fields in getattr(server_args, "_resolved_overrides", ())
            if fields.get("disable_overlap_schedule") is True
        ]
        raise RuntimeError(
            f"{OVERLAP_ENV}=1 asked for the overlap scheduler, but server-argument "
            f"resolution still disabled it (declared by {deciders or 'unknown'}). "
            f"The test-bed hook on {CPU_OVERLAP_RULE} did not apply or another rule "
            "disabled overlap; check the 'Applied ... hook(s)' lines in the log."
        )
