"""The EAGLE3_DYNAMIC worker: EAGLE-3 when the decode batch is small, plain decode when it is large.

It only dispatches. The decision is ``policy.SwitchPolicy`` (pure, replicated inputs
only, so every TP rank branches alike); the plain step is ``plain_step``; the
speculative step, prefill and mixed prefill+decode batches are SGLang's own
``EAGLEWorkerV2`` path, unchanged.

Resuming speculation after plain steps is lossless (the target verifies every
draft) and crash-free, because the draft state the scheduler keeps between steps
is never resized: plain steps carry the last speculative step's draft top-k and
hidden state forward. The draft catch-up (``catch_up``) then replays the positions
decoded plain into the draft before the first speculative step, so that step
drafts from the state an always-speculating server would have
(``--speculative-catch-up-tokens 0`` turns it off).
"""

from __future__ import annotations

from sglang_dynspec import compat
from sglang_dynspec.catch_up import DraftCatchUp
from sglang_dynspec.config import (
    PLAIN_CUDA_GRAPH_ENV,
    catch_up_tokens_from_environ,
    env_bool,
    thresholds_from_environ,
)
from sglang_dynspec.metrics import ModeMetrics
from sglang_dynspec.plain_step import run_plain_decode
from sglang_dynspec.policy import Mode, SwitchPolicy


class DynamicEagleWorker(compat.EAGLEWorkerV2):
    """EAGLEWorkerV2 that runs a plain target decode while the decode batch is large."""

    def __init__(self, server_args, *args, **kwargs):
        super().__init__(server_args, *args, **kwargs)
        self.switch_policy = SwitchPolicy(thresholds_from_environ())
        self._first_rank = compat.tensor_parallel_rank() == 0
        self.mode_metrics = ModeMetrics(
            export=self._first_rank and compat.metrics_enabled(server_args),
            labels={"model_name": compat.served_model_name(server_args)},
            log_switches=self._first_rank,
        )
        self.plain_graph = None  # captured in init_cuda_graphs; None: eager plain steps
        self._last_step_plain = False
        self._resumed = False  # the coming speculative step is the first after plain ones
        self._catch_up_capacity = catch_up_tokens_from_environ()
        self.catch_up = None  # allocated in init_cuda_graphs, once the KV pools exist
        if self._first_rank:
            t = self.switch_policy.thresholds
            compat.logger.info(
                "[sglang-dynspec] EAGLE3_DYNAMIC: plain decode above %d running requests, "
                "EAGLE-3 again at or below %d, at least %d decode steps between switches; "
                "draft catch-up buffer %d positions per request (SGLang %s)",
                t.disable_above, t.enable_at_or_below, t.min_dwell_steps,
                self._catch_up_capacity, compat.SGLANG_VERSION,
            )

    def init_cuda_graphs(self):
        # The scheduler calls this once the KV pools exist (both SGLang versions, with
        # or without CUDA graphs): allocate the catch-up buffer first, so the graphs
        # are captured with it in place.
        if self._catch_up_capacity:
            self.catch_up = DraftCatchUp(self, self._catch_up_capacity, self.mode_metrics)
            if self._first_rank:
                compat.logger.info(
                    "[sglang-dynspec] draft catch-up buffer: %d positions x %d requests, %.0f MiB",
                    self._catch_up_capacity, len(self.catch_up.log.gap),
                    self.catch_up.log.nbytes / 2**20,
                )
        super().init_cuda_graphs()
        # SGLANG_DYNSPEC_PLAIN_CUDA_GRAPH=0 runs plain steps eagerly instead (saves the
        # graph's memory, costs launch overhead).
        if not env_bool(PLAIN_CUDA_GRAPH_ENV, True):
            return
        self.plain_graph = compat.capture_plain_decode_graph(
            self.target_worker.model_runner, capture_hidden=self.catch_up is not None
        )
        if self.plain_graph is not None and self._first_rank:
            compat.logger.info(
                "[sglang-dynspec] captured a plain DECODE CUDA graph for the target "
                "(batch sizes up to %s, %.0f MiB)",
                getattr(self.plain_graph.runner, "max_bs", "?"),
                self.plain_graph.memory_bytes / 2**20,
            )

    def forward_batch_generation(self, batch, on_publish=None, grammar_barrier=None,
                                 pp_proxy_tensors=None):
        self._last_step_plain = False
        self.mode_metrics.poll()
        catch_up = self.catch_up
        decode_step = compat.is_plain_decode_candidate(batch)
        if decode_step:
            policy = self.switch_policy
            mode = policy.decide(compat.decode_batch_size(batch))
            if mode is Mode.PLAIN:
                out = run_plain_decode(self, batch, on_publish, grammar_barrier, self.plain_graph,
                                       catch_up)
                self._last_step_plain = True
                self._resumed = True
                self.mode_metrics.on_step(mode, policy.last_switch, policy.steps,
                                          replayed_graph=bool(out.can_run_cuda_graph))
                return out
            self.mode_metrics.on_step(mode, policy.last_switch, policy.steps)
            if catch_up is not None:
                catch_up.before_speculative_step(batch)
        elif catch_up is not None and not batch.forward_mode.is_idle():
            catch_up.before_extend_step(batch)
        out = super().forward_batch_generation(
            batch, **compat.spec_forward_kwargs(on_publish, grammar_barrier, pp_proxy_tensors)
        )
        if self._resumed and decode_step:
            self._resumed = False
            self.mode_metrics.watch_first_step_after_resume(
                out.accept_lens, compat.DeviceTimer.marker(self.device)
            )
        return out

    def _war_barrier_runner(self):
        """The runner whose read-done event the scheduler's WAR barrier waits on.

        After a plain step the target ran last (and, when it replayed the plain
        graph, recorded the event); otherwise SGLang's answer (the draft runner).
        """
        if self._last_step_plain:
            return self.target_worker.model_runner
        return getattr(super(), compat.WAR_RUNNER_PROPERTY)


# The property is named differently in SGLang 0.5.17 and 0.5.23 (see compat).
setattr(DynamicEagleWorker, compat.WAR_RUNNER_PROPERTY,
        property(DynamicEagleWorker._war_barrier_runner))
