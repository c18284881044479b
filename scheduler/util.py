"""Arithmetic shared by the scheduler modules."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling of ``a / b`` for ``a >= 0, b > 0``; also elementwise on int numpy arrays."""
    return -(-a // b)
