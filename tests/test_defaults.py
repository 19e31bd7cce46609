"""Library defaults for real models (TRL's where they compare); the demo's toy values live in examples/demo.toml."""

from __future__ import annotations

from pathlib import Path

import pytest
from toy_defaults import REAL, TOY, defaults

from rollyard import aliases
from rollyard.config import RunConfig, load_config

DEMO = Path(__file__).resolve().parents[1] / "examples" / "demo.toml"


def test_library_defaults_are_trl_s_where_they_compare():
    with defaults(REAL):
        cfg = RunConfig()
    assert cfg.trainer.lr == pytest.approx(1e-6)  # TRL GRPOConfig.learning_rate
    assert cfg.rollout.max_new_tokens == 256  # TRL max_completion_length
    assert cfg.rollout.samples_per_prompt == aliases.TRL_DEFAULTS["num_generations"]
    assert (cfg.rollout.temperature, cfg.rollout.top_p, cfg.algo.kl_coef, cfg.algo.clip_low) == (1.0, 1.0, 0.0, 0.2)
    assert cfg.trainer.max_grad_norm == 1.0 and cfg.trainer.weight_decay == 0.0


def test_the_demo_resolves_to_the_same_values_as_before():
    """examples/demo.toml holds the toy values: resolved under the old defaults and the new, it is the same run."""
    with defaults(REAL):
        now = load_config(DEMO).model_dump()
    with defaults(TOY):
        before = load_config(DEMO).model_dump()
    assert now == before
    assert (now["trainer"]["lr"], now["rollout"]["max_new_tokens"]) == (2.5e-4, 8)
