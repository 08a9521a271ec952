"""The serving distribution carries the plugin and nothing of the test bed.

Builds the wheel and the sdist of ``sglang-dynspec`` from this checkout (offline,
``--no-isolation``: the build backend of the current environment), installs the
wheel without dependencies into a fresh virtual environment, and checks there what
every SGLang process of a user would see: one ``sglang.srt.plugins`` entry point,
no stand-in ``sgl_kernel``, no test-bed package. Also checks the archives' file lists,
the test bed's own distribution metadata, where each distribution's configuration
lives, and that the supported SGLang range is the one of ``refusals``.
"""

from __future__ import annotations

import configparser
import json
import re
import shutil
import subprocess
import sys
import tarfile
import venv
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

import sglang_dynspec
from sglang_dynspec.refusals import SUPPORTED_SGLANG

ROOT = Path(__file__).resolve().parents[1]
TESTBED = ROOT / "testbed"
PLUGIN_ENTRY_POINT = ("eagle3_dynamic", "sglang_dynspec.plugin:register")
TESTBED_MARKERS = ("_shim", "sgl_kernel", "testbed")

PROBE = """
import importlib.metadata, importlib.util, json
import sglang_dynspec
print(json.dumps({
    "entry_points": sorted(
        (e.name, e.value) for e in importlib.metadata.entry_points(group="sglang.srt.plugins")
    ),
    "sgl_kernel": importlib.util.find_spec("sgl_kernel") is not None,
    "dynspec_testbed": importlib.util.find_spec("dynspec_testbed") is not None,
    "version": sglang_dynspec.__version__,
    "location": sglang_dynspec.__file__,
}))
"""


COPY_IGNORE = shutil.ignore_patterns(
    ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", ".hypothesis"
)


def _build(source: Path, out: Path) -> tuple[Path, Path]:
    """Build from a copy of ``source`` (the build writes ``*.egg-info`` next to the
    sources, which must not land in this checkout, where it would shadow the
    installed metadata)."""
    tree = out / "src"
    shutil.copytree(source, tree, ignore=COPY_IGNORE)
    subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(tree)],
        check=True,
        capture_output=True,
        text=True,
    )
    (wheel,) = out.glob("*.whl")
    (sdist,) = out.glob("*.tar.gz")
    return wheel, sdist


@pytest.fixture(scope="module")
def main_dist(tmp_path_factory) -> tuple[Path, Path]:
    return _build(ROOT, tmp_path_factory.mktemp("dist"))


def _wheel_entry_points(wheel: Path) -> str:
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/entry_points.txt")]
        return archive.read(name).decode()


def test_wheel_has_the_plugin_and_no_test_bed(main_dist):
    wheel, _ = main_dist
    assert wheel.name == f"sglang_dynspec-{sglang_dynspec.__version__}-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    assert "sglang_dynspec/plugin.py" in names and "sglang_dynspec/metric_names.py" in names
    leaked = [n for n in names if any(marker in n for marker in TESTBED_MARKERS)]
    assert leaked == []
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    entry_points = _wheel_entry_points(wheel)
    assert "dynspec_testbed" not in entry_points
    assert "eagle3_dynamic = sglang_dynspec.plugin:register" in entry_points


def test_sdist_has_license_and_readme_and_no_test_bed(main_dist):
    _, sdist = main_dist
    prefix = f"sglang_dynspec-{sglang_dynspec.__version__}/"
    with tarfile.open(sdist) as archive:
        names = archive.getnames()
    assert {prefix + "LICENSE", prefix + "README.md", prefix + "pyproject.toml"} <= set(names)
    in_package = [n for n in names if n.startswith(prefix + "sglang_dynspec/")]
    assert in_package and not [n for n in in_package if any(m in n for m in TESTBED_MARKERS)]
    assert not [n for n in names if n.startswith(prefix + "testbed/")]


def test_fresh_venv_sees_only_the_plugins_entry_point(main_dist, tmp_path):
    wheel, _ = main_dist
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", str(wheel)],
        check=True,
        capture_output=True,
        text=True,
    )
    # -I: no PYTHONPATH, no user site, no current directory (this checkout) on sys.path.
    probe = subprocess.run(
        [str(python), "-I", "-c", PROBE], check=True, capture_output=True, text=True, cwd=tmp_path
    )
    seen = json.loads(probe.stdout)
    assert seen["location"].startswith(str(env_dir)), seen["location"]
    assert seen["entry_points"] == [list(PLUGIN_ENTRY_POINT)]
    assert seen["sgl_kernel"] is False
    assert seen["dynspec_testbed"] is False
    assert seen["version"] == sglang_dynspec.__version__


def test_test_bed_wheel_has_its_entry_point_and_the_shim(tmp_path):
    wheel, sdist = _build(TESTBED, tmp_path)
    assert wheel.name.startswith("sglang_dynspec_testbed-") and sdist.name.startswith(
        "sglang_dynspec_testbed-"
    )
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        requires = [
            line for line in archive.read(metadata).decode().splitlines() if line.startswith("Requires-Dist:")
        ]
    assert "dynspec_testbed/_shim/sgl_kernel/__init__.py" in names
    assert "dynspec_testbed/fake_server.py" in names and "dynspec_testbed/demo.py" in names
    assert not [n for n in names if n.startswith("sglang_dynspec/")]
    assert "Requires-Dist: sglang-dynspec" in requires
    entry_points = _wheel_entry_points(wheel)
    assert "dynspec_testbed = dynspec_testbed.plugin:register" in entry_points
    assert "eagle3_dynamic" not in entry_points
    # setuptools refuses license files outside the project directory, so testbed/ has a copy.
    assert (TESTBED / "LICENSE").read_text() == (ROOT / "LICENSE").read_text()


@pytest.mark.parametrize("root", [ROOT, TESTBED], ids=["serving", "testbed"])
def test_pyproject_builds_and_setup_cfg_describes(root):
    """pyproject.toml holds the build system and the tools' settings, setup.cfg
    setuptools' declarative metadata, options, extras and entry points: no field is
    in both."""
    tables = re.findall(r"^\[([^\]]+)\]", (root / "pyproject.toml").read_text(), re.MULTILINE)
    assert [t for t in tables if t != "build-system" and not t.startswith("tool.")] == []
    assert [t for t in tables if t.startswith("tool.setuptools")] == []
    cfg = configparser.ConfigParser()
    cfg.read(root / "setup.cfg")
    assert {"metadata", "options", "options.entry_points"} <= set(cfg.sections())


def test_the_supported_sglang_range_is_the_one_of_refusals():
    """``refusals.SUPPORTED_SGLANG`` (the start-up messages) is the dependency the
    distribution declares, and the range the README and compat's docstring state."""
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    requires = [Requirement(line) for line in cfg["options"]["install_requires"].split("\n") if line]
    assert [r for r in requires if r.name == "sglang"] == [Requirement(SUPPORTED_SGLANG)]
    for doc in (ROOT / "README.md", ROOT / "sglang_dynspec" / "compat.py"):
        stated = set(re.findall(r"sglang\s*>=\s*[\d.]+\s*,\s*<\s*[\d.]+", doc.read_text()))
        assert stated == {SUPPORTED_SGLANG}, doc.name
