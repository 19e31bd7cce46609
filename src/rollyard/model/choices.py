"""The numerics-relevant choices this process has made on the CPU, as ``run.json``'s ``kernels`` records them: the
compiled kernels' (:func:`rollyard.model.kernels.choices`) and whether fp32 linear layers run on oneDNN
(:func:`rollyard.model.gemm.enabled`). Deterministic by shape, CPU features and settings, never by timing."""

from __future__ import annotations

from rollyard.config import env_flag
from rollyard.model import gemm, kernels


def choices() -> dict:
    return {**kernels.choices(), "onednn_linear": gemm.enabled(), "onednn_setting": env_flag("ROLLYARD_ONEDNN")}
