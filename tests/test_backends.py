"""The backend contract (rollout/backend.py) is real: every backend the engine can pick implements it."""

import inspect

import pytest

from rollyard.model.loading import build_preset, char_tokenizer
from rollyard.rollout import hf, native
from rollyard.rollout.backend import Backend
from rollyard.rollout.engine import RolloutEngine

BACKENDS = [native.NativeBackend, hf.BatchedHFBackend, hf.PerSeqHFBackend]
METHODS = [n for n, v in vars(Backend).items() if callable(v) and not n.startswith("_")]


def test_the_protocol_lists_the_methods_the_engine_calls():
    assert sorted(METHODS) == ["decode", "fork", "maybe_compact", "prefill", "refresh", "release", "reserve",
                               "restore", "snapshot"]


@pytest.mark.parametrize("cls", BACKENDS, ids=lambda c: c.__name__)
def test_every_backend_has_every_method_with_the_protocol_s_parameters(cls):
    for name in METHODS:
        want = list(inspect.signature(getattr(Backend, name)).parameters)
        got = list(inspect.signature(getattr(cls, name)).parameters)
        assert got == want, f"{cls.__name__}.{name}{tuple(got)} vs Backend.{name}{tuple(want)}"


@pytest.mark.parametrize("force", ["fast", "hf", "hf-perseq"])
def test_the_engine_s_backend_is_a_backend(force):
    model = build_preset("tiny", char_tokenizer(), seed=0)
    engine = RolloutEngine(model, eos_token_id=2, max_concurrent=2, max_cache_tokens=128)
    engine._use_backend(force)
    assert isinstance(engine.backend, Backend)
    assert isinstance(engine.backend, tuple(BACKENDS))


def test_a_class_missing_a_method_is_not_a_backend():
    class Half:
        name = "half"

        def reserve(self, active, needs):
            return []

    assert not isinstance(Half(), Backend)
