"""A tool that prints and returns far too much (tests/test_security.py; module-level: tool workers import it)."""

from __future__ import annotations

import os


def loud(mb: int) -> str:
    """Print mb MB, write a line to fd 1 as C code would, and return 10 x mb MB.

    Args:
        mb: megabytes to print
    """
    print("PRINTED " + "p" * (mb << 20))
    os.write(1, b"FD-LEVEL WRITE\n")
    return "RETURNED " + "r" * (10 * mb << 20)


def ray_token() -> str:
    """The Ray session token this tool's process can see ("none" when it has none)."""
    return os.environ.get("RAY_AUTH_TOKEN", "none")
