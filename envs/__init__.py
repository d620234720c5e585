"""Env registry: `--env NAME` -> a gymnasium.Env with text observations and actions:

    reset(seed=None, options=None) -> (obs: str, info)   info: task, admissible_actions, won[, anchor]
    step(action: str) -> (obs, reward, terminated, truncated, info)

reset also takes the seed positionally (GroupedEnvs calls reset(seed)), and the first observation
depends on the seed alone. Every env is registered with gymnasium as gigpo/<Class>-v0, so
`gymnasium.make("gigpo/TreasureHunt-v0")` works. The trainer steps envs through GroupedEnvs
(envs/vector.py), not gymnasium's vector envs: it steps only the envs still playing, checks that
the envs of a group start identical, and restarts a dead worker process without losing the batch.

To add an env: write envs/<name>.py with such a class, prompts/<name>.py with build() and parse(),
and add one line to ENVS below (README, "Course assignments").

Imports run one way: prompts may import from envs (prompts/search.py takes the env's ACTION pattern),
never the reverse; no env imports a prompt module, a model or the trainer (torch, transformers, tiny,
rollout, train, ...). What looks at an env through a model lives in bench/ (the treasure hunt's action
table of a trained model: bench/treasure.py). tests/test_envs.py checks it.

Optional hooks (an env without them gets the default; ALFWorld uses all three):
  in envs/<name>.py, read through env_module(name):
    eval_sets(n, names=None) -> {set name: (env kwargs, seeds)}   evaluate.py plays these named eval
        sets instead of the held-out seeds (ALFWorld: valid_seen and valid_unseen); n caps each set
        (--eval_episodes), names picks some (--eval_sets; an unknown name raises ValueError)
    TINY_CORPUS_EPISODES = int   tiny.py trains the tiny model's tokenizer on this many random
        episodes (default 200; fewer for an env with slow resets)
  in train.py:
    PRESETS[name] = dict(...)    Config values `--env name` applies before the flags (ALFWorld: the
        paper's setup)
An env instance may also carry `max_steps` (the batch arithmetic printed at start shows it).
"""

import importlib
import inspect

import gymnasium


class TextSpace(gymnasium.spaces.Space):
    """Any string (gymnasium's Text space rejects characters outside its charset, newlines among
    them); sample() draws one of `examples` (the moves, for an action space)."""

    def __init__(self, examples=("",), seed=None):
        super().__init__(seed=seed)
        self.examples = list(examples)

    def contains(self, x):
        return isinstance(x, str)

    def sample(self, mask=None, probability=None):
        return self.examples[int(self.np_random.integers(len(self.examples)))]


ENVS = {  # name -> (module, class, default kwargs)
    "treasure": ("envs.treasure", "TreasureHunt", {}),
    "keydoor": ("envs.keydoor", "KeyDoor", {}),
    "alfworld": ("envs.alfworld", "ALFWorld", {}),
    "sokoban": ("envs.sokoban", "Sokoban", {}),
    "webshop": ("envs.webshop", "WebShop", {}),
    "search": ("envs.search", "Search", {}),
    "appworld": ("envs.appworld", "AppWorld", {}),
}


def env_module(name):
    """The module of env `name`: where its optional hooks live (above)."""
    if name not in ENVS:
        raise ValueError(f"unknown env {name!r}: use --env with one of {sorted(ENVS)}")
    return importlib.import_module(ENVS[name][0])


def env_class(name):
    return getattr(env_module(name), ENVS[name][1])


def parse_env_args(name, text, what=None):
    """--env_args "size=6,walls=3" -> {"size": 6, "walls": 3}; the keys must be the env's constructor
    arguments (ValueError naming the flag, or `what` the arguments came in, otherwise). Values are
    Python literals, else strings."""
    import ast
    import inspect

    known = set(inspect.signature(env_class(name)).parameters)
    out = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        key, eq, value = item.partition("=")
        if not eq or key.strip() not in known:
            raise ValueError(
                f"{what or f'--env_args {text!r}'}: {item!r} is not key=value with a key of {name}'s "
                f"arguments ({', '.join(sorted(known))})"
            )
        try:
            out[key.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            out[key.strip()] = value.strip()
    return out


def env_kwargs(env, text):
    """The arguments the env is built with under --env_args text: its constructor's defaults, the
    registry's, then text's (so "size=5" and "" are the same treasure hunt)."""
    params = inspect.signature(env_class(env)).parameters
    return {
        **{k: p.default for k, p in params.items() if p.default is not p.empty},
        **ENVS[env][2],
        **parse_env_args(env, text),
    }


# env arguments that leave the games as they are (a reward term, an anchor's key, a server's address):
# runs that differ in them alone played the same games (python -m evaluate pairs them)
SAME_GAMES = {"progress", "pool_bumps", "inert_anchor", "servers", "retriever_url", "timeout"}


def script_args(name, argv):
    """`python -m envs.NAME key=value ...` (an env's baselines as a script) -> its constructor kwargs;
    bad arguments stop in one line that names the env's keys."""
    try:
        return parse_env_args(name, ",".join(argv), what=f"python -m envs.{name} {' '.join(argv)}")
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None


def test_set(name, names, n, size):
    """eval_sets() of an env whose one eval set is "test", its test split in order (n caps the
    count). size() builds the env and counts the split: bad --env_args or missing data fail there,
    in one line, before any work."""
    if any(x != "test" for x in names or ()):
        raise ValueError(f"--eval_sets {','.join(names)}: {name} has the eval set test")
    count = size()
    return {"test": ({"split": "test"}, list(range(min(count, n or count))))}


def make_env(name, **kwargs):
    return env_class(name)(**{**ENVS[name][2], **kwargs})


for _name, (_module, _cls, _kw) in ENVS.items():  # gymnasium.make("gigpo/TreasureHunt-v0", size=6)
    gymnasium.register(f"gigpo/{_cls}-v0", entry_point=f"{_module}:{_cls}", kwargs=_kw)


from envs.vector import GroupedEnvs as GroupedEnvs  # noqa: E402  (re-export)
