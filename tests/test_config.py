"""Flag values, defaults, refusals and the messages a user sees for bad input (pure Python)."""

from __future__ import annotations

import dataclasses
import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_dynspec import config, refusals
from sglang_dynspec.config import (
    CATCH_UP_TOKENS,
    DISABLE_THRESHOLD,
    ENABLE_THRESHOLD,
    MIN_DWELL,
    ConfigError,
    catch_up_tokens_from_environ,
    thresholds_from_environ,
)


def env(**values):
    names = {"n": DISABLE_THRESHOLD.env, "m": ENABLE_THRESHOLD.env, "k": MIN_DWELL.env}
    return {names[k]: v for k, v in values.items()}


def test_defaults():
    t = thresholds_from_environ({})
    assert (t.disable_above, t.enable_at_or_below, t.min_dwell_steps) == (32, 28, 8)


@pytest.mark.parametrize("n, expected_m", [(2, 1), (3, 2), (8, 7), (16, 14), (32, 28), (64, 56)])
def test_enable_threshold_defaults_slightly_below_disable(n, expected_m):
    assert thresholds_from_environ(env(n=str(n))).enable_at_or_below == expected_m


def test_explicit_values():
    t = thresholds_from_environ(env(n="10", m="3", k="0"))
    assert (t.disable_above, t.enable_at_or_below, t.min_dwell_steps) == (10, 3, 0)


@pytest.mark.parametrize(
    "values, flag",
    [
        (dict(n="-1"), DISABLE_THRESHOLD),
        (dict(m="-2"), ENABLE_THRESHOLD),
        (dict(k="-3"), MIN_DWELL),
        (dict(n="ten"), DISABLE_THRESHOLD),
        (dict(k="1.5"), MIN_DWELL),
    ],
)
def test_bad_values_name_the_flag_and_what_is_accepted(values, flag):
    with pytest.raises(ConfigError) as e:
        thresholds_from_environ(env(**values))
    msg = str(e.value)
    assert flag.option in msg and flag.env in msg
    assert "non-negative integer" in msg


@pytest.mark.parametrize(
    "raw, expected", [(None, 128), ("", 128), ("0", 0), ("1", 1), ("32", 32), ("4096", 4096)]
)
def test_catch_up_buffer_size(raw, expected):
    environ = {} if raw is None else {CATCH_UP_TOKENS.env: raw}
    assert catch_up_tokens_from_environ(environ) == expected


@pytest.mark.parametrize(
    "raw, accepted",
    [("-1", "non-negative integer"), ("x", "non-negative integer"), ("4097", "between 0 and 4096")],
)
def test_bad_catch_up_buffer_size_names_the_flag(raw, accepted):
    with pytest.raises(ConfigError) as e:
        catch_up_tokens_from_environ({CATCH_UP_TOKENS.env: raw})
    msg = str(e.value)
    assert CATCH_UP_TOKENS.option in msg and CATCH_UP_TOKENS.env in msg and accepted in msg


@pytest.mark.parametrize("raw, expected", [(None, 0), ("", 0), ("0", 0), ("2048", 2048)])
def test_flush_budget_defaults_to_none(raw, expected):
    environ = {} if raw is None else {config.FLUSH_TOKENS_ENV: raw}
    assert config.flush_tokens_from_environ(environ) == expected
    assert config.settings_from_environ(environ).flush_tokens == expected


@pytest.mark.parametrize("raw", ["-1", "x", "1.5"])
def test_bad_flush_budget_names_the_variable(raw):
    with pytest.raises(ConfigError, match=f"{config.FLUSH_TOKENS_ENV} must be a non-negative integer"):
        config.settings_from_environ({config.FLUSH_TOKENS_ENV: raw})


@pytest.mark.parametrize("raw, expected", [(None, 1024), ("", 1024), ("0", 0), ("1", 1), ("8192", 8192)])
def test_the_drafts_prefill_graph_is_left_from_1024_tokens_by_default(raw, expected):
    environ = {} if raw is None else {config.EAGER_DRAFT_TOKENS_ENV: raw}
    assert config.settings_from_environ(environ).eager_draft_tokens == expected


@pytest.mark.parametrize("raw", ["-1", "x", "1.5", "1e3"])
def test_a_bad_eager_threshold_names_the_variable(raw):
    with pytest.raises(ConfigError, match=f"{config.EAGER_DRAFT_TOKENS_ENV} must be a non-negative integer"):
        config.settings_from_environ({config.EAGER_DRAFT_TOKENS_ENV: raw})


