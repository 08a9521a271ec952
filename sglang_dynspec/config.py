"""The plugin's settings: six flags, their environment variables, defaults and checks.

Pure Python (no torch, no SGLang), so every message can be unit-tested.

Why environment variables carry the values: ``ServerArgs`` is a closed record, so a
plugin flag cannot become a field of it. Each flag's argparse action writes its
value to an environment variable at parse time; the spawned scheduler processes
inherit the environment and the worker reads it there. With ``sglang.Engine(...)``
there is no command line, so the environment variables are the interface.

Defaults come from the H200 measurements of 2026-11-29 (Llama-3.1-8B shape, EAGLE-3
with acceptance 3.0; BENCHMARKS.md, rows in benchmarks/results/h200-20261129.jsonl):
EAGLE-3 beat the baseline at concurrency 32 and lost to it at 64, so speculation
stops paying for itself between 32 and 64 running requests. Plain decode above
DEFAULT_DISABLE_ABOVE, speculation again at or below default_enable_at_or_below of it
(1/8 lower, so a batch that hovers around it does not flap), and at least
DEFAULT_MIN_DWELL_STEPS decode steps between two switches.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import Field, dataclass, field, fields

from sglang_dynspec.goodput import GoodputPolicy, GoodputSettings
from sglang_dynspec.policy import ModePolicy, SwitchThresholds, ThresholdPolicy

ALGORITHM_NAME = "EAGLE3_DYNAMIC"

DEFAULT_DISABLE_ABOVE = 32
DEFAULT_MIN_DWELL_STEPS = 8
# Positions per request the draft catch-up buffer holds (catch_up.py). Memory:
# max running requests x this x (3 x hidden size x dtype bytes + 8), e.g. 24 KiB per
# position for a Llama-3.1-8B target in bf16, so 0.4 GiB for 129 request slots.
# 128 rather than 32: each flush costs the server more than its kernels, and the
# positions of requests that finish while plain are never replayed; measured on the
# H200 in benchmarks/results/h200-20261201-offstate-dev/.
DEFAULT_CATCH_UP_TOKENS = 128
MAX_CATCH_UP_TOKENS = 4096


def default_enable_at_or_below(disable_above: int) -> int:
    """Slightly below N: one eighth lower, at least one lower, at least 1."""
    return max(1, disable_above - max(1, disable_above // 8))


class ConfigError(ValueError):
    """A bad plugin setting. The message names the flag and what is accepted."""


@dataclass(frozen=True)
class Flag:
    option: str  # command-line spelling
    env: str  # environment variable the value travels in
    help: str
    choices: tuple[str, ...] | None = None  # a word flag; None: a non-negative integer

    @property
    def dest(self) -> str:
        # Not a ServerArgs field on purpose: ServerArgs.from_cli_args copies only its
        # own fields, so this attribute is dropped after parsing (the env var stays).
        return "_dynspec_" + self.option.lstrip("-").replace("-", "_")

    def describe(self) -> str:
        return f"{self.option} (environment variable {self.env})"


DISABLE_THRESHOLD = Flag(
    "--speculative-disable-batch-threshold",
    "SGLANG_DYNSPEC_DISABLE_BATCH_THRESHOLD",
    f"{ALGORITHM_NAME}: stop speculating while the running decode batch has more than "
    f"N requests (default {DEFAULT_DISABLE_ABOVE}; at least 2).",
)
ENABLE_THRESHOLD = Flag(
    "--speculative-enable-batch-threshold",
    "SGLANG_DYNSPEC_ENABLE_BATCH_THRESHOLD",
    f"{ALGORITHM_NAME}: speculate again once the decode batch has at most M requests; "
    "1 <= M < N (default: 1/8 below N).",
)
MIN_DWELL = Flag(
    "--speculative-min-dwell-steps",
    "SGLANG_DYNSPEC_MIN_DWELL_STEPS",
    f"{ALGORITHM_NAME}: fewest decode steps between two mode switches (default {DEFAULT_MIN_DWELL_STEPS}).",
)
CATCH_UP_TOKENS = Flag(
    "--speculative-catch-up-tokens",
    "SGLANG_DYNSPEC_CATCH_UP_TOKENS",
    f"{ALGORITHM_NAME}: positions per request whose target hidden states are kept during "
    "plain decode and replayed into the draft model when speculation resumes; a full "
    f"buffer is replayed in plain mode (default {DEFAULT_CATCH_UP_TOKENS}; 0 disables the "
    "catch-up: the draft resumes from stale state).",
)


def _goodput_policy(settings: Settings, max_acceptance: float) -> ModePolicy:
    return GoodputPolicy(
        GoodputSettings(
            min_dwell_steps=max(1, settings.thresholds.min_dwell_steps),
            speculation_bound=settings.speculation_bound,
            max_acceptance=max(1.0, max_acceptance),
        )
    )


def _threshold_policy(settings: Settings, max_acceptance: float) -> ModePolicy:
    return ThresholdPolicy(settings.thresholds)


# A policy is a module plus one line here (build_policy reads it; the flag's choices too).
POLICY_FACTORIES: dict[str, Callable[[Settings, float], ModePolicy]] = {
    "goodput": _goodput_policy,
    "threshold": _threshold_policy,
}
POLICIES = tuple(POLICY_FACTORIES)
DEFAULT_POLICY = "goodput"
POLICY = Flag(
    "--speculative-dynamic-policy",
    "SGLANG_DYNSPEC_POLICY",
    f"{ALGORITHM_NAME}: when to speculate. goodput: while the predicted tokens/s of "
    "speculation beat plain decode (step costs timed at start-up and corrected online, "
    "acceptance measured in both modes; --speculative-disable-batch-threshold, if given, is a "
    "hard upper bound); threshold: by the decode batch size alone (the two batch thresholds). "
    f"Default {DEFAULT_POLICY}.",
    choices=POLICIES,
)
PENALTY_MODES = ("exact", "relaxed")
# relaxed by default: with exact, one request with a penalty makes its whole decode batch
# plain, so any client could switch speculation off for every other (EAGLE-3 gave 1.94x
# the baseline at one request on the H200, BENCHMARKS.md, 2026-12-01); relaxed gives penalised requests EAGLE-3's
# own per-step penalties while speculating, what a stock EAGLE-3 server gives them
# always. exact stays an opt-in for outputs that must match a non-speculative server's.
DEFAULT_PENALTIES = "relaxed"
PENALTIES = Flag(
    "--speculative-penalties",
    "SGLANG_DYNSPEC_PENALTIES",
    f"{ALGORITHM_NAME}: frequency, presence and repetition penalties. exact: a decode batch "
    "with a penalised request decodes plain, so penalties count every generated token, as "
    "on a non-speculative server; relaxed: such batches speculate when the policy says so, "
    "and a speculative step applies the penalties as EAGLE-3 does (accumulated once per "
    f"step, from its last token). Default {DEFAULT_PENALTIES}.",
    choices=PENALTY_MODES,
)
FLAGS = (POLICY, DISABLE_THRESHOLD, ENABLE_THRESHOLD, MIN_DWELL, CATCH_UP_TOKENS, PENALTIES)
SIMULATED_ACCEPTANCE_ENV = "SGLANG_SIMULATE_ACC_LEN"  # SGLang's own benchmark switch


def _decimal(raw: str) -> int | None:
    """``raw`` as a non-negative integer in plain decimal digits (the documented form),
    or None. Python's ``int`` also takes signs, ``1_000`` and non-ASCII digits."""
    raw = raw.strip()
    return int(raw) if raw.isascii() and raw.isdigit() else None


