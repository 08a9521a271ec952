"""Shared pytest fixtures and options."""

import os
from pathlib import Path
from typing import Dict

import pytest

# Reuse one model build across sessions: SGLANG_DYNSPEC_TEST_MODELS=/some/dir.
MODELS_DIR_ENV = "SGLANG_DYNSPEC_TEST_MODELS"


def pytest_collection_modifyitems(config, items):
    """Skip tests marked ``server`` unless the run selects them with ``-m``.

    Each starts real SGLang servers (about a minute apiece, a busy core while
    idle), so a plain ``pytest`` stays fast and never starts one by accident.
    """
    if "server" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="starts SGLang servers; select with -m server")
    for item in items:
        if "server" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> Dict[str, Path]:
    """The CPU test bed's tiny models (``target``, ``draft``, ``target-agree``,
    ``draft-agree``), built once per session (about 10 s)."""
    from sglang_dynspec.testbed.models import build_models

    root = os.environ.get(MODELS_DIR_ENV) or tmp_path_factory.mktemp("testbed-models")
    return build_models(root)
