"""Registration through SGLang's plugin system, argument resolution, and start-up checks.

These import real SGLang (0.5.23 in CI) on the CPU, in this process or in a fresh
interpreter that discovers the plugin from its installed entry point, but start no
server. ``conftest.py`` puts the test bed's ``sgl_kernel`` stand-in on the path.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest

from dynspec_testbed.serve import server_environment
from sglang_dynspec import config


@pytest.fixture(scope="module")
def plugin_loaded():
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    return SpeculativeAlgorithm.from_string(config.ALGORITHM_NAME)


@pytest.fixture
def clean_flag_env(monkeypatch):
    """The flags' argparse actions export values; start empty and restore afterwards."""
    for flag in config.FLAGS:
        monkeypatch.setenv(flag.env, "")
    return monkeypatch


def test_algorithm_answers_every_query_as_eagle3(plugin_loaded):
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    eagle3 = SpeculativeAlgorithm.EAGLE3
    algo = plugin_loaded
    assert type(algo).__mro__[1].__name__ == "CustomSpecAlgo"
    checked = []
    for name, member in vars(SpeculativeAlgorithm).items():
        if name.startswith(("is_", "supports_")) or name in (
            "need_topk",
            "carries_draft_hidden_states",
            "has_draft_kv",
        ):
            if inspect.isfunction(member) and len(inspect.signature(member).parameters) == 1:
                assert getattr(algo, name)() == getattr(eagle3, name)(), name
                checked.append(name)
    assert {
        "is_eagle",
        "is_eagle3",
        "supports_grammar_overlap",
        "supports_mixed_chunk",
        "need_topk",
        "carries_draft_hidden_states",
    } <= set(checked)
    assert algo.name == "EAGLE3_DYNAMIC" and algo.supports_overlap


def test_future_map_is_built_for_our_algorithm(plugin_loaded):
    import torch

    class Pool:
        size = 4
        req_to_token = torch.zeros((5, 8), dtype=torch.int32)
        device = "cpu"

    fm = plugin_loaded.create_future_map(torch.device("cpu"), Pool())
    assert type(fm).__name__ == "FutureMap"
    held = [v for v in vars(fm).values() if v is plugin_loaded]
    assert held, "the FutureMap must be built for EAGLE3_DYNAMIC itself, not for the EAGLE3 enum"


def test_factory_returns_the_dynamic_worker(plugin_loaded, clean_flag_env):
    from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2

    from sglang_dynspec.worker import DynamicEagleWorker

    cls = plugin_loaded.create_worker(_resolve(["--disable-overlap-schedule"]))
    assert cls is DynamicEagleWorker and issubclass(cls, EAGLEWorkerV2)


# ----------------------------------------------------------------- resolution
TARGET_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float32",
}
DRAFT_CONFIG = {
    **TARGET_CONFIG,
    "architectures": ["LlamaForCausalLMEagle3"],
    "num_hidden_layers": 1,
    "draft_vocab_size": 512,
    "target_hidden_size": 256,
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("configs")
    for name, cfg in (("target", TARGET_CONFIG), ("draft", DRAFT_CONFIG)):
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(cfg))
    return {"target": str(root / "target"), "draft": str(root / "draft")}


_model_dirs = {}


@pytest.fixture(autouse=True)
def _remember_dirs(model_dirs):
    _model_dirs.update(model_dirs)


def _argv(algorithm="EAGLE3_DYNAMIC", extra=(), draft="draft"):
    argv = [
        "--model-path",
        _model_dirs["target"],
        "--device",
        "cpu",
        "--attention-backend",
        "intel_amx",
        "--speculative-algorithm",
        algorithm,
    ]
    if draft:
        argv += ["--speculative-draft-model-path", _model_dirs[draft]]
    return argv + list(extra)


def _resolve(extra=(), algorithm="EAGLE3_DYNAMIC", draft="draft"):
    """Parse with SGLang's own parser (plugin flags included) and resolve, as a launcher does."""
    from sglang.srt.runtime_context import override_platform
    from sglang.srt.server_args import prepare_server_args

    server_args = prepare_server_args(_argv(algorithm, extra, draft))
    with override_platform(has_amx=True):
        server_args.resolve_once()
    return server_args


RESOLVED_FIELDS = (
    "speculative_num_steps",
    "speculative_eagle_topk",
    "speculative_num_draft_tokens",
    "max_running_requests",
    "disable_overlap_schedule",
    "enable_mixed_chunk",
)