def _non_negative_int(environ: Mapping[str, str], name: str, described: str) -> int | None:
    """The variable ``name`` as a non-negative integer, None when unset or empty; else a
    ConfigError that names it as ``described``."""
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    value = _decimal(raw)
    if value is None:
        raise ConfigError(f"{described} must be a non-negative integer, got {raw!r}")
    return value


def _read_non_negative_int(flag: Flag, environ: Mapping[str, str]) -> int | None:
    return _non_negative_int(environ, flag.env, flag.describe())


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")

PLAIN_CUDA_GRAPH_ENV = "SGLANG_DYNSPEC_PLAIN_CUDA_GRAPH"
# 1: each response's meta_info lists the mode of each of its decode steps
# (REQUEST_MODES_KEY). Off by default: SGLang then keeps and streams one value per
# request per decode step, host work on every step of a server that is host-bound
# at large batches (benchmarks/results/h200-offstate-20261201.jsonl, 3B shape).
REQUEST_MODES_ENV = "SGLANG_DYNSPEC_REQUEST_MODES"
REQUEST_MODES_KEY = "spec_dynamic_step_modes"
ENABLED_ENV = "SGLANG_DYNSPEC_ENABLED"
# Positions one buffer-full flush of the draft catch-up replays at most (catch_up.py);
# 0: every gap of the batch in one flush. On the H200 a flush of 64 requests x 128
# positions took 14.5 ms of device time and set the plain mode's p99 ITL at 2-3x the
# baseline's (benchmarks/results/h200-20261203-d79b2bd/README.md); smaller flushes
# bound the stall but each costs a fixed part, so the default stays 0 until a device
# call has compared them.
FLUSH_TOKENS_ENV = "SGLANG_DYNSPEC_FLUSH_TOKENS"
# Draft forwards that need the draft's last MLP at a few rows only (a buffer-full flush;
# the draft pass over a prefill, which keeps each request's last token) leave that MLP
# out elsewhere (compat.MlpAtRows), which SGLang's draft prefill CUDA graph cannot do:
# it replays the MLP it captured at every row. On the H200 (SGLang 0.5.17) that graph
# covers up to 8,192 tokens, so a flush of 64 x 128 positions ran the whole MLP and took
# the same 9.6-10.0 ms with and without the cut (benchmarks/results/h200-20261203-2c4f5f3/).
# From this many tokens such a forward runs eagerly; 0: never (SGLang's graph wherever it
# applies).
EAGER_DRAFT_TOKENS_ENV = "SGLANG_DYNSPEC_EAGER_DRAFT_TOKENS"
DEFAULT_EAGER_DRAFT_TOKENS = 1024
# 1: buffer-full flushes run on a second CUDA stream, so that the plain steps after one
# run beside it instead of waiting for it (catch_up.DraftCatchUp, device_timer.SideStream).
# The flush was the plain mode's p99 ITL excess on the 8B shape (1.0-1.3x the baseline's
# with eager flushes, 1.1-1.9x before; benchmarks/results/h200-20261204-673c6bf/). Off
# until a device call has compared it; with --tp-size > 1 refused (the flush's
# collectives would run beside the plain step's).
FLUSH_STREAM_ENV = "SGLANG_DYNSPEC_FLUSH_STREAM"
# 1: the target's verify attention runs SGLang's split-KV verify kernel
# (sglang/kernels/ops/attention/verify_splitkv.py: the prefix split across programs as in
# a decode, merged by log-sum-exp, then the causal block of the draft tokens) instead of
# its prefill kernel, which walks each request's whole prefix serially per query head.
# SGLang switches it on only on AMD gfx95 (TritonAttnBackend.use_verify_splitkv); the
# plugin sets it with the triton backend and --speculative-eagle-topk 1 (compat.use_split_kv_verify).
# On the H200 the prefill kernel was 64-89% of a speculative step (16.5 of 25.8 ms at
# C=64; benchmarks/results/h200-20261204b-2364f20/README.md); the split-KV kernel's bf16
# error equals the prefill kernel's and the step is 13.9 instead of 23.6 ms there
# (benchmarks/results/h200-20261204c-8c5c7b8/README.md), hence on by default; 0 keeps
# SGLang's kernel (an A/B, or a GPU where it measures slower).
SPLIT_KV_VERIFY_ENV = "SGLANG_DYNSPEC_SPLIT_KV_VERIFY"
# 1 (with the split-KV verify): each (request, KV head) program of the verify reads its
# keys and values once for all the query heads that share them (SGLang 0.5.23's
# grouped-head verify kernel, verify_mla.py, which SGLang uses only on AMD gfx95 for
# MLA and single-KV-head targets; vendored for 0.5.17 as verify_grouped_kernel.py), instead of
# once per query head; shapes it declines run the per-head split-KV kernel
# (compat.GroupedThenPerHead). With the per-head kernel the verify's attention was still
# 4.5 of a 13.9 ms step at C=64 on the H200 (benchmarks/results/h200-20261204c-8c5c7b8/).
# Off until a device call has timed it.
GROUPED_VERIFY_ENV = "SGLANG_DYNSPEC_GROUPED_VERIFY"
# 1 (with the split-KV verify): SGLang's per-head split-KV kernel splits each prefix into a
# count chosen by the batch size (compat.split_kv_splits) instead of SGLang's, which reads
# the index buffer's length and so ran 16 splits in every CUDA-graph replay, where 4 were
# 1.5x faster at batch 64 and 128 (compat.SPLIT_KV_PROGRAMS says where that was measured).
# 0: SGLang's count (an A/B).
SPLITS_BY_BATCH_ENV = "SGLANG_DYNSPEC_SPLIT_KV_SPLITS_BY_BATCH"
# 1: the draft extend after each verify (the draft over the step's draft positions) runs
# the same split-KV kernel instead of SGLang's prefill kernel (compat.SplitKVThenPrefill),
# with the split count by batch size where SPLITS_BY_BATCH_ENV is on. With the split-KV
# verify on, the prefill kernel's only calls in a speculative step are the draft extend's
# (`_fwd_kernel`, 14.75 ms in 40 steps at C=64 on the H100 against a 14.1 ms period:
# benchmarks/results/h100-20261206b-0043f33/profiles-spec-b.md). In the server it made the
# step 0.1-0.6 ms shorter and the load 0.8-1.6% faster at C=32-128 in both repeats
# (benchmarks/results/h100-20261207-e76add8/README.md), hence on by default; 0: SGLang's
# prefill kernel (an A/B).
SPLIT_KV_DRAFT_EXTEND_ENV = "SGLANG_DYNSPEC_SPLIT_KV_DRAFT_EXTEND"
# 1: in the draft extend after each verify the draft's LM head runs only at each request's
# last accepted position, the one whose logits the worker keeps, instead of at every draft
# position (compat.LogitsAtLastAccepted; SGLang 0.5.23's draft-extend graph does the same,
# 0.5.17's does not). Off: on the H100 the step's ITL p50 moved by at most 0.2 ms at C=32-128,
# within the run's spread (benchmarks/results/h100-20261208b-ec34cd2/README.md), and its
# proposals with CUDA graphs have not been checked at a real (unsimulated) acceptance.
LAST_ACCEPTED_LOGITS_ENV = "SGLANG_DYNSPEC_LAST_ACCEPTED_LOGITS"
# Where the start-up step-cost tables are cached (cost_cache); "off" disables the cache.
COST_CACHE_ENV = "SGLANG_DYNSPEC_COST_CACHE"


