"""Drive a ``ModeController`` through decode steps as the worker does: ``before_decode``
for the step's mode, then ``after_decode`` to account for it (the policy and telemetry
tests). Pure Python."""

from __future__ import annotations

from collections.abc import Iterable

from sglang_dynspec.controller import ModeController
from sglang_dynspec.policy import Mode


def drive(
    controller: ModeController, sizes: Iterable[int], accept_lens=None, plain_graph: bool = False
) -> list[Mode]:
    """One decode step per batch size in ``sizes``; the mode of each. ``accept_lens``:
    what each step reports as its accept lengths; ``plain_graph``: plain steps replayed
    the plain decode graph."""
    modes = []
    for batch_size in sizes:
        mode = controller.before_decode(batch_size)
        controller.after_decode(
            mode, accept_lens=accept_lens, replayed_graph=plain_graph and mode is Mode.PLAIN
        )
        modes.append(mode)
    return modes
