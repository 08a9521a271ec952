"""Unit conversion and number formatting shared by the bench modules."""

from __future__ import annotations


def ms(seconds: float | None) -> float | None:
    """Seconds to milliseconds; ``None`` stays ``None``."""
    return None if seconds is None else seconds * 1000.0


def fmt(value: float | None, spec: str = ".2f") -> str:
    """``value`` formatted with ``spec``, or ``n/a`` for ``None``."""
    return "n/a" if value is None else format(value, spec)
