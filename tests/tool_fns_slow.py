"""A slow tool named like tool_fns.add (the taught model calls ``add``), for tests/test_tools.py."""

from __future__ import annotations

import time


def add(a: int, b: int) -> str:
    """Add two integers, slowly.

    Args:
        a: the first addend
        b: the second addend
    """
    time.sleep(1.5)
    return str(a + b)