def _resolved(server_args):
    from sglang.srt.arg_groups.overrides import resolved_view

    view = resolved_view(server_args)
    return {f: getattr(view, f) for f in RESOLVED_FIELDS}


@pytest.mark.parametrize(
    "extra",
    [
        [],  # automatic steps / topk / draft tokens, default max running requests
        [
            "--speculative-num-steps",
            "3",
            "--speculative-eagle-topk",
            "1",
            "--speculative-num-draft-tokens",
            "8",
        ],
        [
            "--speculative-num-steps",
            "5",
            "--speculative-eagle-topk",
            "4",
            "--speculative-num-draft-tokens",
            "16",
            "--max-running-requests",
            "64",
            "--enable-mixed-chunk",
        ],
    ],
)
def test_resolves_exactly_like_eagle3(plugin_loaded, clean_flag_env, extra):
    eagle3 = _resolved(_resolve(extra, algorithm="EAGLE3"))
    dynamic = _resolved(_resolve(extra))
    assert dynamic == eagle3
    assert eagle3["speculative_num_steps"] is not None and eagle3["max_running_requests"] is not None


def test_flags_reach_the_environment(plugin_loaded, clean_flag_env):
    _resolve(
        [
            "--speculative-dynamic-policy",
            "threshold",
            "--speculative-disable-batch-threshold",
            "40",
            "--speculative-enable-batch-threshold",
            "30",
            "--speculative-min-dwell-steps",
            "4",
        ]
    )
    t = config.thresholds_from_environ()
    assert (t.disable_above, t.enable_at_or_below, t.min_dwell_steps) == (40, 30, 4)


def test_catch_up_flag_reaches_the_environment_and_is_checked_at_resolution(plugin_loaded, clean_flag_env):
    _resolve(["--speculative-catch-up-tokens", "16"])
    assert config.catch_up_tokens_from_environ() == 16
    with pytest.raises(ValueError, match="--speculative-catch-up-tokens .* between 0 and 4096"):
        _resolve(["--speculative-catch-up-tokens", "5000"])


