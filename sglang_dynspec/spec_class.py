"""The EAGLE3_DYNAMIC algorithm's identity: a spec class that answers as EAGLE3.

SGLang asks the algorithm object many questions (``is_eagle``, ``is_eagle3``,
``supports_mixed_chunk``, ``has_draft_kv``, ``handle_server_args`` ...). EAGLE3_DYNAMIC
runs EAGLE-3's whole machinery, so every one is answered by
``SpeculativeAlgorithm.EAGLE3``. The last one runs SGLang's own EAGLE-family
argument resolution (automatic steps/topk/draft tokens, the draft checks, the
max-running-requests default) without the plugin naming a private function.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from sglang_dynspec import compat

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
    return sorted(
        name
        for name, value in vars(compat.SpeculativeAlgorithm).items()
        if not name.startswith("_") and name not in _NOT_DELEGATED and inspect.isfunction(value)
    )


def _answer_as_eagle3(name: str) -> Callable:
    reference = getattr(compat.SpeculativeAlgorithm.EAGLE3, name)

    @functools.wraps(reference)
    def method(self, *args, **kwargs):
        return getattr(compat.SpeculativeAlgorithm.EAGLE3, name)(*args, **kwargs)

    return method


def make_eagle3_like_spec_class(name: str) -> type:
    """A ``CustomSpecAlgo`` subclass that behaves exactly like the builtin EAGLE3."""
    body: dict[str, Any] = {m: _answer_as_eagle3(m) for m in eagle3_method_names()}

    def create_future_map(self, device, req_to_token_pool, *args, **kwargs):
        # The builtin passes the algorithm object into the FutureMap; pass ours.
        return compat.new_future_map(device, self, req_to_token_pool, *args, **kwargs)

    def get_platform_worker_cls(self):
        return None  # our factory picks the worker

    body.update(
        create_future_map=create_future_map,
        get_platform_worker_cls=get_platform_worker_cls,
        __doc__=f"{name}: answers every SpeculativeAlgorithm query as EAGLE3 does.",
    )
    return type(f"{name.title().replace('_', '')}Algorithm", (compat.CustomSpecAlgo,), body)


def register_algorithm(name: str, *, validate_server_args: Callable, worker_factory: Callable) -> bool:
    """Register ``name`` once per process; return False if it already was."""
    if compat.is_registered(name):
        return False
    compat.register_algorithm(
        name,
        make_eagle3_like_spec_class(name),
        validate_server_args=validate_server_args,
        worker_factory=worker_factory,
    )
    return True