@pytest.mark.parametrize("raw, expected", [(None, False), ("", False), ("1", True), ("off", False)])
def test_flushes_stay_on_the_schedulers_stream_by_default(raw, expected):
    environ = {} if raw is None else {config.FLUSH_STREAM_ENV: raw}
    assert config.settings_from_environ(environ).flush_stream is expected


@pytest.mark.parametrize("tp_size, refused", [(None, False), (1, False), (2, True)])
def test_a_flush_stream_is_refused_with_tensor_parallelism(tp_size, refused):
    settings = config.settings_from_environ({config.FLUSH_STREAM_ENV: "1"})
    error = refusals.settings_error(settings, types.SimpleNamespace(tp_size=tp_size))
    if refused:
        assert config.FLUSH_STREAM_ENV in error and "--tp-size 2" in error
    else:
        assert error is None
    assert refusals.settings_error(config.settings_from_environ({}), types.SimpleNamespace(tp_size=2)) is None


def test_start_up_refuses_a_flush_stream_with_tensor_parallelism(monkeypatch):
    import schedule_batches  # noqa: F401  (the CPU import of SGLang)

    from sglang_dynspec import plugin

    monkeypatch.setenv(config.FLUSH_STREAM_ENV, "1")
    with pytest.raises(ConfigError, match=f"{config.FLUSH_STREAM_ENV}=1 is not supported with --tp-size 2"):
        plugin.validate_server_args(types.SimpleNamespace(tp_size=2, pp_size=1))
    with pytest.raises(ConfigError, match="--speculative-draft-model-path is required"):  # the next check
        plugin.validate_server_args(types.SimpleNamespace(tp_size=1, pp_size=1))


@pytest.mark.parametrize("n, m", [(8, 8), (8, 9), (8, 0)])
def test_enable_threshold_must_be_between_1_and_disable(n, m):
    with pytest.raises(ConfigError) as e:
        thresholds_from_environ(env(n=str(n), m=str(m)))
    msg = str(e.value)
    assert ENABLE_THRESHOLD.option in msg and DISABLE_THRESHOLD.option in msg
    assert "1 <= M < N" in msg


@pytest.mark.parametrize("n", ["0", "1"])
def test_disable_threshold_below_2_is_refused(n):
    # A decode batch always has a request, so speculation could never resume.
    with pytest.raises(ConfigError, match="must be at least 2"):
        thresholds_from_environ(env(n=n))


@pytest.mark.parametrize(
    "raw, expected", [("", True), ("1", True), ("on", True), ("0", False), ("No", False)]
)
def test_boolean_environment_variables(raw, expected):
    assert config.env_bool("X", True, {"X": raw}) is expected


def test_bad_boolean_environment_variable_is_refused():
    with pytest.raises(ConfigError, match="SGLANG_DYNSPEC_PLAIN_CUDA_GRAPH='maybe'"):
        config.env_bool(config.PLAIN_CUDA_GRAPH_ENV, True, {config.PLAIN_CUDA_GRAPH_ENV: "maybe"})


@pytest.mark.parametrize(
    "attrs, option",
    [
        (dict(pp_size=2), "--pp-size"),
        (dict(enable_dp_attention=True), "--enable-dp-attention"),
        (dict(enable_two_batch_overlap=True), "--enable-two-batch-overlap"),
        (dict(enable_pdmux=True), "--enable-pdmux"),
        (dict(speculative_adaptive=True), "--speculative-adaptive"),
        (dict(tokenizer_worker_num=2), "--tokenizer-worker-num"),
        (dict(disaggregation_mode="decode"), "--disaggregation-mode"),
        (dict(enable_multi_layer_eagle=True), "--enable-multi-layer-eagle"),
        (dict(enable_lora=True), "--enable-lora"),
        (dict(lora_paths=["adapter=/m/a"]), "--lora-paths"),
        (dict(enable_custom_logit_processor=True), "--enable-custom-logit-processor"),
        (dict(dp_size=2), "--dp-size"),
        (dict(attn_cp_size=2), "--attn-cp-size"),
        (dict(page_size=16), "--page-size"),
        (dict(enable_return_hidden_states=True), "--enable-return-hidden-states"),
        (dict(cuda_graph_backend_decode="breakable"), "--cuda-graph-backend-decode"),
        (dict(cuda_graph_backend_decode="tc_piecewise"), "--cuda-graph-backend-decode"),
        (dict(cuda_graph_backend_prefill="full"), "--cuda-graph-backend-prefill"),
        (dict(cuda_graph_backend_prefill="tc_piecewise"), "--cuda-graph-backend-prefill"),
    ],
)
def test_unsupported_setups_are_named(attrs, option):
    args = types.SimpleNamespace(pp_size=1, **{k: v for k, v in attrs.items() if k != "pp_size"})
    if "pp_size" in attrs:
        args.pp_size = attrs["pp_size"]
    reason = refusals.unsupported_reason(args)
    assert reason is not None and option in reason and "EAGLE3_DYNAMIC" in reason