class _Records(logging.Handler):
    """Keeps the records of one logger (SGLang's argument parsing reconfigures the root
    logger's handlers, pytest's caplog among them)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.mark.parametrize(
    "algorithm, warned", [("EAGLE3", True), (None, True), (config.ALGORITHM_NAME, False)]
)
def test_plugin_flags_with_another_algorithm_are_named_as_ignored(
    plugin_loaded, clean_flag_env, algorithm, warned
):
    from sglang.srt.server_args import prepare_server_args

    argv = ["--model-path", "m", "--speculative-catch-up-tokens", "16", "--speculative-min-dwell-steps", "4"]
    if algorithm is not None:
        argv += ["--speculative-algorithm", algorithm]
    records, logger = _Records(), logging.getLogger("sglang_dynspec")
    logger.addHandler(records)
    try:
        prepare_server_args(argv)
    finally:
        logger.removeHandler(records)
    lines = [m for m in records.messages if "ignored" in m]
    if warned:
        [line] = lines
        assert "--speculative-catch-up-tokens" in line and "--speculative-min-dwell-steps" in line
        assert (
            "without --speculative-algorithm"
            if algorithm is None
            else f"with --speculative-algorithm {algorithm}"
        ) in line
        assert f"only with --speculative-algorithm {config.ALGORITHM_NAME}" in line
    else:
        assert lines == []


def test_negative_flag_is_an_argparse_error_naming_it(plugin_loaded, clean_flag_env, capsys):
    with pytest.raises(SystemExit):
        _resolve(["--speculative-min-dwell-steps", "-1"])
    assert "--speculative-min-dwell-steps" in capsys.readouterr().err


def test_non_integer_flag_is_an_argparse_error_naming_it(plugin_loaded, clean_flag_env, capsys):
    with pytest.raises(SystemExit):
        _resolve(["--speculative-disable-batch-threshold", "lots"])
    assert "--speculative-disable-batch-threshold" in capsys.readouterr().err


@pytest.mark.parametrize(
    "extra, expected",
    [
        (
            [
                *("--speculative-dynamic-policy", "threshold"),
                *("--speculative-disable-batch-threshold", "8", "--speculative-enable-batch-threshold", "8"),
            ],
            "--speculative-enable-batch-threshold (8) must be at least 1 and below --speculative-disable-batch-threshold (8)",
        ),
        (["--speculative-adaptive"], "--speculative-adaptive"),
        (["--enable-two-batch-overlap"], "--enable-two-batch-overlap"),
        (["--enable-pdmux"], "--enable-pdmux"),
        (["--pp-size", "2"], "--pp-size"),
        (["--enable-custom-logit-processor"], "--enable-custom-logit-processor"),
        (
            ["--speculative-dynamic-policy", "goodput", "--speculative-enable-batch-threshold", "4"],
            "--speculative-enable-batch-threshold (environment variable SGLANG_DYNSPEC_ENABLE_BATCH_THRESHOLD) "
            "has no meaning with --speculative-dynamic-policy goodput",
        ),
        (  # goodput is the default
            ["--speculative-enable-batch-threshold", "4"],
            "--speculative-enable-batch-threshold (environment variable SGLANG_DYNSPEC_ENABLE_BATCH_THRESHOLD) "
            "has no meaning with --speculative-dynamic-policy goodput",
        ),
        # DP attention is not here: SGLang's CPU platform resolves it off before the
        # plugin's check runs; test_config covers that message.
    ],
)
def test_unsupported_settings_fail_at_resolution(plugin_loaded, clean_flag_env, extra, expected):
    with pytest.raises(ValueError) as e:
        _resolve(extra)
    assert expected in str(e.value)


def test_draft_that_is_not_eagle3_is_refused(plugin_loaded, clean_flag_env):
    with pytest.raises(ValueError, match="is not an EAGLE-3 draft"):
        _resolve(draft="target")


def test_bad_environment_value_is_refused(plugin_loaded, clean_flag_env):
    clean_flag_env.setenv(config.DISABLE_THRESHOLD.env, "-5")
    with pytest.raises(ValueError, match="SGLANG_DYNSPEC_DISABLE_BATCH_THRESHOLD"):
        _resolve()


# ------------------------------------------------------- fresh interpreters
def _fresh_python(code: str, env_extra=None, timeout=300):
    env = server_environment({**os.environ, **(env_extra or {})})
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


RESOLVE_EAGLE3 = """
    import json
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang.srt.arg_groups.overrides import resolved_view
    from sglang.srt.runtime_context import override_platform
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    sa = prepare_server_args(ARGV)
    with override_platform(has_amx=True):
        sa.resolve_once()
    view = resolved_view(sa)
    try:
        SpeculativeAlgorithm.from_string("EAGLE3_DYNAMIC"); registered = True
    except ValueError:
        registered = False
    print("RESULT", json.dumps({"registered": registered,
                                **{f: getattr(view, f) for f in FIELDS}}))
"""


def test_entry_point_discovery_and_stock_eagle3_unchanged(model_dirs):
    """A fresh interpreter finds the plugin through its installed entry point, and
    stock EAGLE3 resolves the same with the plugin loaded as without it."""
    code = RESOLVE_EAGLE3.replace("ARGV", repr(_argv("EAGLE3"))).replace("FIELDS", repr(RESOLVED_FIELDS))

    def result(env):
        proc = _fresh_python(code, env)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        assert proc.returncode == 0 and lines, proc.stderr[-3000:]
        return json.loads(lines[-1][len("RESULT ") :])

    with_plugin = result({})
    without_plugin = result({"SGLANG_DYNSPEC_ENABLED": "0"})
    assert with_plugin.pop("registered") is True
    assert without_plugin.pop("registered") is False
    assert with_plugin == without_plugin


SGLANG_CLI = os.path.join(os.path.dirname(sys.executable), "sglang")  # the `sglang` console script


@pytest.mark.parametrize(
    "launcher",
    [[sys.executable, "-m", "sglang.launch_server"], [SGLANG_CLI, "serve"]],
    ids=["launch_server", "sglang_serve"],
)
def test_launchers_refuse_bad_input_before_loading_weights(model_dirs, launcher):
    """Through the real launchers: a bad flag value fails at start-up, naming the flag."""
    argv = _argv(
        extra=[
            *("--speculative-dynamic-policy", "threshold"),
            *("--speculative-disable-batch-threshold", "4", "--speculative-enable-batch-threshold", "9"),
        ]
    )
    env = server_environment(dict(os.environ))
    proc = subprocess.run([*launcher, *argv], env=env, capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-3000:]
    assert "--speculative-enable-batch-threshold (9) must be at least 1 and below" in output, output[-3000:]
    assert "Load weight" not in output and "load_weight" not in output
