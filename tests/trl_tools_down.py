"""A TRL tool named ``add`` that raises (the taught model calls ``add``): its turn is TRL's ``{'error': ...}``."""

from __future__ import annotations


def add(a: int, b: int) -> int:
    """
    Adds two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    raise ConnectionError("the adder service is down")
