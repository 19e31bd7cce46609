"""Learning-rate schedules with warm-up: the multiplier of the base rate at optimizer step ``k`` of ``n``.

The schedules are transformers' (``get_scheduler``, what TRL's GRPOTrainer builds), by the same names and
keyword arguments, written from their definitions. The rate optimizer step ``k`` (0-based) uses is
``lr x multiplier(k)``: transformers' ``LambdaLR`` sets it before the first step and after each one, so step
``k`` runs at ``lambda(k)``, and that is the rate TRL logs for it. A step rollyard skips (a non-finite gradient)
still counts: the rate is a function of the step count, so the schedule ends with the run, a resumed run and every
data-parallel rank agree (transformers holds its scheduler back only on a step its fp16 loss scaler skips). ``n``
is the run's optimizer steps (``steps x trainer.epochs x trainer.mini_batches``).

Warm-up: ``warmup_steps`` if > 0, else ``warmup_ratio x n`` rounded up (transformers:
``math.ceil``) or down (verl: ``int``). During warm-up the multiplier rises linearly from 0 (step 0 trains
at rate 0, as in transformers), except ``cosine_warmup_with_min_lr``, whose warm-up starts above 0.

Every check raises ``ValueError`` with one line: the rule, the value, the fix. Standard library only (the
config layer validates with it; the trainer applies it).
"""

from __future__ import annotations

import math
from typing import Any

# name -> {keyword argument: default} (None: no default; a required one is checked in :func:`resolve`)
SCHEDULES: dict[str, dict[str, Any]] = {
    "constant": {},
    "constant_with_warmup": {},
    "linear": {},
    "cosine": {"num_cycles": 0.5},
    "cosine_with_restarts": {"num_cycles": 1.0},
    "polynomial": {"lr_end": 1e-7, "power": 1.0},
    "inverse_sqrt": {"timescale": None},
    "cosine_with_min_lr": {"num_cycles": 0.5, "min_lr": None, "min_lr_rate": None},
    "cosine_warmup_with_min_lr": {"num_cycles": 0.5, "min_lr": None, "min_lr_rate": None, "warmup_lr_rate": None},
}
ROUNDING = ("ceil", "floor")  # warmup_ratio x n: transformers rounds up, verl down


def warmup_steps(total: int, steps: int = 0, ratio: float = 0.0, rounding: str = "ceil") -> int:
    """The warm-up length: ``steps`` if > 0, else ``ratio x total`` rounded up (``ceil``, transformers'
    ``get_warmup_steps``) or down (``floor``, verl's ``int(ratio * total)``)."""
    if steps > 0:
        return int(steps)
    if rounding not in ROUNDING:
        raise ValueError(f"warm-up rounding must be one of {', '.join(ROUNDING)}, got {rounding!r}")
    x = ratio * total
    return int(math.ceil(x)) if rounding == "ceil" else int(x)


def resolve(name: str, kwargs: dict[str, Any] | None, lr: float, warmup: int) -> dict[str, Any]:
    """``name``'s keyword arguments with their defaults filled in and rates made relative to ``lr``
    (``min_lr`` -> ``min_lr_rate``, polynomial's ``lr_end`` -> ``lr_end_rate``); ValueError (one line) for an
    unknown schedule, an argument it does not take, a missing or conflicting one, or warm-up on ``constant``."""
    if name not in SCHEDULES:
        raise ValueError(f"learning-rate schedule {name!r} is not one rollyard has; use one of "
                         f"{', '.join(SCHEDULES)}")
    given = dict(kwargs or {})
    takes = SCHEDULES[name]
    extra = sorted(set(given) - set(takes))
    if extra:
        accepted = f"it takes {', '.join(takes)}" if takes else "it takes none"
        raise ValueError(f"trainer.lr_schedule={name} does not take schedule argument(s) {', '.join(extra)} ({accepted}); "
                         f"remove them from trainer.lr_schedule_kwargs or choose the schedule they belong to")
    if name == "constant" and warmup > 0:
        raise ValueError(f"trainer.lr_schedule=constant has no warm-up, but {warmup} warm-up step(s) are set (transformers "
                         f"drops them silently); use trainer.lr_schedule=constant_with_warmup, or set no warm-up")
    out = {**takes, **given}
    for key, value in out.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ValueError(f"schedule argument {key} must be a number, got {value!r}")
    if "min_lr" in takes:
        if out["min_lr"] is not None and out["min_lr_rate"] is not None:
            raise ValueError(f"trainer.lr_schedule={name}: set one of min_lr ({out['min_lr']}) and min_lr_rate "
                             f"({out['min_lr_rate']}), not both")
        if out["min_lr"] is None and out["min_lr_rate"] is None:
            raise ValueError(f"trainer.lr_schedule={name} needs min_lr or min_lr_rate in its schedule arguments, e.g. "
                             f"trainer.lr_schedule_kwargs={{min_lr_rate: 0.1}}")
        rate = out.pop("min_lr")
        out["min_lr_rate"] = float(out["min_lr_rate"] if rate is None else rate / lr)
    if name == "polynomial":
        if not lr > out["lr_end"]:
            raise ValueError(f"trainer.lr_schedule=polynomial decays from the learning rate to lr_end, so lr_end "
                             f"({out['lr_end']}) must be below it ({lr}); lower lr_end")
        out["lr_end_rate"] = out.pop("lr_end") / lr
    if name == "inverse_sqrt" and out["timescale"] is None:
        out["timescale"] = warmup or 10_000
    return out


