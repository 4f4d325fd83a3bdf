"""Counts in messages people read: `1 lane`, `4 lanes`, never `1 lanes`."""

from __future__ import annotations


def counted(count: int, noun: str, plural: str | None = None) -> str:
    """`count` with thousands separators and `noun`, plural (`plural`, else noun + "s") unless
    it is 1."""
    return f"{count:,} {noun if count == 1 else plural or noun + 's'}"