@pytest.mark.parametrize(
    "hybrid_swa, linear, named",
    [
        (True, False, ["hybrid sliding-window attention"]),
        (False, True, ["linear-attention (Mamba, GDN) layers"]),
        (True, True, ["hybrid sliding-window attention", "linear-attention"]),
    ],
)
def test_hybrid_targets_are_refused_naming_the_model(hybrid_swa, linear, named):
    error = refusals.target_model_error("/m/target", hybrid_swa, linear)
    assert error.startswith("--model-path /m/target: a target with ") and "EAGLE3_DYNAMIC" in error
    assert all(kind in error for kind in named)
    assert refusals.target_model_error("/m/target", False, False) is None


def test_the_target_attention_kinds_are_read_from_sglangs_model_config():
    from sglang_dynspec import compat

    def worker(is_hybrid_swa, linear):
        model_config = types.SimpleNamespace(is_hybrid_swa=is_hybrid_swa, linear_attn_registry_result=linear)
        runner = types.SimpleNamespace(model_config=model_config)
        return types.SimpleNamespace(target_worker=types.SimpleNamespace(model_runner=runner))

    assert compat.target_attention_kinds(worker(False, None)) == (False, False)
    assert compat.target_attention_kinds(worker(True, ("spec", "cfg"))) == (True, True)


def test_supported_setup_has_no_reason():
    args = types.SimpleNamespace(
        pp_size=1,
        enable_dp_attention=False,
        enable_two_batch_overlap=False,
        dp_size=1,
        attn_cp_size=1,
        page_size=1,
        enable_return_hidden_states=False,
    )
    assert refusals.unsupported_reason(args) is None
    for decode in (None, "full", "disabled"):
        for prefill in (None, "breakable", "disabled"):
            graphs = types.SimpleNamespace(
                cuda_graph_backend_decode=decode, cuda_graph_backend_prefill=prefill
            )
            assert refusals.unsupported_reason(graphs) is None, (decode, prefill)


def test_draft_checks():
    assert "required" in refusals.draft_architecture_error(None, None)
    msg = refusals.draft_architecture_error("/m/llama", ["LlamaForCausalLM"])
    assert "--speculative-draft-model-path /m/llama" in msg and "EAGLE-3" in msg
    assert refusals.draft_architecture_error("/m/d", ["LlamaForCausalLMEagle3"]) is None


@pytest.mark.parametrize("raw, expected", [(None, False), ("0", False), ("1", True), ("on", True)])
def test_request_modes_are_off_unless_asked(raw, expected):
    environ = {} if raw is None else {config.REQUEST_MODES_ENV: raw}
    assert config.settings_from_environ(environ).request_modes is expected


def test_request_modes_value_is_checked():
    with pytest.raises(config.ConfigError, match=config.REQUEST_MODES_ENV):
        config.settings_from_environ({config.REQUEST_MODES_ENV: "maybe"})


@pytest.mark.parametrize("raw, expected", [(None, "relaxed"), ("exact", "exact"), ("Relaxed", "relaxed")])
def test_penalties_default_to_relaxed(raw, expected):
    environ = {} if raw is None else {config.PENALTIES.env: raw}
    assert config.settings_from_environ(environ).penalties == expected


def test_bad_penalties_value_names_the_flag_and_the_choices():
    with pytest.raises(
        ConfigError, match=r"--speculative-penalties .*must be one of exact, relaxed, got 'strict'"
    ):
        config.settings_from_environ({config.PENALTIES.env: "strict"})


def test_penalties_that_differ_between_ranks_are_named():
    exact = config.settings_from_environ({config.PENALTIES.env: "exact"})
    relaxed = config.settings_from_environ({})
    message = config.settings_disagreement([exact, relaxed])
    assert "--speculative-penalties" in message and "rank 0: exact, rank 1: relaxed" in message


def test_a_setting_without_a_source_fails_the_cross_rank_check():
    """A Settings field added without the flag or variable that sets it cannot slip
    past the cross-rank check: the check compares every field and names its source."""

    @dataclasses.dataclass(frozen=True)
    class WithNewField(config.Settings):
        new_field: int = 0

    base = config.settings_from_environ({})
    assert config.settings_disagreement([base, base]) is None  # every field of Settings has one
    same = WithNewField(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)})
    with pytest.raises(TypeError, match="Settings.new_field does not name the flag or variable"):
        config.settings_disagreement([same, same])


