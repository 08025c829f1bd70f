"""Byte units shared by the progress log and the reports."""

from __future__ import annotations

MiB = 2 ** 20


def fmt_mib(value: float) -> str:
    return f"{value / MiB:.1f}"
