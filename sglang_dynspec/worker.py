"""The EAGLE3_DYNAMIC worker: it only dispatches.

Per decode step the controller (``controller``) names the mode; a plain step runs
``plain_step.run_plain_decode``; a speculative step, prefill and mixed
prefill+decode batches are SGLang's own ``EAGLEWorkerV2`` path, unchanged, preceded
by the draft catch-up (``catch_up``) where the draft is behind.

Resuming speculation after plain steps is lossless (the target verifies every
draft) and crash-free, because the draft state the scheduler keeps between steps is
never resized: plain steps carry the last speculative step's draft top-k and hidden
state forward (``plain_step``).
"""

from __future__ import annotations

import logging

from sglang_dynspec import compat, config, cost_cache, refusals, step_timing
from sglang_dynspec.catch_up import NoCatchUp, free_memory_note, new_catch_up
from sglang_dynspec.controller import ModeController
from sglang_dynspec.cost_model import StepCost
from sglang_dynspec.plain_graph import PlainGraphKeeper
from sglang_dynspec.plain_step import PlainDecoder, run_plain_decode
from sglang_dynspec.policy import Mode

logger = logging.getLogger("sglang_dynspec")

# The start-up log's words for a flush that leaves out the draft's last MLP (compat.MlpAtRows).
FLUSH_WITHOUT_LAST_MLP = "without the draft's last MLP (only at the rows a replay compares)"


