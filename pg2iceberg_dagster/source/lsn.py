"""PostgreSQL LSNs as integers, and back to the ``X/Y`` text form."""

from __future__ import annotations


def parse_lsn(text: str) -> int:
    """``'0/1D43AD0'`` -> integer."""
    high, low = text.split("/")
    return (int(high, 16) << 32) | int(low, 16)


def format_lsn(value: int) -> str:
    """integer -> ``'0/1D43AD0'``."""
    return f"{value >> 32:X}/{value & 0xFFFFFFFF:X}"
