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
    "sokoban": ("envs.sokoban", "Sokoban", {}),
}


def env_class(name):
    if name not in ENVS:
        raise ValueError(f"unknown env {name!r}: use --env with one of {sorted(ENVS)}")
    module, cls, _ = ENVS[name]
    return getattr(importlib.import_module(module), cls)


def parse_env_args(name, text):
    """--env_args "size=6,walls=3" -> {"size": 6, "walls": 3}; the keys must be the env's constructor
    arguments (ValueError naming the flag otherwise). Values are Python literals, else strings."""
    import ast
    import inspect
    known = set(inspect.signature(env_class(name)).parameters)
    out = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        key, eq, value = item.partition("=")
        if not eq or key.strip() not in known:
            raise ValueError(f"--env_args {text!r}: {item!r} is not key=value with a key of {name}'s "
                             f"arguments ({', '.join(sorted(known))})")
        try:
            out[key.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            out[key.strip()] = value.strip()
    return out


def make_env(name, **kwargs):
    return env_class(name)(**{**ENVS[name][2], **kwargs})


from envs.vector import GroupedEnvs  # noqa: E402  (re-export)
