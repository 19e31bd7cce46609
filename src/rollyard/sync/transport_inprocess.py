"""In-process transport: the update object is handed over within one process; zero bytes move.

Colocated placements use it: with mode ``inprocess`` the engine shares the trainer's module; with
``full`` or ``lora`` it hands a separate rollout copy (another dtype, or merged LoRA weights) the
tensors by reference. Nothing crosses a process boundary, so ``send`` returns 0.

Its two halves for ``sync.session``: ``InProcessSender`` (trainer half: hands the update to each
receiver in this process, no handshake) and the receiver's ``open`` (the handle is the update).
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


class InProcessSender:
    """Trainer half: ``send(update, receivers)`` calls each receiver's ``update(update)`` at once (they
    live in this process); a receiver that rejects it (returns False) is reported as missed."""

    name = "inprocess"

    def connect(self, receivers: dict) -> None:
        """No handshake: the receivers are objects in this process."""

    def handle(self, update: WeightUpdate) -> tuple[WeightUpdate, int]:
        """A whole update for one receiver (start-up, catch-up): the update itself, 0 bytes moved."""
        update.nbytes = 0
        return update, 0

    def send(self, update: WeightUpdate, receivers: dict) -> tuple[int, list[str]]:
        handle, nbytes = self.handle(update)
        return nbytes, [name for name, r in receivers.items() if r.update(handle) is False]


def open_handle(handle: WeightUpdate) -> WeightUpdate:
    """Receiver half: an in-process handle is the update."""
    return handle
