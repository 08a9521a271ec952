"""Tests of the test bed's launcher helpers and its overlap plugin (no server)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from dynspec_testbed import SHIM_DIR, serve
from dynspec_testbed.plugin import (
    OVERLAP_ENV,
    TESTBED_ENV,
    gather_spec_extras_torch,
    overlap_requested,
)
from dynspec_testbed.serve import MODULE, server_environment, with_cpu_defaults
from sglang_dynspec.config import ConfigError


@pytest.mark.parametrize(
    "raw, expected",
    [("1", True), ("yes", True), (" On ", True), ("0", False), ("", False), ("off", False)],
)
def test_overlap_flag_is_read_with_the_plugins_boolean_parser(monkeypatch, raw, expected):
    monkeypatch.setenv(TESTBED_ENV, "1")
    monkeypatch.setenv(OVERLAP_ENV, raw)
    assert overlap_requested() is expected


def test_a_malformed_overlap_flag_fails_the_launcher_naming_the_variable(monkeypatch):
    monkeypatch.setenv(OVERLAP_ENV, "maybe")
    monkeypatch.setattr(serve.os, "execve", lambda *args: pytest.fail("re-executed"))
    with pytest.raises(ConfigError, match=f"{OVERLAP_ENV}='maybe'"):
        serve.main(["--model-path", "m"])


def test_overlap_needs_both_the_testbed_and_the_overlap_variable(monkeypatch):
    monkeypatch.setenv(OVERLAP_ENV, "1")
    monkeypatch.delenv(TESTBED_ENV, raising=False)
    assert not overlap_requested()
    monkeypatch.setenv(TESTBED_ENV, "1")
    assert overlap_requested()


def test_server_environment_puts_shim_first_once_and_is_idempotent():
    pythonpath = os.pathsep.join(["/a", str(SHIM_DIR), "/b"])
    env = server_environment({"PYTHONPATH": pythonpath, "X": "y"})
    assert env["PYTHONPATH"].split(os.pathsep) == [str(SHIM_DIR), "/a", "/b"]
    assert env["SGLANG_USE_CPU_ENGINE"] == "1" and env[TESTBED_ENV] == "1" and env["X"] == "y"
    assert server_environment(env) == env


class _Exec(Exception):
    pass


def test_serve_re_executes_itself_when_the_environment_is_missing(monkeypatch):
    for name in ("PYTHONPATH", "SGLANG_USE_CPU_ENGINE", TESTBED_ENV):
        monkeypatch.delenv(name, raising=False)

    def fake_execve(path, argv, env):
        raise _Exec(path, argv, env)

    monkeypatch.setattr(serve.os, "execve", fake_execve)
    with pytest.raises(_Exec) as exec_call:
        serve._ensure_environment(["--model-path", "m"])
    path, argv, env = exec_call.value.args
    assert path == sys.executable
    assert argv == [sys.executable, "-m", MODULE, "--model-path", "m"]
    assert env == server_environment(os.environ)


@pytest.mark.parametrize("with_shim", [True, False])
def test_stand_in_check_requires_the_shim_first_on_the_path(with_shim):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if with_shim:
        env = server_environment(env)
    check = "from dynspec_testbed.serve import _check_stand_in_shadows_wheel as c; c()"
    proc = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=120)
    assert (proc.returncode == 0) is with_shim, proc.stderr[-2000:]
    if not with_shim:
        assert "not the test-bed stand-in" in proc.stderr


def _flag_values(argv):
    return {argv[i]: argv[i + 1] for i in range(0, len(argv), 2)}


def test_cpu_defaults_fill_in_only_what_the_user_left_open():
    argv = with_cpu_defaults(["--model-path", "m", "--dtype=bfloat16", "--host", "0.0.0.0"])
    assert argv[:4] == ["--model-path", "m", "--dtype=bfloat16", "--host"]
    added = _flag_values(argv[5:])
    assert "--dtype" not in added and "--host" not in added
    assert added["--device"] == "cpu"
    assert added["--attention-backend"] == "intel_amx"
    assert added["--cuda-graph-backend-decode"] == "disabled"
    assert added["--cuda-graph-backend-prefill"] == "disabled"


@pytest.mark.parametrize(
    "user_flag, suppressed",
    [
        ("--disable-cuda-graph", {"--cuda-graph-backend-decode", "--cuda-graph-backend-prefill"}),
        ("--disable-decode-cuda-graph", {"--cuda-graph-backend-decode"}),
        ("--cuda-graph-backend-prefill=full", {"--cuda-graph-backend-prefill"}),
    ],
)
def test_cuda_graph_defaults_yield_to_any_flag_deciding_them(user_flag, suppressed):
    added = _flag_values(with_cpu_defaults([user_flag])[1:])
    both = {"--cuda-graph-backend-decode", "--cuda-graph-backend-prefill"}
    assert both - set(added) == suppressed


def test_torch_gather_spec_extras_gathers_rows_of_every_buffer():
    topk_p = torch.rand(6, 2)
    topk_index = torch.randint(0, 100, (6, 2))
    tokens = torch.arange(6, dtype=torch.int32)
    hidden = torch.randn(6, 3, 4)
    indices = torch.tensor([4, 0, 4], dtype=torch.int32)

    p, i, t, h = gather_spec_extras_torch(indices, topk_p, topk_index, tokens, hidden)

    for got, buf in ((p, topk_p), (i, topk_index), (t, tokens), (h, hidden)):
        assert torch.equal(got, torch.stack([buf[4], buf[0], buf[4]]))
    no_rows = torch.empty(0, dtype=torch.int64)
    empty = gather_spec_extras_torch(no_rows, topk_p, topk_index, tokens, None)
    assert [x.shape[0] for x in empty[:3]] == [0, 0, 0] and empty[3] is None


# SGLang's own argument resolution and plugin loading, in a fresh interpreter with
# the test-bed environment (as a scheduler process would get it). No server starts.
_RESOLVE_PROBE = textwrap.dedent(
    """
    import json, sys
    import torch
    from sglang.srt.arg_groups.speculative_hook import _handle_eagle_family as eager_binding
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import CustomSpecAlgo

    class LazyImportEagle3(CustomSpecAlgo):
        # Imports _handle_eagle_family when called, like a plugin spec class may.
        def is_eagle(self): return True
        def is_eagle3(self): return True
        def handle_server_args(self, server_args):
            from sglang.srt.arg_groups.speculative_hook import _handle_eagle_family
            _handle_eagle_family(server_args)

    class EagerBindingEagle3(LazyImportEagle3):
        # Holds a reference taken before plugins were loaded.
        def handle_server_args(self, server_args):
            eager_binding(server_args)

    for name, cls in (("PROBE_LAZY", LazyImportEagle3), ("PROBE_EAGER", EagerBindingEagle3)):
        register = SpeculativeAlgorithm.register(name, supports_overlap=True, spec_class=cls)
        register(lambda server_args: None)  # worker factory: never called, no server starts

    from sglang.srt.arg_groups.overrides import resolved_view
    from sglang.srt.plugins import load_plugins
    from sglang.srt.runtime_context import override_platform
    from sglang.srt.server_args import prepare_server_args
    from dynspec_testbed.serve import with_cpu_defaults

    load_plugins()
    models = sys.argv[1]
    spec = ["--speculative-draft-model-path", models + "/draft", "--speculative-num-steps", "3",
            "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"]
    cases = {
        "EAGLE3": ["--speculative-algorithm", "EAGLE3", *spec],
        "PROBE_LAZY": ["--speculative-algorithm", "PROBE_LAZY", *spec],
        "PROBE_EAGER": ["--speculative-algorithm", "PROBE_EAGER", *spec],
        "EAGLE3 --disable-overlap-schedule": [
            "--speculative-algorithm", "EAGLE3", *spec, "--disable-overlap-schedule"
        ],
    }
    results = {}
    for label, extra in cases.items():
        args = prepare_server_args(with_cpu_defaults(["--model-path", models + "/target", *extra]))
        with override_platform(has_amx=True):
            args.resolve_once()
        results[label] = resolved_view(args).disable_overlap_schedule

    from sglang.srt.managers import overlap_utils
    rows = overlap_utils.gather_spec_extras(
        torch.tensor([1]), torch.ones(2, 2), torch.ones(2, 2, dtype=torch.long),
        torch.arange(2), None,
    )
    results["gather_rows"] = rows[2].tolist()
    print("PROBE_RESULT " + json.dumps(results))
    """
)


def test_overlap_plugin_keeps_overlap_on_for_eagle_family_and_patches_gather(tiny_models, tmp_path):
    """With SGLANG_DYNSPEC_TESTBED_OVERLAP=1, CPU resolution keeps overlap on for
    EAGLE3 and for plugin spec classes whichever way they reach
    _handle_eagle_family; an explicit --disable-overlap-schedule still wins; and
    overlap_utils' Triton gather is replaced (the Triton kernel cannot run on CPU)."""
    probe = tmp_path / "probe.py"
    probe.write_text(_RESOLVE_PROBE)
    env = server_environment(os.environ)
    env[OVERLAP_ENV] = "1"
    proc = subprocess.run(
        [sys.executable, str(probe), str(tiny_models["target"].parent)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("PROBE_RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(lines[0].removeprefix("PROBE_RESULT "))
    assert results == {
        "EAGLE3": False,
        "PROBE_LAZY": False,
        "PROBE_EAGER": False,
        "EAGLE3 --disable-overlap-schedule": True,
        "gather_rows": [1],
    }, proc.stderr[-3000:]


def test_a_server_whose_port_was_taken_starts_again_on_another(tmp_path, monkeypatch):
    """The port is free when chosen, but another process may bind it first (a full
    run lost 300 s and three tests to that); the server is started again elsewhere."""
    import socket

    from dynspec_testbed import server as server_module

    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))
    blocker.listen()
    taken = blocker.getsockname()[1]
    ports = iter([taken, server_module._free_port()])
    monkeypatch.setattr(server_module, "_free_port", lambda: next(ports))
    monkeypatch.setattr(server_module, "MODULE", "port_taken_server")
    env = {"PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])}
    try:
        with server_module.CpuServer([], log_path=tmp_path / "server.log", env=env, startup_timeout=60) as s:
            assert s.port != taken
            assert s.url.endswith(f":{s.port}") and s.command[-1] == str(s.port)
    finally:
        blocker.close()
