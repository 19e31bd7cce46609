"""An environment's ``get_reward()`` as a reward hook: ``rollyard.env.rewards:<ClassName>``.

The multi-turn loop stores each sample's ``get_reward()`` in ``meta["env_reward"]``; the hook reads it
back in the reward worker, so it runs (and is logged, ``rewards/<ClassName>/mean``) like any other
reward function, weighted and combined with them. Any attribute of this module is that hook, so the
hook's name, and with it its metric, is the environment class's name. Standard library only: the
reward workers import it.
"""

from __future__ import annotations

ENV_REWARD_KEY = "env_reward"


def environment_reward(completion, prompt, meta) -> float:
    """The sample's environment reward; raises (the call is flagged) when ``get_reward()`` failed."""
    value = meta.get(ENV_REWARD_KEY)
    if isinstance(value, str) or value is None:
        raise RuntimeError(f"the environment's get_reward() failed: {value or 'no value (sample had no environment)'}")
    return float(value)


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return environment_reward


def hook_path(class_name: str) -> str:
    return f"{__name__}:{class_name}"
