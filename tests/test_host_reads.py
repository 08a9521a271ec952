"""The test bed's host-read guard (``dynspec_testbed.host_reads``) sees what it must.

The end-to-end use is in ``test_catch_up_e2e.py``; here the guard watches this test
module as if it were the plugin, so each claim can be checked directly.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dynspec_testbed.host_reads import ALLOWED, HostReadGuard, load_reports, site_name

HERE = Path(__file__).parent


@pytest.fixture
def guard(tmp_path):
    g = HostReadGuard(HERE, tmp_path / "reads")
    g.install()
    yield g
    g.uninstall()


def reads_everything(t: torch.Tensor) -> None:
    t.item()
    t.tolist()
    t.cpu()
    int(t)
    bool(t)
    float(t)
    [0, 1][t]  # __index__


def test_counts_reads_by_watched_frames_only_while_a_step_runs(guard, tmp_path):
    t = torch.tensor(1)
    reads_everything(t)  # no step running: not counted
    assert guard.reads == {}

    guard.guarded(reads_everything)(t)
    methods = {method for (_file, func, method) in guard.reads if func == "reads_everything"}
    assert methods == {"item", "tolist", "cpu", "__int__", "__bool__", "__float__", "__index__"}
    assert all(s[0] == "test_host_reads.py" for s in guard.reads)
    assert site_name(("test_host_reads.py", "reads_everything", "item")) in guard.violations()
    # torch's own frames (e.g. inside torch.nn.functional) are not the watched package.
    guard.reads.clear()
    guard.guarded(lambda: torch.nn.functional.softmax(torch.ones(3), dim=0))()
    assert guard.reads == {}

    [report] = load_reports(tmp_path / "reads")  # written at the first new site
    assert "test_host_reads.py:reads_everything:item" in report["violations"]


def test_uninstall_restores_torch(guard):
    guard.uninstall()
    assert torch.Tensor.item is torch._C.TensorBase.item
    guard.guarded(lambda: torch.tensor(2).item())()
    assert guard.reads == {}


def test_allowed_sites_exist_in_the_plugin():
    """Every allowed site names a function of the plugin's source (a renamed function
    must not leave a stale exemption behind)."""
    import sglang_dynspec

    root = Path(sglang_dynspec.__file__).parent
    for file, function, _method in ALLOWED:
        source = (root / file).read_text()
        assert (f"def {function}(" in source) if function != "<lambda>" else ("lambda" in source), (
            file,
            function,
        )
