"""Env registry: `--env NAME` -> a class with the text-gym interface below.

    reset(seed) -> (obs: str, info)                      info: task, admissible_actions, won[, anchor]
    step(action: str) -> (obs, reward, terminated, truncated, info)

To add an env: write envs/<name>.py with such a class, prompts/<name>.py with build() and parse(),
and add one line to ENVS below (README, "Adding an env").
"""
import importlib

ENVS = {  # name -> (module, class, default kwargs)
    "treasure": ("envs.treasure", "TreasureHunt", {}),
    "alfworld": ("envs.alfworld", "ALFWorld", {}),
}


def env_class(name):
    if name not in ENVS:
        raise ValueError(f"unknown env {name!r}: use --env with one of {sorted(ENVS)}")
    module, cls, _ = ENVS[name]
    return getattr(importlib.import_module(module), cls)


def make_env(name, **kwargs):
    return env_class(name)(**{**ENVS[name][2], **kwargs})


from envs.vector import GroupedEnvs  # noqa: E402  (re-export)
