"""Start a real SGLang HTTP server on a CPU (no GPU, no AMX needed).

    python -m dynspec_testbed.serve --model-path DIR/target [SGLang server args]

Works without speculation, with ``--speculative-algorithm EAGLE3`` and with
``--speculative-algorithm EAGLE3_DYNAMIC`` (this project's plugin, loaded from
its ``sglang.srt.plugins`` entry point). What it sets up, and why:

* ``PYTHONPATH`` starts with the test bed's ``_shim`` directory, so ``import
  sgl_kernel`` finds the pure-PyTorch stand-in instead of the CUDA-only wheel;
  ``SGLANG_USE_CPU_ENGINE=1`` selects SGLang's CPU platform; and
  ``SGLANG_DYNSPEC_TESTBED=1`` arms the test-bed plugin. These must be in place
  before ``sglang`` is imported and are inherited by the scheduler processes
  SGLang spawns, so the process re-executes itself when they are missing.
* CPU defaults are added unless the command line already decides them:
  ``--device cpu --attention-backend intel_amx --dtype float32
  --mem-fraction-static 0.05 --max-total-tokens 4096 --context-length 2048
  --host 127.0.0.1`` and CUDA graphs disabled (``--cuda-graph-backend-decode
  disabled --cuda-graph-backend-prefill disabled``; ``--disable-cuda-graph`` is
  deprecated in SGLang 0.5.23).
* Server arguments are resolved inside ``override_platform(has_amx=True)``.
  SGLang rewrites ``intel_amx`` to ``torch_native`` on CPUs without AMX, and
  EAGLE's draft backend factory has no ``torch_native`` entry. The override only
  covers argument resolution in this process; model layers in the schedulers
  still see no AMX and use their native-torch paths. ``intel_amx`` attention
  then runs the stand-in's ``decode_attention_cpu`` / ``extend_attention_cpu``.

Environment variables
    ``SGLANG_DYNSPEC_TESTBED_OVERLAP=1``
        Run speculative decoding with the spec-v2 overlap scheduler (SGLang turns
        it off on CPU). See ``dynspec_testbed.plugin``.
    ``SGLANG_USE_CPU_ENGINE``, ``SGLANG_DYNSPEC_TESTBED``, ``PYTHONPATH``
        Set by this module, as described above.
    ``SGLANG_PYSPY_DUMP_BEFORE_CRASH``, ``SGLANG_CUDA_COREDUMP_BEFORE_CRASH``
        ``0`` unless set: SGLang's crash diagnostics sleep 5 s on every SIGTERM.
"""

import os
import sys
from collections.abc import Mapping, Sequence

from dynspec_testbed import SHIM_DIR
from dynspec_testbed.plugin import OVERLAP_ENV, TESTBED_ENV
from sglang_dynspec.config import env_bool

MODULE = "dynspec_testbed.serve"
# SGLang's switches for py-spy and CUDA core dumps before a crash (srt/environ.py).
CRASH_DIAGNOSTICS_ENV = ("SGLANG_PYSPY_DUMP_BEFORE_CRASH", "SGLANG_CUDA_COREDUMP_BEFORE_CRASH")

# (flag, value, flags that already decide it). A default is added only when none
# of its deciding flags is on the command line.
_CUDA_GRAPH_OFF = ("--disable-cuda-graph", "--cuda-graph-config")
CPU_DEFAULTS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("--device", "cpu", ()),
    ("--attention-backend", "intel_amx", ()),
    ("--dtype", "float32", ()),
    ("--mem-fraction-static", "0.05", ()),
    ("--max-total-tokens", "4096", ()),
    ("--context-length", "2048", ()),
    ("--host", "127.0.0.1", ()),
    (
        "--cuda-graph-backend-decode",
        "disabled",
        ("--disable-decode-cuda-graph", *_CUDA_GRAPH_OFF),
    ),
    (
        "--cuda-graph-backend-prefill",
        "disabled",
        ("--disable-prefill-cuda-graph", *_CUDA_GRAPH_OFF),
    ),
)


def server_environment(base: Mapping[str, str]) -> dict[str, str]:
    """``base`` plus what a test-bed SGLang process needs (idempotent)."""
    env = dict(base)
    shim = str(SHIM_DIR)
    entries = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != shim]
    env["PYTHONPATH"] = os.pathsep.join([shim, *entries])
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    env[TESTBED_ENV] = "1"
    # SGLang answers SIGTERM (a server stopped by its process group: the scheduler
    # exits first) with crash diagnostics that begin with a 5 s sleep "to let GPU
    # activity settle", then py-spy and a CUDA core dump of schedulers that are gone
    # by then. On the CPU there is neither GPU activity nor a core dump to take, and
    # the sleep was 5 s of every one of the test suite's server stops.
    for diagnostics in CRASH_DIAGNOSTICS_ENV:
        env.setdefault(diagnostics, "0")
    return env


def with_cpu_defaults(argv: Sequence[str]) -> list[str]:
    """``argv`` followed by every CPU default it does not already decide."""
    given = {arg.split("=", 1)[0] for arg in argv if arg.startswith("--")}
    extra: list[str] = []
    for flag, value, deciders in CPU_DEFAULTS:
        if flag not in given and given.isdisjoint(deciders):
            extra += [flag, value]
    return [*argv, *extra]


def _ensure_environment(argv: Sequence[str]) -> None:
    """Re-exec this module with the test-bed environment unless it is in place."""
    env = server_environment(os.environ)
    if env != dict(os.environ):
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, "-m", MODULE, *argv], env)
    _check_stand_in_shadows_wheel()


def _check_stand_in_shadows_wheel() -> None:
    import importlib.util

    spec = importlib.util.find_spec("sgl_kernel")
    origin = spec.origin if spec is not None else None
    if origin is None or not origin.startswith(str(SHIM_DIR)):
        raise RuntimeError(
            f"'import sgl_kernel' resolves to {origin}, not the test-bed stand-in under "
            f"{SHIM_DIR}. Is Python running with -E/-I, or is sgl_kernel already on "
            "sys.path ahead of PYTHONPATH?"
        )


def main(argv: Sequence[str] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    env_bool(OVERLAP_ENV, False)  # a malformed value fails here, not inside a scheduler
    _ensure_environment(argv)

    from sglang.launch_server import run_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.runtime_context import override_platform
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    from dynspec_testbed.plugin import assert_overlap_kept

    load_plugins()
    server_args = prepare_server_args(with_cpu_defaults(argv))
    with override_platform(has_amx=True):
        server_args.resolve_once()
    assert_overlap_kept(server_args)
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


if __name__ == "__main__":
    main()
