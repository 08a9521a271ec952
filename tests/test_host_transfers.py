"""No host-to-device copy in the plugin's step code waits for the device.

``tensor.to(cuda_device)`` from pageable host memory (and ``torch.tensor(values,
device=cuda_device)``, ``.cuda()``) makes PyTorch synchronize the stream after the copy,
which drains the overlap scheduler's pipeline each time it runs. The plugin's step
code puts host values on the device through ``device_timer.to_device`` (a pinned,
asynchronous copy) instead. The CPU test bed cannot see such a sync (its device is the
host), and the host-read guard watches reads, not writes; so this test reads the
source: every call that names a device as a copy's destination is inside ``to_device``
or in code that runs once at start-up. On the GPU, ``benchmarks/h200/sync_check.sh``
checks the running server as a whole.

Found this way: ``compat.extend_last_rows`` (601797f) copied each prefill's last-token
rows with a plain ``.to(device)``, a stream sync at every prefill and mixed step.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "sglang_dynspec"

# (module, function): where a synchronous copy to the device is allowed, and why.
ALLOWED = {
    ("device_timer.py", "to_device"): "the helper itself (its CPU branch)",
    ("compat.py", "synthetic_decode_batch"): "start-up: the step-cost timing's synthetic batches",
    # step_timing.py: start-up only (it times steps before the first request).
}
START_UP_MODULES = {"step_timing.py"}


def _names_a_device(node: ast.AST) -> bool:
    """True if the expression mentions a device (``device``, ``x.device``, ``"cuda"``)."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name) and "device" in sub.id:
            return True
        if isinstance(sub, ast.Attribute) and "device" in sub.attr:
            return True
        if isinstance(sub, ast.Constant) and isinstance(sub.value, str) and sub.value.startswith("cuda"):
            return True
    return False


def _is_host_to_device_copy(call: ast.Call) -> bool:
    func = call.func
    if not isinstance(func, ast.Attribute):
        return False
    if func.attr == "cuda":
        return True
    if func.attr == "to":
        return any(_names_a_device(a) for a in call.args) or any(
            k.arg == "device" or (k.arg is None and _names_a_device(k.value)) for k in call.keywords
        )
    if func.attr in ("tensor", "as_tensor"):
        return any(k.arg == "device" for k in call.keywords)
    return False


def copies_to_device(source: str) -> list[tuple[str, int, str]]:
    """``(innermost function, line, call)`` of every host-to-device copy in ``source``."""
    found = []

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            if isinstance(child, ast.Call) and _is_host_to_device_copy(child):
                found.append((function, child.lineno, ast.unparse(child)))
            visit(child, inner)

    visit(ast.parse(source), "<module>")
    return found


def test_step_code_copies_host_values_to_the_device_only_through_to_device():
    offenders = []
    for path in sorted(PACKAGE.glob("*.py")):
        if path.name in START_UP_MODULES:
            continue
        for function, line, call in copies_to_device(path.read_text()):
            if (path.name, function) not in ALLOWED:
                offenders.append(f"{path.name}:{line} in {function}: {call}")
    assert not offenders, "synchronous host-to-device copies (use device_timer.to_device):\n" + "\n".join(
        offenders
    )


def test_the_allowed_sites_still_exist():
    # An entry that no longer matches anything would allow a future copy by accident.
    for module, function in ALLOWED:
        sites = [f for f, _, _ in copies_to_device((PACKAGE / module).read_text())]
        assert function in sites, (module, function)


@pytest.mark.parametrize(
    ("source", "caught"),
    [
        # The copy that 601797f shipped, and its forms.
        ("def f(b):\n    return torch.tensor(x).sub_(1).to(b.input_ids.device)\n", True),
        ("def f(device):\n    return t.to(device, non_blocking=True)\n", True),
        ("def f():\n    return torch.tensor([1], device=dev)\n", True),
        ("def f():\n    return t.cuda()\n", True),
        ("def f():\n    return t.to('cuda:0')\n", True),
        ("def f(**kw):\n    return t.to(**device_kwargs)\n", True),
        # Not copies to a device: dtype conversions on the device.
        ("def f():\n    return t.to(torch.int64)\n", False),
        ("def f():\n    return t.to(x.dtype, copy=True)\n", False),
    ],
)
def test_the_check_catches_each_form(source, caught):
    assert bool(copies_to_device(source)) is caught
