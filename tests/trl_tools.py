"""Tools written as TRL's and transformers' documentation write them, unchanged (module-level: the tool workers
import them by name). They return numbers, dicts and content blocks, raise, and await: TRL sends ``str(value)``
back (a list of content blocks as it is) and turns an exception into ``{"error": str(e)}``."""

from __future__ import annotations

import asyncio


def add(a: int, b: int) -> int:
    """
    Adds two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The sum of the two integers.
    """
    return a + b


def multiply(a: float, b: float) -> float:
    """
    A function that multiplies two numbers

    Args:
        a: The first number to multiply
        b: The second number to multiply
    """
    return a * b


def get_current_temperature(location: str, unit: str) -> float:
    """
    Get the current temperature at a location.

    Args:
        location: The location to get the temperature for, in the format "City, Country"
        unit: The unit to return the temperature in. (choices: ["celsius", "fahrenheit"])
    Returns:
        The current temperature at the specified location in the specified units, as a float.
    """
    return 22.0


def get_weather(city: str) -> dict:
    """
    Get the weather in a city.

    Args:
        city: The city name.
    """
    return {"city": city, "sky": "clear", "temperature": 21}


def divide(a: int, b: int) -> float:
    """
    Divides a by b.

    Args:
        a: The dividend.
        b: The divisor.
    """
    return a / b


def describe(topic: str) -> list:
    """
    Describe a topic as content blocks.

    Args:
        topic: What to describe.
    """
    return [{"type": "text", "text": f"about {topic}"}]


async def async_add(a: int, b: int) -> int:
    """
    Adds two integers, asynchronously.

    Args:
        a: The first integer.
        b: The second integer.
    """
    await asyncio.sleep(0)
    return a + b


class AdderEnv:
    """An environment as TRL 1.18's environment_factory makes them: reset() with the row, a tool method returning an
    int, and an async get_reward() read when the rollout ends (1 when the model called add(2, 3) once)."""

    def __init__(self, start: int = 0):
        self.start = start

    def reset(self, **row) -> str | None:
        self.calls = []
        return None

    def add(self, a: int, b: int) -> int:
        """
        Adds two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        self.calls.append((a, b))
        return self.start + a + b

    async def get_reward(self) -> float:
        await asyncio.sleep(0)
        return float(self.calls == [(2, 3)])


def make_adder_env() -> AdderEnv:
    """A factory function (TRL's environment_factory is any callable returning an environment)."""
    return AdderEnv(start=0)


class SlowEnv:
    """An environment whose tool can hang: its calls are timed and isolated like any tool's."""

    def reset(self, **row) -> None:
        self.waited = 0.0

    def wait(self, seconds: float) -> str:
        """
        Wait.

        Args:
            seconds: How long to wait.
        """
        import time
        time.sleep(seconds)
        self.waited += seconds
        return f"waited {self.waited:g}"


def make_slow_env() -> SlowEnv:
    return SlowEnv()
