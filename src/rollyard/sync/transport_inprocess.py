"""In-process transport: the update object is handed over within one process; zero bytes move.

Colocated placements use it: with mode ``inprocess`` the engine shares the trainer's module; with
``full`` or ``lora`` it hands a separate rollout copy (another dtype, or merged LoRA weights) the
tensors by reference. Nothing crosses a process boundary, so ``send`` returns 0.
"""

from __future__ import annotations

from collections import deque

from rollyard.types import WeightUpdate


class InProcessTransport:
    """``send(update) -> 0`` queues the update; ``recv()`` returns the oldest queued one."""

    name = "inprocess"

    def __init__(self):
        self._queue: deque[WeightUpdate] = deque()

    def send(self, update: WeightUpdate) -> int:
        update.nbytes = 0
        self._queue.append(update)
        return 0

    def recv(self) -> WeightUpdate:
        if not self._queue:
            raise RuntimeError("InProcessTransport.recv: nothing was sent; call send(update) first")
        return self._queue.popleft()

    def close(self) -> None:
        self._queue.clear()
