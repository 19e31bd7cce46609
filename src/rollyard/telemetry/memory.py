"""Peak resident memory per role, measured in the process that runs it: ``memory/<role>_peak_gb``.

Linux keeps a process's peak resident set (``VmHWM`` in ``/proc/self/status``) and lets the process reset
it (``5`` written to ``/proc/self/clear_refs``). At every span boundary the peak since the last reset is
credited to the process (``driver``, or the process's worker name) and to every role whose span is open,
then reset: so a role's peak is the highest resident memory the process reached while that role ran
(with the weights and state the other roles hold at that moment: roles that share a process share its
memory). ``train`` is reported as ``trainer``. Where the reset is refused (not Linux, a locked-down
/proc) a role's peak is the process's peak so far, an upper bound (``exact`` says which).

The reset also resets what ``getrusage``'s ``ru_maxrss`` reports for this process; ``/usr/bin/time`` and
``ru_maxrss`` read after a run are therefore only the peak since the last span; the run's own peak is
``summary.json``'s ``memory_peak_gb`` (role ``driver``).

On a GPU the tensors live in device memory, which RSS does not see: where the process has initialized CUDA,
the same per-role peaks are taken from PyTorch's allocator (``torch.cuda.max_memory_allocated``, summed over
the process's devices, reset with ``reset_peak_memory_stats`` at the same boundaries) as
``memory/<name>_gpu_peak_gb`` and ``summary.json``'s ``memory_gpu_peak_gb``. Memory allocated outside
PyTorch's allocator (vLLM's sleep-mode pool, NCCL's buffers) is not in it.
"""

from __future__ import annotations

import re
import sys
import threading

GB = 1e9
NAMES = {"train": "trainer"}
_HWM = re.compile(rb"VmHWM:\s+(\d+)\s+kB")


def peak_rss_bytes() -> int | None:
    """The process's peak resident set since start or the last reset, or None where /proc has none."""
    try:
        with open("/proc/self/status", "rb") as f:
            m = _HWM.search(f.read())
    except OSError:
        return None
    return int(m.group(1)) * 1024 if m else None


def reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _cuda():
    """``torch.cuda`` where this process has initialized CUDA (never initializes it), else None."""
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    try:
        return cuda if cuda is not None and cuda.is_initialized() else None
    except Exception:  # noqa: BLE001 - a half-initialized or broken CUDA: no GPU figure
        return None


def gpu_peak_bytes() -> int | None:
    """PyTorch's peak allocated device memory since the last reset, summed over this process's devices; None
    where the process has not initialized CUDA."""
    cuda = _cuda()
    if cuda is None:
        return None
    return sum(cuda.max_memory_allocated(d) for d in range(cuda.device_count()))


def reset_gpu_peak() -> None:
    cuda = _cuda()
    if cuda is not None:
        for d in range(cuda.device_count()):
            cuda.reset_peak_memory_stats(d)


class PeakMemory:
    """Per-role peaks for one process: ``enter(role)`` / ``exit(role)`` around each span; ``step_metrics()``
    (the peaks since the last call, as ``memory/<name>_peak_gb``) and ``run_peaks_gb()`` (over the run)."""

    def __init__(self, process: str = "driver"):
        self.process = process
        self.open: dict[str, int] = {}
        self.step: dict[str, int] = {}
        self.run: dict[str, int] = {}
        self.gpu_step: dict[str, int] = {}
        self.gpu_run: dict[str, int] = {}
        self.exact = True
        self._lock = threading.Lock()

    def _credit(self) -> None:
        names = [self.process, *(NAMES.get(r, r) for r, n in self.open.items() if n > 0)]
        for peak, step, run in ((peak_rss_bytes(), self.step, self.run), (gpu_peak_bytes(), self.gpu_step, self.gpu_run)):
            if peak is None:
                continue
            for name in names:
                step[name] = max(step.get(name, 0), peak)
                run[name] = max(run.get(name, 0), peak)

    def enter(self, role: str) -> None:
        with self._lock:
            self._credit()
            if self.exact:
                self.exact = reset_peak()
            reset_gpu_peak()
            self.open[role] = self.open.get(role, 0) + 1

    def exit(self, role: str) -> None:
        with self._lock:
            self._credit()
            self.open[role] = self.open.get(role, 1) - 1

    def observe(self, name: str, peak: int | None) -> None:
        """Another process's peak resident set (bytes), e.g. a Ray rollout actor's, reported with its work."""
        if peak:
            with self._lock:
                self.step[name] = max(self.step.get(name, 0), peak)
                self.run[name] = max(self.run.get(name, 0), peak)

    def step_metrics(self) -> dict[str, float]:
        """``memory/<name>_peak_gb`` for the process and each role spanned since the last call."""
        with self._lock:
            self._credit()
            out = {f"memory/{name}_peak_gb": b / GB for name, b in self.step.items()}
            out.update({f"memory/{name}_gpu_peak_gb": b / GB for name, b in self.gpu_step.items()})
            self.step, self.gpu_step = {}, {}
        return out

    def run_peaks_gb(self, gpu: bool = False) -> dict[str, float]:
        """Peak per process/role over the run: resident set, or with ``gpu`` PyTorch's device memory ({} without CUDA)."""
        with self._lock:
            self._credit()
            return {name: b / GB for name, b in sorted((self.gpu_run if gpu else self.run).items())}
