"""The library's defaults are for real models (TRL's: lr 1e-6, 256 new tokens); the tests train tiny
presets for a few steps and were written against the toy values these defaults had before. The
suite runs in-process configs with the toy values (conftest applies them) unless a test sets its
own; tests/test_defaults.py checks the real defaults and the demo file."""

from __future__ import annotations

from contextlib import contextmanager

from rollyard import config

TOY = {(config.TrainerConfig, "lr"): 2e-3, (config.RolloutConfig, "max_new_tokens"): 16}
REAL = {key: key[0].model_fields[key[1]].default for key in TOY}  # the library's, read before any patch


def _set(values: dict) -> dict:
    old = {}
    for (model, name), value in values.items():
        old[(model, name)] = model.model_fields[name].default
        model.model_fields[name].default = value
        model.model_rebuild(force=True)
    config.RunConfig.model_rebuild(force=True)
    return old


@contextmanager
def defaults(values: dict = TOY):
    """Library defaults replaced by ``values`` inside the block (in this process)."""
    old = _set(values)
    try:
        yield
    finally:
        _set(old)
