"""The plain DECODE CUDA graph of the target: capture, swap-in for one forward, memory.

With speculation configured, the target's only decode graph is a TARGET_VERIFY graph
``num_draft_tokens`` wide, and ``can_run_graph`` does not check the forward mode: a
plain DECODE replayed on it fails with "size of tensor a (bs*ndt) must match ... (bs)"
(``benchmarks/results/h200-20261129-plain-path-check/first-run-crash.txt``). So the
plugin captures a second decode graph for the target, one token per request, and
swaps it in for each plain step.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from sglang_dynspec import compat

logger = logging.getLogger("sglang_dynspec")


@dataclass(frozen=True)
class PlainGraph:
    """A plain DECODE CUDA graph runner for the target, with its own attention backend."""

    runner: object  # a DecodeCudaGraphRunner (subclass)
    attn_backend: object
    memory_bytes: int  # device memory the capture took

    @property
    def max_batch_size(self) -> int | None:
        return getattr(self.runner, "max_bs", None)


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
        return compat.CaptureHiddenMode.FULL

    def set_mode(self, value):
        pass

    return type(
        "PlainDecodeCudaGraphRunner",
        (base,),
        {
            "return_hidden_states_mode": property(get_mode, set_mode),
            "__doc__": _full_hidden_runner_class.__doc__,
        },
    )


def capture_plain_graph(model_runner, capture_hidden: bool = True) -> PlainGraph | None:
    """Capture the plain decode graph; None when the target runs without CUDA decode graphs.

    Captured after the verify graph, while the model runner briefly reports no
    speculative algorithm: that makes SGLang's own ``DecodeCudaGraphRunner`` capture
    forward mode DECODE, one token per request, with no spec input (the construction
    SGLang's ``--speculative-adaptive`` uses for its extra verify graphs). The
    attention backend is new because capturing initialises the backend's graph
    state, which would otherwise clobber the verify graph's buffers.
    ``capture_hidden``: the graph also outputs the packed auxiliary hidden states
    (needed by the draft catch-up).
    """
    if not torch.cuda.is_available() or not isinstance(
        model_runner.decode_cuda_graph_runner, compat.DecodeCudaGraphRunner
    ):
        # Graphs disabled, or another device's graph runner (CPU graphs, NPU...):
        # plain steps run eagerly.
        return None
    free_before = torch.cuda.mem_get_info()[0]
    attn_backend = compat.new_attention_backend(model_runner)
    runner_cls = (
        _full_hidden_runner_class(compat.DecodeCudaGraphRunner)
        if capture_hidden
        else compat.DecodeCudaGraphRunner
    )
    saved_algorithm = model_runner.spec_algorithm
    model_runner.spec_algorithm = compat.SpeculativeAlgorithm.NONE
    try:
        runner = runner_cls(model_runner, attn_backend=attn_backend)  # captures
    except torch.cuda.OutOfMemoryError as e:
        raise RuntimeError(
            f"capturing the plain decode CUDA graph ran out of device memory ({free_before / 2**20:.0f} MiB "
            "were free after SGLang's own graphs and the catch-up buffer): lower --mem-fraction-static, "
            "lower --cuda-graph-max-bs, lower --speculative-catch-up-tokens, or set "
            "SGLANG_DYNSPEC_PLAIN_CUDA_GRAPH=0 to run plain steps without a graph"
        ) from e
    finally:
        model_runner.spec_algorithm = saved_algorithm
    free_after = torch.cuda.mem_get_info()[0]
    graph = PlainGraph(runner, attn_backend, max(0, free_before - free_after))
    logger.info(
        "[sglang-dynspec] captured a plain DECODE CUDA graph for the target (batch sizes up to %s, %.0f MiB)",
        graph.max_batch_size,
        graph.memory_bytes / 2**20,
    )
    return graph


@contextlib.contextmanager
def using_plain_graph(model_runner, plain_graph: PlainGraph | None) -> Iterator[None]:
    """Route the target's decode forward away from its TARGET_VERIFY CUDA graph.

    For one forward, the plain graph and its backend are swapped in (or no graph:
    eager). Race-free because the scheduler runs one forward at a time in this
    process; ``finally`` restores both.
    """
    saved = (model_runner.decode_cuda_graph_runner, model_runner.attn_backend)
    if plain_graph is None:
        model_runner.decode_cuda_graph_runner = None
    else:
        model_runner.decode_cuda_graph_runner = plain_graph.runner
        model_runner.attn_backend = plain_graph.attn_backend
    # A read-done event left by an earlier verify replay would let the scheduler's
    # WAR barrier pass before this forward has read req_to_token: start clean.
    setattr(model_runner, compat.READ_DONE_EVENT, None)
    try:
        yield
    finally:
        model_runner.decode_cuda_graph_runner, model_runner.attn_backend = saved


class PlainGraphKeeper:
    """Holds the plain decode graph and keeps it in step with the target's weights.

    A captured graph reads the weight tensors it was captured with, at their addresses.
    After a weight update (disk, tensor, distributed, IPC) that wrote into the same
    storage (``compat.weight_storages`` unchanged: the usual case for in-place loading,
    whatever API carried the weights) the graph stays; after one that moved a tensor,
    or failed, it is dropped, and plain steps run eagerly, with the current weights,
    until a disk update with ``recapture_cuda_graph=True`` (SGLang recaptures its own
    graphs then) recaptures it here too. The target's ``weight_updater`` is wrapped
    (:class:`_WeightUpdateWatch`) to see the updates.
    """

    def __init__(self, model_runner, capture_hidden: bool, capture=capture_plain_graph):
        self._runner, self._capture_hidden, self._capture = model_runner, capture_hidden, capture
        self.graph: PlainGraph | None = capture(model_runner, capture_hidden=capture_hidden)
        self.weight_updates = 0
        self._storages: tuple | None = None  # where the weights were before the update in flight
        if self.graph is not None:
            model_runner.weight_updater = _WeightUpdateWatch(
                model_runner.weight_updater, self._before_update, self._after_update
            )

    def _before_update(self) -> None:
        self._storages = compat.weight_storages(self._runner) if self.graph is not None else None

    def _after_update(self, method: str, succeeded: bool, recapture: bool) -> None:
        self.weight_updates += 1
        before, self._storages = self._storages, None
        if recapture and succeeded:
            self.graph = None  # release the old graph's memory before capturing the new one
            self.graph = self._capture(self._runner, capture_hidden=self._capture_hidden)
            logger.info("[sglang-dynspec] plain decode graph recaptured after %s", method)
        elif self.graph is not None:
            if succeeded and before is not None and compat.weight_storages(self._runner) == before:
                logger.info(
                    "[sglang-dynspec] target weights updated in place (%s): the plain decode graph reads "
                    "them there and stays",
                    method,
                )
                return
            self.graph = None
            logger.warning(
                "[sglang-dynspec] target weights %s (%s): plain decode steps run without their CUDA "
                "graph until a weight update with recapture_cuda_graph=True recaptures it",
                "moved to new storage" if succeeded else "update failed",
                method,
            )


class _WeightUpdateWatch:
    """The target's weight updater, unchanged, with callbacks before and after every
    method that may write the weights (``compat.is_weight_write``: the
    ``update_weights_from_*`` family, 0.5.23's ``load_weights_from_distributed`` and its
    weight-update session's begin and end)."""

    def __init__(self, inner, before_update, after_update):
        self._inner, self._before_update, self._after_update = inner, before_update, after_update

    def __getattr__(self, name):
        attr = getattr(self._inner, name)
        if not (compat.is_weight_write(name) and callable(attr)):
            return attr

        def update(*args, **kwargs):
            self._before_update()
            result = attr(*args, **kwargs)
            succeeded = bool(result[0]) if isinstance(result, tuple) and result else True
            self._after_update(name, succeeded, bool(kwargs.get("recapture_cuda_graph", False)))
            return result

        return update
