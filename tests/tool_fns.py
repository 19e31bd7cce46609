"""Tools and environments for tests/test_tools.py (module-level: the tool workers import them by name)."""

from __future__ import annotations

import os
import time


def add(a: int, b: int) -> str:
    """Add two integers.

    Args:
        a: the first addend
        b: the second addend
    """
    return str(a + b)


def divide(a: int, b: int) -> str:
    """Divide a by b.

    Args:
        a: the dividend
        b: the divisor
    """
    return str(a // b)


def nap(seconds: float) -> str:
    """Sleep, then say so.

    Args:
        seconds: how long to sleep
    """
    time.sleep(seconds)
    return "awake"


def die() -> str:
    """End the worker process abruptly."""
    os._exit(3)


def number() -> str:
    """Claim a string, return an int."""
    return 7  # type: ignore[return-value]


def no_hints(a):
    """Missing hints.

    Args:
        a: something
    """
    return str(a)


def no_docstring(a: int) -> str:
    return str(a)


def returns_int(a: int) -> int:
    """Declares a non-string output.

    Args:
        a: something
    """
    return a


class Counter:
    """An environment: a counter the model moves toward a target."""

    def reset(self, target: int = 3, **kwargs) -> str:
        self.value, self.target = 0, int(target)
        return f"reach {self.target}"

    def increment(self, by: int) -> str:
        """Increase the counter.

        Args:
            by: how much to add
        """
        self.value += by
        return str(self.value)

    def get_reward(self) -> float:
        return float(self.value == self.target)


class NoReset:
    def poke(self, x: int) -> str:
        """Poke.

        Args:
            x: how hard
        """
        return "ok"


class Adder:
    """An environment whose tool is add(); its reward says whether the model called it with 2 and 3."""

    def reset(self, **row) -> None:
        self.calls = []

    def add(self, a: int, b: int) -> str:
        """Add two integers.

        Args:
            a: the first addend
            b: the second addend
        """
        self.calls.append((a, b))
        return str(a + b)

    def get_reward(self) -> float:
        return float(self.calls == [(2, 3)])


def says_answer(prompts, completions, answer, **kwargs):
    """A TRL reward function: 1 when the last assistant turn states the answer."""
    return [float(f"answer is {a}." in c[0]["content"]) for c, a in zip(completions, answer)]


def hog(mb: int) -> str:
    """Allocate memory.

    Args:
        mb: megabytes to allocate
    """
    block = bytearray(mb << 20)
    return str(len(block))


def spin(seconds: float) -> str:
    """Burn CPU.

    Args:
        seconds: how long to spin
    """
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass
    return "done"


def where() -> str:
    """The working directory of the call."""
    return os.getcwd()
