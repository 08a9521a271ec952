"""Shared pytest fixtures, and the CPU set-up that in-process SGLang imports need.

Every test runs in a plain ``python -m pytest``: tests marked ``server`` start real
SGLang servers (about a minute each); deselect them with ``-m "not server"`` for a
quick local run. Nothing is skipped behind the user's back.
"""

import os
import sys
from pathlib import Path

import pytest

from dynspec_testbed import SHIM_DIR

# SGLang's CUDA-only kernel wheel cannot load here: the test bed's pure-PyTorch
# stand-in must shadow it, and SGLang must pick its CPU platform, before any test
# module imports sglang in this process.
os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
if str(SHIM_DIR) not in sys.path:
    sys.path.insert(0, str(SHIM_DIR))

# Reuse one model build across sessions: SGLANG_DYNSPEC_TEST_MODELS=/some/dir.
MODELS_DIR_ENV = "SGLANG_DYNSPEC_TEST_MODELS"


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """The CPU test bed's tiny models (``target``, ``draft``, ``target-agree``,
    ``draft-agree``), built once per session (about 10 s)."""
    from dynspec_testbed.models import build_models

    root = os.environ.get(MODELS_DIR_ENV) or tmp_path_factory.mktemp("testbed-models")
    return build_models(root)


@pytest.fixture(scope="session")
def reference_servers(tiny_models, tmp_path_factory):
    """Non-speculative servers shared by the session's end-to-end tests, one per target
    (``dynspec_testbed.server.ReferenceServers``); stopped when the session ends."""
    from dynspec_testbed.server import ReferenceServers

    servers = ReferenceServers(tiny_models, tmp_path_factory.mktemp("reference-servers"))
    yield servers
    servers.close()
