"""The entropy bonus's coefficient: fixed (``algo.entropy_coef``), or adaptive (Skywork-OR1; TRL's
``use_adaptive_entropy``): the bonus applies only while the last step's mean entropy is at or below the target,
and after every optimizer step the coefficient moves by ``delta`` towards more bonus when the entropy was at or
below ``target``, towards less when above, within ``[min, max]``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EntropyControl:
    start: float = 0.0
    adaptive: bool = False
    target: float = 0.2
    delta: float = 0.005
    low: float = 0.0
    high: float = 1.0
    value: float | None = None  # the current coefficient (None: start)
    last_entropy: float = float("inf")  # the last optimizer step's mean entropy over its effective tokens

    @property
    def on(self) -> bool:
        return self.start != 0.0 or self.adaptive

    @property
    def coef(self) -> float:
        """The coefficient every micro-batch of the coming step applies."""
        value = self.start if self.value is None else self.value
        if self.adaptive:
            return value if self.last_entropy <= self.target else 0.0
        return value

    def update(self, mean_entropy: float) -> None:
        """After an optimizer step: its mean entropy over the tokens the bonus acted on."""
        if not self.adaptive:
            return
        value = self.start if self.value is None else self.value
        self.value = min(value + self.delta, self.high) if mean_entropy <= self.target else max(value - self.delta,
                                                                                                  self.low)
        self.last_entropy = mean_entropy

    def state(self) -> dict:
        return {"value": self.value, "last_entropy": self.last_entropy}

    def load(self, state: dict) -> None:
        self.value, self.last_entropy = state.get("value"), float(state.get("last_entropy", float("inf")))
