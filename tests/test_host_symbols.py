"""The host adapter's table is the whole truth about what the plugin touches in SGLang.

* Only ``compat`` imports SGLang.
* Every attribute name the serving package reads, calls or sets (``x.name``, or a
  constant in ``getattr``/``setattr``/``hasattr``), other than the package's own names
  and the attributes of the libraries it uses (torch, the standard library,
  prometheus_client), is in ``compat.HOST_SYMBOLS``: so a new access to an SGLang
  object that bypasses the table fails here. (A name that is also a torch or
  standard-library attribute, such as ``device``, cannot be told apart by name; the
  table lists those too.)
* Every name in the table is used by the package (no stale entries), and the table
  resolves against the installed SGLang (the start-up check).
"""

from __future__ import annotations

import abc
import argparse
import ast
import bisect
import builtins
import collections.abc
import contextlib
import copy
import dataclasses
import enum
import functools
import hashlib
import importlib.metadata
import inspect
import itertools
import json
import logging
import math
import os
import pathlib
import re
import tempfile
import time
import typing
from pathlib import Path

import prometheus_client
import pytest
import schedule_batches  # noqa: F401  (sets up the CPU import of SGLang first)
import torch

from sglang_dynspec import compat

PACKAGE = Path(compat.__file__).resolve().parent
# A copy of an SGLang Triton kernel (0.5.23's verify_mla.py, for 0.5.17): it reads
# Triton's and torch's names and no SGLang object, and imports no SGLang (checked below).
VENDORED_KERNELS = {"verify_grouped_kernel.py"}
SERVING_MODULES = sorted(p for p in PACKAGE.glob("*.py") if p.name not in VENDORED_KERNELS)


@functools.lru_cache(maxsize=1)
def _library_names() -> frozenset[str]:
    objects = [
        builtins,
        object,
        type,
        list,
        dict,
        str,
        int,
        float,
        tuple,
        set,
        frozenset,
        bool,
        Exception,
        torch,
        torch.Tensor,
        torch.nn,
        torch.nn.Module,
        torch.cuda,
        torch.cuda.Event,
        torch.cuda.Stream,
        torch.profiler,
        torch.device,
        torch.dtype,
        logging,
        logging.Logger,
        contextlib,
        contextlib.ExitStack,
        itertools,
        functools,
        inspect,
        inspect.Signature,
        re,
        re.Pattern,
        re.Match,
        os,
        os.path,
        json,
        argparse,
        argparse.ArgumentParser,
        argparse._ArgumentGroup,
        argparse.Action,
        argparse.Namespace,
        enum,
        enum.Enum,
        dataclasses,
        time,
        copy,
        abc,
        collections.abc,
        collections.deque,
        itertools.chain,
        bisect,
        hashlib,
        hashlib.sha256(),
        tempfile,
        pathlib.Path,
        math,
        typing,
        importlib.metadata,
        prometheus_client,
    ]
    registry = prometheus_client.CollectorRegistry()
    objects += [
        prometheus_client.Counter("probe_c", "probe", registry=registry),
        prometheus_client.Gauge("probe_g", "probe", registry=registry),
        prometheus_client.Histogram("probe_h", "probe", registry=registry),
    ]
    names = set()
    for obj in objects:
        names.update(dir(obj))
    names.update({"get_config_dict"})  # transformers.PretrainedConfig, for a draft on the hub
    return frozenset(names)


def _is_host_table(node: ast.AST) -> bool:
    return isinstance(node, (ast.Assign, ast.AnnAssign)) and any(
        isinstance(t, ast.Name) and t.id == "HOST_SYMBOLS"
        for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
    )


def _walk(tree: ast.AST):
    """ast.walk, skipping compat's table itself."""
    todo = [tree]
    while todo:
        node = todo.pop()
        if _is_host_table(node):
            continue
        yield node
        todo.extend(ast.iter_child_nodes(node))


