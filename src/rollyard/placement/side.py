"""The rollout side: what ``step.py``'s one GRPO step drives, for every placement.

A placement picks its side and calls ``step.train(run, roles, side)``: the in-process side
(``colocated.LocalRollout``: one engine in the trainer's process) or the Ray side (``pool.RolloutPool``:
actors that hand out work, receive groups, restart workers and never train). Both drive the run's round book
(``rollout/rounds.py``: which prompts, when a round closes, what it defers, the ``tail/*`` metrics and the
book's checkpoint state) and never branch on the scheduler.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Protocol, runtime_checkable

from rollyard.placement.run import Roles, RunRecord
from rollyard.placement.step import Taken
from rollyard.rollout.rounds import RoundBook
from rollyard.sync.session import SyncSession
from rollyard.types import Sample


@runtime_checkable
class RolloutSide(Protocol):
    """The rollout side's contract (``step.py`` calls it; the module docstring)."""

    run: RunRecord
    r: Roles  # the driver's role handles (the trainer's model: the logprob canary's other half)
    book: RoundBook  # the run's rounds, built once from the config (``rounds.make_book``)
    session: SyncSession  # the publish rule (``due``) and the check cadence

    def take(self, step: int, version: int) -> Taken:
        """The step's requests and their samples for the trainer at ``version`` (``train_metrics`` set when the
        side trained inside its round: tail batching in-process, ``streamed.py``)."""

    def trainer_turn(self) -> AbstractContextManager:
        """A context held while the trainer steps (an in-process engine gives the trainer its memory)."""

    def publish(self, step: int, version: int) -> int:
        """The trainer's weights at ``version`` to every receiver, catch-ups included; returns the bytes moved."""

    def check(self, step: int, version: int) -> None:
        """The equality check of every receiver against the trainer (``WeightsDiffer`` when one differs)."""

    def canary(self, version: int, probe: Sample, trainer_lp: list[float]) -> dict:
        """The logprob canary (``sync/canary.py``): the receivers score ``probe``; returns the step's metrics."""

    def metrics(self) -> dict:
        """This step's counters for its row (reset): the book's ``tail/*`` and the side's own."""

    def checkpoint(self) -> dict | None:
        """Called when a checkpoint is written: the book's state into the run's ``TrainState.extra``
        (``RoundBook.save``, its one writer); returns the side's extra RNG state to save beside it (or None)."""

    def stop(self) -> None:
        """End the side (engines, actors); called once, when the run's steps end or fail."""