def _ramp(k: int, warmup: int) -> float:
    return k / max(1, warmup)


def _progress(k: int, warmup: int, total: int) -> float:
    return (k - warmup) / max(1, total - warmup)


def multiplier(name: str, k: int, total: int, warmup: int, args: dict[str, Any]) -> float:
    """The rate multiplier at optimizer step ``k`` (0-based) of ``total``, after ``warmup`` warm-up steps;
    ``args`` from :func:`resolve`."""
    if name == "constant":
        return 1.0
    if name == "cosine_warmup_with_min_lr":  # its own warm-up and a progress one step ahead (transformers')
        if k < warmup:
            w = args["warmup_lr_rate"]
            return (k + 1.0) / max(1.0, warmup) if w is None else w + (1.0 - w) * k / max(1, warmup - 1)
        p = (k - warmup + 1.0) / max(1.0, total - warmup)
        c = 0.5 * (1.0 + math.cos(math.pi * args["num_cycles"] * 2.0 * p))
        return max(0.0, c * (1 - args["min_lr_rate"]) + args["min_lr_rate"])
    if k < warmup:
        return _ramp(k, warmup)
    if name == "constant_with_warmup":
        return 1.0
    if name == "inverse_sqrt":
        t = args["timescale"]
        return 1.0 / math.sqrt((k + t - warmup) / t)
    p = _progress(k, warmup, total)
    if name == "linear":
        return max(0.0, (total - k) / max(1, total - warmup))
    if name == "cosine":
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * args["num_cycles"] * 2.0 * p)))
    if name == "cosine_with_min_lr":
        c = 0.5 * (1.0 + math.cos(math.pi * args["num_cycles"] * 2.0 * p))
        return max(0.0, c * (1 - args["min_lr_rate"]) + args["min_lr_rate"])
    if name == "cosine_with_restarts":
        if p >= 1.0:
            return 0.0
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * ((args["num_cycles"] * p) % 1.0))))
    if name == "polynomial":
        end = args["lr_end_rate"]
        if k > total:
            return end
        remaining = 1 - (k - warmup) / (total - warmup)
        return (1 - end) * remaining ** args["power"] + end
    raise ValueError(f"learning-rate schedule {name!r} is not one rollyard has; use one of {', '.join(SCHEDULES)}")


def check(name: str, kwargs: dict[str, Any] | None, lr: float, total: int, warmup: int) -> None:
    """Every start-up check of one schedule (:func:`resolve`'s), and the rate it gives at every step is finite."""
    args = resolve(name, kwargs, lr, warmup)
    if name == "polynomial" and warmup >= total and total > 0:
        raise ValueError(f"trainer.lr_schedule=polynomial decays over the steps after warm-up, but warm-up ({warmup} "
                         f"steps) covers all {total} optimizer steps; shorten the warm-up")
    for k in {0, max(warmup - 1, 0), warmup, max(total - 1, 0)}:
        multiplier(name, k, total, warmup, args)