@pytest.mark.parametrize(
    "environ, max_running, warned",
    [
        ({config.POLICY.env: "threshold"}, 128, False),  # threshold 32 < 128
        ({config.POLICY.env: "threshold"}, 32, True),  # a batch never exceeds 32: speculation never stops
        ({config.POLICY.env: "threshold", config.DISABLE_THRESHOLD.env: "64"}, 48, True),
        ({}, 8, False),  # the default (goodput) with no bound given
        ({config.DISABLE_THRESHOLD.env: "16"}, 16, True),
        ({config.DISABLE_THRESHOLD.env: "16"}, 17, False),
        ({config.POLICY.env: "goodput", config.DISABLE_THRESHOLD.env: "16"}, 16, True),
    ],
)
def test_a_bound_that_can_never_be_crossed_is_warned_about_naming_both_flags(environ, max_running, warned):
    message = config.unreachable_bound_warning(config.settings_from_environ(environ), max_running)
    assert (message is not None) == warned
    if warned:
        assert config.DISABLE_THRESHOLD.option in message and "--max-running-requests" in message


def test_the_default_policy_is_goodput_and_threshold_stays_an_option():
    assert config.settings_from_environ({}).policy == "goodput"
    assert config.settings_from_environ({config.POLICY.env: "threshold"}).policy == "threshold"
    assert isinstance(config.build_policy(config.settings_from_environ({})), config.GoodputPolicy)


# ------------------------------------------------------------------ bad input, any input
ENV_NAMES = [flag.env for flag in config.FLAGS] + [
    config.FLUSH_TOKENS_ENV,
    config.EAGER_DRAFT_TOKENS_ENV,
    config.FLUSH_STREAM_ENV,
    config.PLAIN_CUDA_GRAPH_ENV,
    config.REQUEST_MODES_ENV,
    config.SIMULATED_ACCEPTANCE_ENV,
]


@settings(max_examples=400, deadline=None)
@given(
    values=st.dictionaries(
        st.sampled_from(ENV_NAMES),
        st.one_of(
            st.text(max_size=12),
            st.integers(-5, 300).map(str),
            st.sampled_from(["nan", "inf", "-inf", "1e3", "+4", "1_0", "\uff15", " 7 ", "0x10", "3.5"]),
        ),
        max_size=3,
    )
)
def test_every_setting_either_reads_as_documented_or_names_its_flag(values):
    """Whatever the environment holds, reading the settings either succeeds with values
    of the documented kinds or raises a ConfigError naming a variable that was set."""
    try:
        s = config.settings_from_environ(values)
    except ConfigError as e:
        message = str(e)
        options = {flag.env: flag.option for flag in config.FLAGS}
        assert any(name in message or options.get(name, name) in message for name in values), (
            values,
            message,
        )
        return
    assert s.policy in config.POLICIES and s.penalties in config.PENALTY_MODES
    for number in (s.catch_up_tokens, s.flush_tokens, s.eager_draft_tokens, s.thresholds.min_dwell_steps):
        assert isinstance(number, int) and number >= 0
    assert 0 <= s.catch_up_tokens <= config.MAX_CATCH_UP_TOKENS
    assert s.simulated_acceptance is None or s.simulated_acceptance >= 1  # never NaN
    for name, raw in values.items():  # integers only as plain decimal digits
        if (
            name
            in (
                config.CATCH_UP_TOKENS.env,
                config.FLUSH_TOKENS_ENV,
                config.EAGER_DRAFT_TOKENS_ENV,
                config.MIN_DWELL.env,
            )
            and raw.strip()
        ):
            assert raw.strip().isascii() and raw.strip().isdigit(), (name, raw)


@pytest.mark.parametrize(
    "raw, expected",
    [("3", 3.0), ("0.5", 1.0), ("0", None), ("-1", None), ("nan", None), ("inf", float("inf"))],
)
def test_simulated_acceptance_is_read_as_sglang_reads_it(raw, expected):
    assert config.simulated_acceptance_from_environ({config.SIMULATED_ACCEPTANCE_ENV: raw}) == expected


def test_an_unreadable_simulated_acceptance_names_the_variable():
    with pytest.raises(ConfigError, match=f"{config.SIMULATED_ACCEPTANCE_ENV} must be a number"):
        config.settings_from_environ({config.SIMULATED_ACCEPTANCE_ENV: "three"})


@pytest.mark.parametrize("raw", ["+4", "1_0", "\uff15", "4.0", "0x10"])
def test_integers_are_read_in_plain_decimal_only(raw):
    with pytest.raises(ConfigError, match="non-negative integer"):
        catch_up_tokens_from_environ({CATCH_UP_TOKENS.env: raw})
