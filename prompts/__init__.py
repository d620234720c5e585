"""One module per env: `build(task, history_text, obs, admissible, step) -> chat messages` and
`parse(response_text, admissible) -> (action, valid)`. parse never raises: anything it cannot read
is an invalid action (valid=False), which the env treats as a no-op and the advantage penalises.
A module may also define `build_chat` / `parse_chat`: the versions for a pretrained chat model
(an instruction it can follow), used for every model but the tiny one trained from scratch. Other
`build_NAME` / `parse_NAME` pairs are variants a run picks with `--prompt NAME` (ALFWorld's
`choice`: answer with an action's number, for models too small to write the tagged format)."""

import importlib
from types import SimpleNamespace


def prompt_module(env_name, chat=False, variant=""):
    """-> an object with build and parse; chat=True takes build_chat / parse_chat where defined;
    variant="NAME" takes build_NAME / parse_NAME (train.py --prompt NAME; ValueError if absent)."""
    try:
        module = importlib.import_module(f"prompts.{env_name}")
    except ModuleNotFoundError as e:
        raise ValueError(f"no prompt module prompts/{env_name}.py for --env {env_name}") from e
    if variant:
        if not hasattr(module, f"build_{variant}") or not hasattr(module, f"parse_{variant}"):
            names = sorted(
                k[6:] for k in vars(module) if k.startswith("build_") and callable(getattr(module, k))
            )
            raise ValueError(
                f"--prompt {variant}: prompts/{env_name}.py has the variants {', '.join(names) or 'none'}"
            )
        return SimpleNamespace(
            build=getattr(module, f"build_{variant}"), parse=getattr(module, f"parse_{variant}")
        )
    if not chat:
        return module
    return SimpleNamespace(
        build=getattr(module, "build_chat", module.build), parse=getattr(module, "parse_chat", module.parse)
    )