class DynamicEagleWorker(compat.EAGLEWorkerV2):
    """EAGLEWorkerV2 that runs a plain target decode while speculation does not pay."""

    def __init__(self, server_args, *args, **kwargs):
        super().__init__(server_args, *args, **kwargs)
        error = refusals.target_model_error(
            compat.model_path(server_args), *compat.target_attention_kinds(self)
        )
        if error:
            raise config.ConfigError(error)
        self.settings = config.settings_from_environ()
        # Every rank read its own environment: refuse, on every rank alike, settings that differ.
        disagreement = config.settings_disagreement(compat.gather_across_tensor_parallel_ranks(self.settings))
        if disagreement:
            raise config.ConfigError(disagreement)
        first_rank = self._first_rank = compat.tensor_parallel_rank() == 0
        draft_steps = compat.draft_steps(server_args)
        self.controller = ModeController.from_settings(
            self.settings,
            first_rank=first_rank,
            metrics_enabled=compat.metrics_enabled(server_args),
            labels={"model_name": compat.served_model_name(server_args)},
            agree=compat.agree_across_tensor_parallel_ranks,
            draft_steps=draft_steps,
            max_acceptance=draft_steps + 1,
            device=str(self.device),
        )
        self.catch_up = NoCatchUp()  # allocated in init_cuda_graphs, once the KV pools exist
        self.plain_decoder: PlainDecoder | None = None  # from init_cuda_graphs, with the KV pools
        self.plain_graph_keeper = None  # PlainGraphKeeper, from init_cuda_graphs; None: eager plain steps
        self._last_step_plain = False
        if first_rank:
            logger.info(
                "[sglang-dynspec] EAGLE3_DYNAMIC: %s; draft catch-up buffer %d positions per request; "
                "penalties %s (SGLang %s)",
                self.controller.policy.describe(),
                self.settings.catch_up_tokens,
                self.settings.penalties,
                compat.SGLANG_VERSION,
            )
            if self.controller.simulated_acceptance is not None:
                logger.warning(
                    "[sglang-dynspec] acceptance simulated at %.2f tokens per speculative step "
                    "(SGLANG_SIMULATE_ACC_LEN; benchmarks only): the accept counters show it while "
                    "speculating, and the plain-mode estimate takes it",
                    self.controller.simulated_acceptance,
                )

    def init_attention_backends(self):
        # The scheduler calls this after the target's attention backends exist and before
        # any CUDA graph is captured: the verify graph keeps the kernel it captures.
        super().init_attention_backends()
        if self.settings.split_kv_verify:
            verify = compat.use_split_kv_verify(
                self, grouped=self.settings.grouped_verify, splits_by_batch=self.settings.splits_by_batch
            )
            names = config.SPLIT_KV_VERIFY_ENV
            if self.settings.grouped_verify:
                names += f", {config.GROUPED_VERIFY_ENV}"
            if self.settings.splits_by_batch and verify.split_kv:
                names += f", {config.SPLITS_BY_BATCH_ENV}"
            self._log_attention("target verify", names, verify)
        if self.settings.split_kv_draft_extend:
            # After the target's: a draft of the target's attention shape shares its scratch.
            draft = compat.use_split_kv_draft_extend(self, splits_by_batch=self.settings.splits_by_batch)
            names = config.SPLIT_KV_DRAFT_EXTEND_ENV
            if self.settings.splits_by_batch and draft.split_kv:
                names += f", {config.SPLITS_BY_BATCH_ENV}"
            self._log_attention("draft extend", names, draft)
        if self.settings.last_accepted_logits:
            note = compat.use_last_accepted_logits(self)
            if self._first_rank:
                logger.info(
                    "[sglang-dynspec] draft extend logits (%s): %s", config.LAST_ACCEPTED_LOGITS_ENV, note
                )

    def _log_attention(self, what: str, names: str, choice: compat.VerifyAttention) -> None:
        if self._first_rank:
            log = logger.warning if choice.warning else logger.info
            log("[sglang-dynspec] %s attention (%s): %s", what, names, choice.note)

    def init_cuda_graphs(self):
        # The scheduler calls this once the KV pools exist (both SGLang versions, with
        # or without CUDA graphs): allocate the catch-up buffer first, so the graphs
        # are captured with it in place.
        # A policy that uses estimates also gets the replays' draft-vs-target agreement.
        compare = self.controller.policy.needs_estimates
        self.plain_decoder = PlainDecoder.of(self)
        self.catch_up = new_catch_up(
            self,
            self.settings.catch_up_tokens,
            self.controller.on_catch_up,
            compare=compare,
            flush_tokens=self.settings.flush_tokens,
            eager_draft_tokens=self.settings.eager_draft_tokens,
            flush_stream=self.settings.flush_stream,
        )
        if self.catch_up.replays is not None:
            self.controller.set_replay_source(self.catch_up.replays.read_back)
        elif compare and self._first_rank:
            logger.warning(
                "[sglang-dynspec] the draft catch-up %s, so plain steps do not measure acceptance: "
                "a plain phase keeps the last speculative acceptance",
                "is off (--speculative-catch-up-tokens 0)"
                if not self.catch_up.enabled
                else "cannot read the draft model's logits head",
            )
        if self.catch_up.enabled and self._first_rank:
            logger.info(
                "[sglang-dynspec] draft catch-up buffer: %d positions x %d requests, %.0f MiB (allocated "
                "after the KV pool; %s); buffer-full flushes %s, %s%s; %s; each catch-up forward "
                "replays at most %d positions (SGLang's largest prefill forward: --chunked-prefill-size, "
                "or --max-prefill-tokens without chunked prefill)",
                self.settings.catch_up_tokens,
                compat.request_pool_size(self),
                self.catch_up.nbytes / 2**20,
                free_memory_note(self.device),
                f"in pieces of at most {self.settings.flush_tokens} positions ({config.FLUSH_TOKENS_ENV}; "
                f"{self.catch_up.log.slack} more positions per request for them, catch_up.flush_slack)"
                if self.settings.flush_tokens
                else "replay every gap of the batch at once",
                FLUSH_WITHOUT_LAST_MLP
                if compat.draft_last_layer(self) is not None
                else "with the whole draft forward (a draft model other than LlamaForCausalLMEagle3)",
                f", on a side stream beside the plain steps ({config.FLUSH_STREAM_ENV})"
                if self.settings.flush_stream
                else "",
                f"flushes and prefills of {self.settings.eager_draft_tokens} tokens or more skip the "
                f"draft's prefill graph ({config.EAGER_DRAFT_TOKENS_ENV})"
                if self.settings.eager_draft_tokens
                else f"the draft's prefill graph wherever SGLang uses it ({config.EAGER_DRAFT_TOKENS_ENV}=0)",
                self.catch_up.forward_tokens,
            )
        if self._first_rank:
            warning = config.unreachable_bound_warning(self.settings, compat.max_running_requests(self))
            if warning:
                logger.warning("[sglang-dynspec] %s", warning)
        super().init_cuda_graphs()
        compat.keep_draft_graphs_on_recapture(self)
        if self.settings.plain_cuda_graph:
            self.plain_graph_keeper = PlainGraphKeeper(
                self.target_worker.model_runner, capture_hidden=self.catch_up.enabled
            )
        self._time_step_costs()

    def _time_step_costs(self) -> None:
        """The goodput policy's step-cost table (``cost_cache``): read from the cache, or
        timed on this device now, once every graph is captured and before any request
        (every TP rank runs the same steps: they hold collectives); the first rank's
        table goes to every rank. Also with ``SGLANG_DYNSPEC_CALIBRATE=1`` under the
        threshold policy (the table in ``/metrics`` feeds ``bench crossover``)."""
        wanted = self.controller.policy.needs_estimates or config.env_bool(step_timing.CALIBRATE_ENV, False)
        if not compat.agree_across_tensor_parallel_ranks(wanted):
            return
        graph = self.plain_graph_keeper.graph if self.plain_graph_keeper is not None else None
        grid = step_timing.default_grid(self, graph)
        key = compat.step_cost_key(self, grid)

        def measure():
            samples = step_timing.measure_step_costs(self, graph, *grid)
            return [StepCost(s.mode, s.batch_size, s.context_len, s.seconds) for s in samples]

        costs = cost_cache.startup_costs(
            key,
            config.cost_cache_dir(),
            measure,
            compat.agree_across_tensor_parallel_ranks,
            self._first_rank,
        )
        self.controller.set_cost_table(costs.table)
        if self._first_rank:
            logger.info(
                "[sglang-dynspec] step costs (%s in %.1f s; device ms per decode step):\n%s",
                "read from the cache" if costs.cache_hit else "timed at start-up",
                costs.seconds,
                cost_cache.format_table(costs.table),
            )

    def forward_batch_generation(self, batch, on_publish=None, grammar_barrier=None, pp_proxy_tensors=None):
        if not compat.is_decode_step(batch):
            self._last_step_plain = False
            self.controller.on_other_step()
            if not compat.is_idle_step(batch):
                self.catch_up.before_extend_step(batch)
            with compat.draft_mlp_at_last_rows(self, batch, self.settings.eager_draft_tokens):
                return super().forward_batch_generation(
                    batch, **compat.spec_forward_kwargs(on_publish, grammar_barrier, pp_proxy_tensors)
                )
        mode = self.controller.before_decode(
            compat.decode_batch_size(batch),
            lambda: compat.accept_counters(batch),
            needs_per_token_penalties=compat.needs_per_token_penalties(batch),
            # An O(batch) walk over the requests: only for a policy that reads it.
            context_len=compat.mean_context_len(batch) if self.controller.policy.needs_estimates else 0.0,
        )
        self._last_step_plain = mode is Mode.PLAIN
        if mode is Mode.PLAIN:
            self.catch_up.before_plain_step(batch)
            graph = self.plain_graph_keeper.graph if self.plain_graph_keeper is not None else None
            step = run_plain_decode(
                self.plain_decoder, batch, graph, grammar_barrier, capture_hidden=self.catch_up.enabled
            )
            self.catch_up.after_plain_step(step.input_ids, step.aux_hidden)
            out = step.result
            if on_publish is not None:
                on_publish(out.new_seq_lens)  # once per forward (plain_step, item 2)
            self.controller.after_decode(mode, replayed_graph=bool(out.can_run_cuda_graph))
        else:
            self.catch_up.before_speculative_step(batch)
            out = super().forward_batch_generation(
                batch, **compat.spec_forward_kwargs(on_publish, grammar_barrier, pp_proxy_tensors)
            )
            self.controller.after_decode(mode, accept_lens=out.accept_lens)
        if self.settings.request_modes:
            compat.tag_step_mode(out, config.REQUEST_MODES_KEY, mode.value)
        return out

    # The scheduler's WAR barrier waits on the read-done event of the runner this
    # property names. SGLang 0.5.23 calls it last_shared_read_runner, 0.5.17
    # war_fastpath_runner (compat.WAR_RUNNER_PROPERTY); both are defined, the
    # installed SGLang reads one.
    def _war_barrier_runner(self):
        """After a plain step the target ran last (and, when it replayed the plain
        graph, recorded the event); otherwise SGLang's answer (the draft runner)."""
        if self._last_step_plain:
            return self.target_worker.model_runner
        return getattr(super(), compat.WAR_RUNNER_PROPERTY)

    last_shared_read_runner = property(_war_barrier_runner)
    war_fastpath_runner = property(_war_barrier_runner)
