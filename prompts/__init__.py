"""One module per env: `build(task, history_text, obs, admissible, step) -> chat messages` and
`parse(response_text, admissible) -> (action, valid)`. parse never raises: anything it cannot read
is an invalid action (valid=False), which the env treats as a no-op and the advantage penalises."""
import importlib


def prompt_module(env_name):
    try:
        return importlib.import_module(f"prompts.{env_name}")
    except ModuleNotFoundError as e:
        raise ValueError(f"no prompt module prompts/{env_name}.py for --env {env_name}") from e