def scan(sources: dict[str, str]) -> tuple[set[str], set[str], set[str]]:
    """(attribute names used, names the package defines, identifiers in string constants)."""
    used, own, strings = set(), set(), set()
    for name, source in sources.items():
        own.add(Path(name).stem)
        for node in _walk(ast.parse(source)):
            if isinstance(node, ast.Attribute):
                used.add(node.attr)
                if (
                    isinstance(node.ctx, ast.Store)
                    and isinstance(node.value, ast.Name)
                    and node.value.id
                    in (
                        "self",
                        "cls",
                    )
                ):
                    own.add(node.attr)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
                for item in node.body if isinstance(node, ast.ClassDef) else ():
                    if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                        own.add(item.target.id)
                    if isinstance(item, ast.Assign):
                        own.update(t.id for t in item.targets if isinstance(t, ast.Name))
            elif isinstance(node, ast.Assign):
                own.update(t.id for t in node.targets if isinstance(t, ast.Name))
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                own.add(node.target.id)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                # Module-level names bound by imports (compat's re-exported classes).
                own.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                if node.func.id in ("getattr", "setattr", "hasattr") and len(node.args) >= 2:
                    arg = node.args[1]
                    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                        used.add(arg.value)
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                # Identifiers in strings: hook targets ("...ServerArgs.add_cli_args") and
                # docstrings that name a host method the package relies on.
                strings.update(re.findall(r"[A-Za-z_]\w*", node.value))
            if isinstance(node, ast.keyword) and node.arg:
                strings.add(node.arg)
    return used, own, strings


def unlisted_host_names(sources: dict[str, str]) -> set[str]:
    used, own, _ = scan(sources)
    dunders = {n for n in used if n.startswith("__") and n.endswith("__")}
    return used - dunders - own - _library_names() - compat.table_names()


def _package_sources() -> dict[str, str]:
    return {str(p): p.read_text() for p in SERVING_MODULES}


def test_only_the_adapter_imports_sglang():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "compat.py" and path.parent == PACKAGE:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            modules = []
            if isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                modules = [node.module]
            offenders += [
                f"{path.relative_to(PACKAGE)}: {m}"
                for m in modules
                if m.split(".")[0] in ("sglang", "sgl_kernel")
            ]
    assert offenders == []


def test_every_host_attribute_the_package_touches_is_in_the_table():
    assert unlisted_host_names(_package_sources()) == set()


def test_an_access_that_bypasses_the_table_is_caught():
    sources = _package_sources()
    sources["new_module.py"] = "def f(batch):\n    return batch.seq_lens + batch.some_new_host_field\n"
    assert unlisted_host_names(sources) == {"some_new_host_field"}
    sources["new_module.py"] = "def f(batch):\n    return getattr(batch, 'another_host_field', None)\n"
    assert unlisted_host_names(sources) == {"another_host_field"}


def test_every_table_entry_is_used():
    used, own, strings = scan(_package_sources())
    stale = {n for n in compat.table_names() if n not in used | own | strings}
    assert stale == set()


def test_the_table_resolves_against_the_installed_sglang():
    assert compat.missing_host_symbols() == []


def test_a_missing_symbol_is_named_with_its_owner():
    table = (
        compat.HostSymbols(
            compat.ScheduleBatch, ("seq_lens", "no_such_field", "gone_too|seq_lens", "optional?")
        ),
        compat.HostSymbols(compat.EAGLEWorkerV2, ("target_worker", "neither|nor")),
    )
    assert compat.missing_host_symbols(table) == ["ScheduleBatch.no_such_field", "EAGLEWorkerV2.neither|nor"]


@pytest.mark.parametrize("name", ["device", "req_to_token_pool"])
def test_instance_attributes_are_found_in_the_class_source(name):
    # Assigned in EAGLEWorkerV2.__init__ (self.name = ...), not class attributes.
    assert not hasattr(compat.EAGLEWorkerV2, name)
    assert compat.missing_host_symbols((compat.HostSymbols(compat.EAGLEWorkerV2, (name,)),)) == []


PURE_MODULES = (
    "policy",
    "goodput",
    "estimates",
    "cost_model",
    "cost_cache",
    "config",
    "refusals",
    "telemetry",
    "metric_names",
)


@pytest.mark.parametrize("module", PURE_MODULES)
def test_decision_modules_are_pure_python(module):
    """The decision logic and its inputs import neither torch nor SGLang (nor anything
    that does), so they are tested exhaustively and decide alike on every rank."""
    pure = set(PURE_MODULES)
    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        for name in names:
            top = name.split(".")[0]
            assert top not in ("torch", "sglang", "sgl_kernel", "prometheus_client"), (
                f"{module} imports {name}"
            )
            if top == "sglang_dynspec":
                assert name.split(".")[1] in pure, f"{module} imports {name}, which is not pure"


def test_attributes_assigned_by_tuple_unpacking_are_found():
    # DecodeCudaGraphRunner.__init__: ``self.capture_bs, self.compile_bs = ...`` (both versions).
    table = (compat.HostSymbols(compat.DecodeCudaGraphRunner, ("capture_bs", "compile_bs", "no_such_bs")),)
    assert compat.missing_host_symbols(table) == ["DecodeCudaGraphRunner.no_such_bs"]
