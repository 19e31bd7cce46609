"""Typed config: files, overrides, unknown keys with suggestions, bounds, resolved copy."""

import pytest
import yaml

from rollyard.config import ConfigError, RunConfig, describe, dump_config, load_config


def test_file_plus_overrides(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('steps = 7\n[rollout]\ntemperature = 0.5\nsamples_per_prompt = 4\n')
    cfg = load_config(f, ["rollout.temperature=0.9", "trainer.lr=1e-4", "data.task=arithmetic"])
    assert cfg.steps == 7
    assert cfg.rollout.temperature == 0.9  # the command line wins over the file
    assert cfg.rollout.samples_per_prompt == 4
    assert cfg.trainer.lr == pytest.approx(1e-4)


def test_yaml_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("rollout:\n  max_new_tokens: 9\n")
    assert load_config(f).rollout.max_new_tokens == 9


@pytest.mark.parametrize("override,named,suggested", [
    ("rollout.temprature=1", "rollout.temprature", "rollout.temperature"),
    ("trainr.lr=1", "trainr", "trainer"),
    ("stpes=3", "stpes", "steps"),
    ("lr=1", "lr", "trainer.lr"),  # a nested leaf's own name, not the closest top-level key (eval_every)
    ("temprature=1", "temprature", "rollout.temperature"),  # (`temperature` alone is TRL's name for it)
    ("rollout.lr=1", "rollout.lr", "trainer.lr"),
])
def test_unknown_key_names_key_and_closest(override, named, suggested):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert repr(named) in str(e.value) and repr(suggested) in str(e.value)


def test_bounds_and_cross_checks_say_value_and_fix():
    with pytest.raises(ConfigError, match=r"rollout.top_p.*got 1.5"):
        load_config(None, ["rollout.top_p=1.5"])
    with pytest.raises(ConfigError, match=r"samples_per_prompt must be >= 2.*got 1"):
        load_config(None, ["rollout.samples_per_prompt=1"])
    with pytest.raises(ConfigError, match="not key=value"):
        load_config(None, ["steps"])


def test_a_union_field_that_matches_no_member_is_one_entry_naming_them_all():
    """``activation_checkpointing: bool | "auto"``: pydantic reports one error per member of the union; the line says
    the field once with both accepted forms. Two sibling fields with the same bad value stay two entries."""
    with pytest.raises(ConfigError) as e:
        load_config(None, ["trainer.activation_checkpointing=maybe", "trainer.lr=x"])
    said = str(e.value)
    assert "trainer.activation_checkpointing: Input should be a valid boolean or 'auto' (got 'maybe')" in said
    assert said.count("activation_checkpointing") == 1 and "literal" not in said
    assert "trainer.lr: Input should be a valid number" in said and "\n" not in said
    with pytest.raises(ConfigError) as e:
        load_config(None, ["rollout.temperature=x", "rollout.top_p=x"])
    assert "rollout.temperature: Input" in str(e.value) and "rollout.top_p: Input" in str(e.value)


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("steps = = 3")
    with pytest.raises(ConfigError, match="does not parse"):
        load_config(bad)
    with pytest.raises(ConfigError, match="expected a .toml"):
        (tmp_path / "c.json").write_text("{}")
        load_config(tmp_path / "c.json")


def test_resolved_copy_round_trips(tmp_path):
    cfg = load_config(None, ["steps=3", "rollout.temperature=0.7"])
    dump_config(cfg, tmp_path / "config.yaml")
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert saved["rollout"]["max_new_tokens"] == RunConfig().rollout.max_new_tokens  # defaults are filled in
    assert load_config(tmp_path / "config.yaml") == cfg


def test_every_field_is_documented():
    lines = describe()
    assert len(lines) > 30
    assert all("# None" not in line and line.split("# ", 1)[1].strip() for line in lines)


def test_overrides_may_stand_before_and_after_config(capsys):
    from rollyard.cli import main
    # steps=0 is invalid: reaching that error proves both overrides were parsed around --config
    assert main(["train", "steps=0", "--config", "examples/demo.toml", "seed=1"]) == 2
    err = capsys.readouterr().err
    assert "steps" in err and "unrecognized arguments" not in err