def cost_cache_dir(environ: Mapping[str, str] = os.environ):
    """The step-cost cache directory (a ``pathlib.Path``), or None when it is off."""
    from pathlib import Path

    raw = environ.get(COST_CACHE_ENV, "").strip()
    if raw.lower() in ("off", "0", "none"):
        return None
    if raw:
        return Path(raw).expanduser()
    return Path(environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sglang-dynspec"


def env_bool(name: str, default: bool, environ: Mapping[str, str] = os.environ) -> bool:
    """A boolean environment variable; anything but 1/true/yes/on or 0/false/no/off raises."""
    raw = environ.get(name, "").strip().lower()
    if raw == "":
        return default
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ConfigError(f"{name}={environ.get(name)!r}: accepted values are 1/true/yes/on or 0/false/no/off")


def thresholds_from_environ(environ: Mapping[str, str] = os.environ) -> SwitchThresholds:
    """Read and check the switching settings; raise ConfigError naming the flag."""
    disable_above = _read_non_negative_int(DISABLE_THRESHOLD, environ)
    enable_at_or_below = _read_non_negative_int(ENABLE_THRESHOLD, environ)
    dwell = _read_non_negative_int(MIN_DWELL, environ)

    if disable_above is None:
        disable_above = DEFAULT_DISABLE_ABOVE
    if disable_above < 2:
        # A decode batch has at least one request, so speculation can only resume at
        # M >= 1, and M must be below N.
        raise ConfigError(
            f"{DISABLE_THRESHOLD.describe()} must be at least 2 (speculation resumes at or "
            f"below {ENABLE_THRESHOLD.option}, which must be >= 1 and below it), got "
            f"{disable_above}; to never speculate, run without speculative decoding"
        )
    if enable_at_or_below is None:
        enable_at_or_below = default_enable_at_or_below(disable_above)
    elif not 1 <= enable_at_or_below < disable_above:
        raise ConfigError(
            f"{ENABLE_THRESHOLD.option} ({enable_at_or_below}) must be at least 1 and below "
            f"{DISABLE_THRESHOLD.option} ({disable_above}): speculation stops above the "
            "disable threshold and resumes at or below the enable threshold, and a decode "
            "batch always has at least one request; accepted: 1 <= M < N"
        )
    if dwell is None:
        dwell = DEFAULT_MIN_DWELL_STEPS
    return SwitchThresholds(disable_above, enable_at_or_below, dwell)


def catch_up_tokens_from_environ(environ: Mapping[str, str] = os.environ) -> int:
    """The catch-up buffer size per request (0: no catch-up); raise ConfigError naming the flag."""
    value = _read_non_negative_int(CATCH_UP_TOKENS, environ)
    if value is None:
        return DEFAULT_CATCH_UP_TOKENS
    if value > MAX_CATCH_UP_TOKENS:
        raise ConfigError(
            f"{CATCH_UP_TOKENS.describe()} must be between 0 and {MAX_CATCH_UP_TOKENS}, got "
            f"{value} (the buffer takes max running requests x this many positions of "
            "target hidden states)"
        )
    return value


_SOURCE = "source"  # the key of a Settings field's metadata: the flag or variable that sets it


def _set_by(source: str):
    """A ``Settings`` field and the flag or variable that sets it."""
    return field(metadata={_SOURCE: source})


@dataclass(frozen=True)
class Settings:
    """Every plugin setting of one process, validated.

    Each field names the flag or variable that sets it (``_set_by``): the cross-rank
    check (:func:`settings_disagreement`) compares every field and names its source,
    and refuses a field declared without one.
    """

    policy: str = _set_by(POLICY.describe())  # one of POLICIES
    thresholds: SwitchThresholds = _set_by(
        f"{DISABLE_THRESHOLD.option} / {ENABLE_THRESHOLD.option} / {MIN_DWELL.option}"
    )
    # goodput: the disable threshold when given explicitly
    speculation_bound: int | None = _set_by(DISABLE_THRESHOLD.describe())
    catch_up_tokens: int = _set_by(CATCH_UP_TOKENS.describe())  # 0: no draft catch-up
    penalties: str = _set_by(PENALTIES.describe())  # one of PENALTY_MODES
    # Positions one buffer-full flush replays at most; 0: the whole batch's gaps at once
    flush_tokens: int = _set_by(FLUSH_TOKENS_ENV)
    # Tokens from which a draft forward that needs its last MLP at a few rows runs eagerly; 0: never
    eager_draft_tokens: int = _set_by(EAGER_DRAFT_TOKENS_ENV)
    # True: buffer-full flushes on a side stream
    flush_stream: bool = _set_by(FLUSH_STREAM_ENV)
    # True: the target's verify attention through SGLang's split-KV verify kernel
    split_kv_verify: bool = _set_by(SPLIT_KV_VERIFY_ENV)
    # True: the split-KV verify through the grouped-head kernel first
    grouped_verify: bool = _set_by(GROUPED_VERIFY_ENV)
    # True: the per-head split-KV kernel's split count by batch size, not SGLang's
    splits_by_batch: bool = _set_by(SPLITS_BY_BATCH_ENV)
    # True: the draft extend's attention through the split-KV kernel too
    split_kv_draft_extend: bool = _set_by(SPLIT_KV_DRAFT_EXTEND_ENV)
    # True: the draft extend's LM head at the last accepted positions only
    last_accepted_logits: bool = _set_by(LAST_ACCEPTED_LOGITS_ENV)
    # False: plain steps run eagerly (saves the graph's memory)
    plain_cuda_graph: bool = _set_by(PLAIN_CUDA_GRAPH_ENV)
    # True: per-request step modes in meta_info (REQUEST_MODES_KEY)
    request_modes: bool = _set_by(REQUEST_MODES_ENV)
    simulated_acceptance: float | None = _set_by(SIMULATED_ACCEPTANCE_ENV)  # benchmarks only


def _source(setting: Field) -> str:
    """The flag or variable that sets a ``Settings`` field; a field without one is a bug."""
    source = setting.metadata.get(_SOURCE)
    if source is None:
        raise TypeError(
            f"Settings.{setting.name} does not name the flag or variable that sets it; declare it "
            f"with _set_by(...) so that the cross-rank check can compare and name it"
        )
    return source


def settings_disagreement(per_rank: Sequence[Settings]) -> str | None:
    """A message naming every setting that differs between tensor-parallel ranks, or None.

    ``per_rank``: one ``Settings`` per rank. Each rank reads its own environment; a
    stray export on one node would make ranks take different modes, catch-ups or
    graphs, and the next collective would hang.
    """
    lines = []
    for setting in fields(per_rank[0]):
        source = _source(setting)
        values = [getattr(s, setting.name) for s in per_rank]
        if any(v != values[0] for v in values[1:]):
            shown = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
            lines.append(f"{source} differs between tensor-parallel ranks ({shown})")
    if not lines:
        return None
    return (
        "; ".join(lines) + ". Every rank must run with the same sglang-dynspec settings: pass them as "
        "flags, or export the same environment variables on every node"
    )


def _read_choice(flag: Flag, default: str, environ: Mapping[str, str]) -> str:
    raw = environ.get(flag.env, "").strip().lower()
    if raw == "":
        return default
    if raw not in flag.choices:
        raise ConfigError(f"{flag.describe()} must be one of {', '.join(flag.choices)}, got {raw!r}")
    return raw


def policy_from_environ(environ: Mapping[str, str] = os.environ) -> str:
    return _read_choice(POLICY, DEFAULT_POLICY, environ)


def penalties_from_environ(environ: Mapping[str, str] = os.environ) -> str:
    return _read_choice(PENALTIES, DEFAULT_PENALTIES, environ)


def simulated_acceptance_from_environ(environ: Mapping[str, str] = os.environ) -> float | None:
    """SGLang's benchmark switch, read as SGLang reads it (``envs.SGLANG_SIMULATE_ACC_LEN``:
    a Python float, default -1). Above 0 the verify simulates that many accepted tokens
    per step, clamped to at least 1 (here) and at most the draft tokens (the controller,
    which knows them); 0, a negative value (SGLang's "off") and NaN (not above 0) are
    off: None. What ``float`` cannot read is refused, by name, as SGLang refuses it."""
    raw = environ.get(SIMULATED_ACCEPTANCE_ENV, "").strip()
    if raw == "":
        return None
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(
            f"{SIMULATED_ACCEPTANCE_ENV} must be a number (SGLang reads it as a float; 0 or less: off), "
            f"got {raw!r}"
        ) from None
    if not value > 0:
        return None
    return max(1.0, value)


def flush_tokens_from_environ(environ: Mapping[str, str] = os.environ) -> int:
    """Positions one buffer-full flush replays at most (0: no limit); raise ConfigError
    naming the variable."""
    value = _non_negative_int(environ, FLUSH_TOKENS_ENV, FLUSH_TOKENS_ENV)
    return 0 if value is None else value


def eager_draft_tokens_from_environ(environ: Mapping[str, str] = os.environ) -> int:
    """Tokens from which a flush or a prefill's draft pass runs outside SGLang's draft
    prefill graph (0: never); raise ConfigError naming the variable."""
    value = _non_negative_int(environ, EAGER_DRAFT_TOKENS_ENV, EAGER_DRAFT_TOKENS_ENV)
    return DEFAULT_EAGER_DRAFT_TOKENS if value is None else value


def settings_from_environ(environ: Mapping[str, str] = os.environ) -> Settings:
    """Read every plugin setting; raise ConfigError naming the first bad one."""
    policy = policy_from_environ(environ)
    bound = None
    if policy == "goodput":
        if _read_non_negative_int(ENABLE_THRESHOLD, environ) is not None:
            raise ConfigError(
                f"{ENABLE_THRESHOLD.describe()} has no meaning with {POLICY.option} goodput (it speculates "
                f"again when speculation pays); accepted with goodput: {DISABLE_THRESHOLD.option} "
                "as a hard upper bound on the batch size that speculates, and "
                f"{MIN_DWELL.option}; or use {POLICY.option} threshold"
            )
        bound = _read_non_negative_int(DISABLE_THRESHOLD, environ)
        if bound is not None and bound < 1:
            raise ConfigError(
                f"{DISABLE_THRESHOLD.describe()} must be at least 1 with {POLICY.option} goodput, got {bound}"
            )
    split_kv = env_bool(SPLIT_KV_VERIFY_ENV, True, environ)
    grouped = env_bool(GROUPED_VERIFY_ENV, False, environ)
    if grouped and not split_kv:
        raise ConfigError(
            f"{GROUPED_VERIFY_ENV}=1 needs the split-KV verify, which {SPLIT_KV_VERIFY_ENV}=0 turns off "
            f"(the grouped-head kernel is a split-KV verify kernel); unset one of them"
        )
    return Settings(
        policy=policy,
        thresholds=thresholds_from_environ(environ)
        if policy == "threshold"
        else _default_thresholds(environ),
        speculation_bound=bound,
        catch_up_tokens=catch_up_tokens_from_environ(environ),
        flush_tokens=flush_tokens_from_environ(environ),
        eager_draft_tokens=eager_draft_tokens_from_environ(environ),
        flush_stream=env_bool(FLUSH_STREAM_ENV, False, environ),
        split_kv_verify=split_kv,
        grouped_verify=grouped,
        splits_by_batch=env_bool(SPLITS_BY_BATCH_ENV, True, environ),
        split_kv_draft_extend=env_bool(SPLIT_KV_DRAFT_EXTEND_ENV, True, environ),
        last_accepted_logits=env_bool(LAST_ACCEPTED_LOGITS_ENV, False, environ),
        penalties=penalties_from_environ(environ),
        plain_cuda_graph=env_bool(PLAIN_CUDA_GRAPH_ENV, True, environ),
        request_modes=env_bool(REQUEST_MODES_ENV, False, environ),
        simulated_acceptance=simulated_acceptance_from_environ(environ),
    )


def _default_thresholds(environ: Mapping[str, str]) -> SwitchThresholds:
    dwell = _read_non_negative_int(MIN_DWELL, environ)
    return SwitchThresholds(
        DEFAULT_DISABLE_ABOVE,
        default_enable_at_or_below(DEFAULT_DISABLE_ABOVE),
        DEFAULT_MIN_DWELL_STEPS if dwell is None else dwell,
    )


def build_policy(settings: Settings, max_acceptance: float = 4.0) -> ModePolicy:
    """The mode policy the settings ask for (``max_acceptance``: the most tokens one
    speculative step can give, ``--speculative-num-draft-tokens``)."""
    return POLICY_FACTORIES[settings.policy](settings, max_acceptance)


def unreachable_bound_warning(settings: Settings, max_running_requests: int) -> str | None:
    """A warning naming both flags when the batch-size bound can never be crossed: a
    decode batch holds at most ``max_running_requests`` requests."""
    if settings.policy == "threshold":
        bound, what = settings.thresholds.disable_above, "speculation never stops"
    elif settings.speculation_bound is not None:
        bound, what = settings.speculation_bound, "the bound never applies"
    else:
        return None
    if bound < max_running_requests:
        return None
    return (
        f"{DISABLE_THRESHOLD.option} {bound} is not below --max-running-requests "
        f"{max_running_requests}: a decode batch never has more than {bound} requests, so {what}"
    )
