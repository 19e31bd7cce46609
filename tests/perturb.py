"""A copy of a model with every weight moved: what a trainer's update looks like to a weight sync's receiver."""

from __future__ import annotations

import copy

import torch


def perturbed(model, scale: float = 0.02, seed: int = 0):
    """A deep copy of ``model`` with ``N(0, scale^2)`` noise (seeded) added to every parameter."""
    out = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return out
