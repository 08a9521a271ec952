"""Tensor reads to the host by the plugin's own step code (test bed only).

On a GPU, ``t.item()``, ``t.tolist()``, ``t.cpu()``, ``int(t)``, ``bool(t)`` ... of a
device tensor make the host wait for everything queued on the stream; one such read
in a decode step drains the overlap scheduler's pipeline at every step. On the CPU
test bed every tensor is a host tensor, so nothing stalls and nothing shows. This
guard makes such reads visible: with ``SGLANG_DYNSPEC_TESTBED_HOST_READS=<file>``
(and the test bed armed), every scheduler process counts each host read of a tensor
made *directly by a frame of the ``sglang_dynspec`` package* while the EAGLE3_DYNAMIC
worker runs a step (``DynamicEagleWorker.forward_batch_generation``), by site
(file, function, method), and writes the counts to ``<file>.<pid>.json`` every 16
steps and at each new site. SGLang's own reads are not counted: only the plugin's
code is under test.

The few sites that read host values on purpose are listed in ``ALLOWED`` with the
reason each is not a device sync on the GPU; a read anywhere else is a violation
(``tests/test_catch_up_e2e.py`` runs a switching workload under the guard and
requires none).
"""

from __future__ import annotations

import functools
import json
import os
import sys
from collections import Counter
from pathlib import Path

import torch

HOST_READS_ENV = "SGLANG_DYNSPEC_TESTBED_HOST_READS"
SYNC_WATCH_ENV = "SGLANG_DYNSPEC_TESTBED_SYNC_WATCH"  # 1: also count CUDA syncs (SyncWatch)
READ_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")
WORKER_STEP = "sglang_dynspec.worker.DynamicEagleWorker.forward_batch_generation"

# (file, function, method) -> why it is not a device sync on the GPU.
ALLOWED = {
    ("fresh_batch.py", "build_plain_decode_batch", "__int__"): "sums seq_lens_cpu, the host mirror",
    (
        "device_timer.py",
        "read",
        "tolist",
    ): "HostCopy's pinned copy once its event has completed, or the CPU branch",
    ("device_timer.py", "read_later", "tolist"): "the CPU branch; CUDA tensors go through pinned memory",
}


def site_name(site: tuple[str, str, str]) -> str:
    return "{}:{}:{}".format(*site)


class HostReadGuard:
    """Counts host reads of tensors by frames under ``package_dir`` while ``active``."""

    def __init__(self, package_dir: str | os.PathLike, report_path: str | os.PathLike | None = None):
        self.package_dir = str(Path(package_dir).resolve())
        self.report_path = Path(report_path) if report_path is not None else None
        self.reads: Counter[tuple[str, str, str]] = Counter()
        self.steps = 0
        self.active = 0  # depth of guarded calls in progress
        self.sync_watch: SyncWatch | None = None
        self._originals: dict[str, object] = {}

    def install(self) -> None:
        """Wrap ``torch.Tensor``'s host-read methods (once)."""
        for name in READ_METHODS:
            if name not in self._originals:
                original = getattr(torch.Tensor, name)
                self._originals[name] = original
                setattr(torch.Tensor, name, self._wrap(name, original))

    def uninstall(self) -> None:
        for name, original in self._originals.items():
            setattr(torch.Tensor, name, original)
        self._originals.clear()

    def _wrap(self, name: str, original):
        guard = self

        @functools.wraps(original)
        def read(tensor, *args, **kwargs):
            if guard.active:
                guard._note(name, sys._getframe(1))
            return original(tensor, *args, **kwargs)

        return read

    def _note(self, method: str, frame) -> None:
        path = frame.f_code.co_filename
        if not path.startswith(self.package_dir):
            return
        site = (os.path.basename(path), frame.f_code.co_name, method)
        new = site not in self.reads
        self.reads[site] += 1
        if new:
            self.write()

    def guarded(self, step):
        """``step`` wrapped: reads made while it runs are counted."""
        guard = self

        @functools.wraps(step)
        def run(*args, **kwargs):
            guard.active += 1
            try:
                return step(*args, **kwargs)
            finally:
                guard.active -= 1
                guard.steps += 1
                if guard.steps % 16 == 0:
                    guard.write()

        return run

    def violations(self) -> dict[str, int]:
        return {site_name(s): n for s, n in self.reads.items() if s not in ALLOWED}

    def report(self) -> dict:
        return {
            "steps": self.steps,
            "reads": {site_name(s): n for s, n in self.reads.items()},
            "violations": self.violations(),
            "cuda_syncs": dict(self.sync_watch.syncs) if self.sync_watch is not None else None,
        }

    def write(self) -> None:
        if self.report_path is None:
            return
        target = self.report_path.with_name(f"{self.report_path.name}.{os.getpid()}.json")
        tmp = target.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.report()))
        tmp.replace(target)


class SyncWatch:
    """On CUDA: the device syncs during guarded steps, by the Python line that made them.

    ``torch.cuda.set_sync_debug_mode("warn")`` makes PyTorch warn at every
    synchronizing CUDA call; while a step runs, each such warning is counted under the
    innermost Python line executing (a line of the plugin, or of SGLang: its own
    speculative step runs inside the worker's step too). CUDA only; reported beside
    the host reads.
    """

    def __init__(self):
        self.syncs: Counter[str] = Counter()

    def around(self, step):
        watch = self

        @functools.wraps(step)
        def run(*args, **kwargs):
            import warnings

            previous = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("warn")
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    out = step(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode(previous)
            for w in caught:
                if "synchroniz" in str(w.message):
                    watch.syncs[f"{w.filename}:{w.lineno}"] += 1
            return out

        return run


def install_from_environ() -> HostReadGuard | None:
    """In a server process: guard the worker's step if ``HOST_READS_ENV`` names a file."""
    path = os.environ.get(HOST_READS_ENV)
    if not path:
        return None
    import sglang_dynspec
    from sglang_dynspec.worker import DynamicEagleWorker

    guard = HostReadGuard(Path(sglang_dynspec.__file__).parent, path)
    guard.install()
    step = DynamicEagleWorker.forward_batch_generation
    if os.environ.get(SYNC_WATCH_ENV) == "1" and torch.cuda.is_available():
        guard.sync_watch = SyncWatch()
        step = guard.sync_watch.around(step)
    DynamicEagleWorker.forward_batch_generation = guard.guarded(step)
    return guard


def load_reports(path: str | os.PathLike) -> list[dict]:
    """The reports every process wrote for ``path``."""
    path = Path(path)
    return [json.loads(p.read_text()) for p in sorted(path.parent.glob(f"{path.name}.*.json"))]
