"""Pure-PyTorch stand-in for the ``sgl_kernel`` package, for CPU-only test machines.

Why it exists
    SGLang's CPU engine (``SGLANG_USE_CPU_ENGINE=1``) imports its CPU ops from
    ``sgl_kernel`` at module import time (``cache_move.py``, ``cache_locs.py``,
    ``spec_tree.py``, ``allocation.py``, ...). The PyPI ``sglang-kernel`` wheel
    only ships CUDA builds, so that import dies without ``libcuda.so.1``, and the
    CPU build (``sglang-kernel-cpu``) is not on PyPI and needs AMX. This package
    lets the real SGLang scheduler, spec-v2 and plugin logic run on any x86 CPU.

How it is used
    ``dynspec_testbed.serve`` puts the parent directory (``_shim``) first
    on ``PYTHONPATH``, so this package shadows the wheel in the launcher and in
    every scheduler process SGLang spawns.

What it provides
    * The ops of the EAGLE-3 path (topk 1 chains and topk > 1 trees), in plain
      PyTorch: see ``_kv_ops``, ``_spec_ops`` and ``_attention_ops``. They follow
      the contracts of the C++ kernels in ``sgl-kernel/csrc/cpu`` and are written
      for correctness, not speed (per-request Python loops).
    * The two attention ops are also set on ``torch.ops.sgl_kernel``, because
      ``IntelAMXAttnBackend`` looks them up there.
    * Every other attribute, and every ``sgl_kernel.<submodule>``, resolves to a
      stub that raises ``NotImplementedError`` naming the op when called. Modules
      that import GPU-only ops at top level can then be imported, and executing
      such an op fails loudly instead of silently.
    * ``torch.ops.sgl_kernel.convert_weight_packed`` is deliberately absent: SGLang
      keys ``cpu_has_amx_support()`` on it, so model layers keep their
      native-torch code paths (norms, RoPE, linear) instead of AMX kernels.

This is a test double: a CPU run tests SGLang's Python-level logic, not kernels.
"""

import importlib.abc
import importlib.machinery
import sys
import types

import torch

from ._attention_ops import decode_attention_cpu, extend_attention_cpu
from ._kv_ops import copy_all_layer_kv_cache_cpu
from ._spec_ops import (
    assign_draft_cache_locs_contiguous_cpu,
    assign_extend_cache_locs_cpu,
    assign_req_to_token_pool_cpu,
    build_draft_decode_metadata_cpu,
    build_tree_kernel_efficient_cpu,
    fill_accept_out_cache_loc_cpu,
    fill_bonus_tokens_cpu,
    verify_tree_greedy_cpu,
)

# The ops implemented here (re-exported: a lookup on a stub submodule falls back to them).
__all__ = (
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "assign_req_to_token_pool_cpu",
    "build_draft_decode_metadata_cpu",
    "build_tree_kernel_efficient_cpu",
    "copy_all_layer_kv_cache_cpu",
    "decode_attention_cpu",
    "extend_attention_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "verify_tree_greedy_cpu",
)
IMPLEMENTED_OPS = __all__


class MissingOp:
    """Placeholder for an op the stand-in does not implement; calling it raises."""

    def __init__(self, qualified_name: str):
        self._qualified_name = qualified_name

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel stand-in (sglang_dynspec test bed): '{self._qualified_name}' "
            "is not implemented. Add a PyTorch version to "
            "testbed/dynspec_testbed/_shim/sgl_kernel/ if the CPU test bed needs it."
        )

    def __getattr__(self, item: str):
        # Dunder lookups (copy, pickle, inspect) must fail normally, not yield stubs.
        if item.startswith("__"):
            raise AttributeError(item)
        return MissingOp(f"{self._qualified_name}.{item}")

    def __repr__(self) -> str:
        return f"<sgl_kernel stand-in stub {self._qualified_name}>"


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return MissingOp(f"{__name__}.{name}")


class _StubSubmodule(types.ModuleType):
    """``sgl_kernel.<submodule>``: the real package re-exports its submodules' ops
    at top level, so a lookup here falls back to this package's implementation."""

    def __getattr__(self, item: str):
        if item.startswith("__"):
            raise AttributeError(item)
        if item in IMPLEMENTED_OPS:
            return globals()[item]
        return MissingOp(f"{self.__name__}.{item}")


class _StubSubmoduleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves any public ``<this package>.<name>`` import to a ``_StubSubmodule``.

    Keyed on this package's own ``__name__`` so that loading the file under another
    name (the unit tests do) never intercepts imports of the real ``sgl_kernel``.
    Private submodules (``_kv_ops`` etc.) are left to the normal path finder.
    """

    def __init__(self, package_name: str):
        self._prefix = package_name + "."

    def find_spec(self, fullname, path, target=None):
        if not fullname.startswith(self._prefix):
            return None
        if fullname.rsplit(".", 1)[1].startswith("_"):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        module = _StubSubmodule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _StubSubmoduleFinder(__name__))

# IntelAMXAttnBackend reads these from the op namespace, not from the package.
torch.ops.sgl_kernel.decode_attention_cpu = decode_attention_cpu
torch.ops.sgl_kernel.extend_attention_cpu = extend_attention_cpu
