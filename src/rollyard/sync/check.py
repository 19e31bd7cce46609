"""The equality check: the rollout copy holds exactly the weights the trainer published.

``weights_checksum(tensors)`` hashes (name, dtype, shape, raw bytes) in name order: equal checksums
mean bit-identical weights, so two processes compare 64 hex characters, not the weights.
``compare_weights(expected, model)`` is the check a driver runs at start-up and every
``sync.check_every`` syncs: checksums first, and on a mismatch the first differing tensor (in name
order) with its max absolute difference, raised as ``WeightsDiffer``.
"""

from __future__ import annotations

import hashlib

import torch


class WeightsDiffer(RuntimeError):
    """The rollout copy does not hold the trainer's published weights; samples would be off-policy."""


def _named(source) -> dict[str, torch.Tensor]:
    if isinstance(source, dict):
        return source
    return {n: p.detach() for n, p in source.named_parameters()}


def weights_checksum(source) -> str:
    """sha256 over (name, dtype, shape, bytes) of every tensor, sorted by name.

    ``source``: a module (its deduplicated parameters) or a ``{name: tensor}`` dict.
    """
    h = hashlib.sha256()
    for name, t in sorted(_named(source).items()):
        t = t.detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def first_difference(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> str | None:
    """A description of the first tensor (name order) that differs, or None when all are identical."""
    for name in sorted(set(expected) | set(actual)):
        if name not in actual or name not in expected:
            return f"tensor {name!r} is only on the {'trainer' if name in expected else 'rollout'} side"
        e, a = expected[name].detach().cpu(), actual[name].detach().cpu()
        if e.dtype != a.dtype or e.shape != a.shape:
            return f"tensor {name!r}: trainer {e.dtype}{tuple(e.shape)}, rollout {a.dtype}{tuple(a.shape)}"
        if not torch.equal(e.view(-1).view(torch.uint8), a.view(-1).view(torch.uint8)):
            diff = (e.float() - a.float()).abs()
            n = int((e.float() != a.float()).sum())
            return f"first differing tensor {name!r}: max |diff| {float(diff.max()):.3g} over {n} element(s)"
    return None


def compare_weights(expected: dict[str, torch.Tensor], model, version: int | None = None) -> None:
    """Raise ``WeightsDiffer`` naming the first differing tensor unless ``model`` holds ``expected`` bit for bit."""
    actual = _named(model)
    if weights_checksum(expected) == weights_checksum(actual):
        return
    what = first_difference(expected, actual) or "checksums differ"
    raise WeightsDiffer(f"weight sync equality check failed at version {version}: {what}; the rollout copy is "
                        f"not the trainer's policy (a sync bug): stopping rather than sampling from it")
