"""ALFWorld: household tasks as text games (TextWorld engine, `alfworld==0.4.2`, textworld 1.7).

    obs:    "You arrive at countertop 1. On the countertop 1, you see a apple 2, ..."; the first one
            ends with "Your task is to: put a clean apple in fridge." (the welcome banner is cut)
    action: any text; the game lists the admissible ones ("go to fridge 1", "take apple 2 from
            countertop 1", "move apple 2 to fridge 1", ...); anything else answers "Nothing happens."
    reward: 10 when the task is done (episode ends), else 0; truncated after max_steps (50)

The games of a split are the env's task list: reset(seed) plays game `seed % len(games)`. Sorted
paths come grouped by task type, so the train split is played in a fixed shuffled order (the same
permutation every run): a training iteration's consecutive fresh seeds then span the task types,
not one. Evaluation plays seeds 0..n-1 of a valid split in sorted order, the whole split the same
every run (`eval_sets`; the reference draws a random 128 each time). There is no randomness inside
a game: the same seed, the same start.

Data: `$ALFWORLD_DATA/json_2.1.1/{train,valid_seen,valid_unseen}/<task>/<trial>/game.tw-pddl`, the
layout `alfworld-download` makes (3553 / 140 / 134 games; movable and sliced tasks left out, as
alfworld does). Offline, `unpack()` extracts it from an archive of that layout.

Measured on 2 cores before the speed-ups below: load + reset ~0.8-1.2 s per game, step ~25-60 ms,
~10 MB a game. Nearly all of a step was TextWorld wording each admissible command (`textgen.derive`):
re-parsing the same grammar templates and conditions, and deep-copying its contexts; most of a
reset was fast-downward translating the game's PDDL, four times. SPEEDUPS memoizes the parses and
translations, makes the copies shallow and the facts' sort cheap, on import: the same observations
and admissible lists (tests/test_alfworld.py), steps ~19x and resets ~5x faster (`python -m
bench.alfworld --speedup_ab 1`, bench/README.md).

The anchor (GiGPO's step-group key) is the raw observation, as the reference has it. With
`--env_args inert_anchor=1` an action answered "Nothing happens." keeps the previous anchor: nothing
changed, so the agent acts from the same state again. The reference's anchor pools every such step,
whatever state it came from, into one step group (a fifth of a cloned SmolLM2's steps; docs/envs.md).

The expert (`ALFWorld(expert=True)`, `--env_args expert=1`): info["expert_action"] is the next
action of a plan that wins the game from the current state ("" once won). The plan is the game's
stored walkthrough at reset; it holds while the agent follows it (or sends an action that is not
admissible, which changes nothing); after any other action the env asks TextWorld for
`policy_commands`, the fast-downward planner re-run on the game's PDDL state: ALFWorld's own
`expert_type: planner` (AlfredExpert). Not ALFWorld's handcoded expert (HandCodedTWAgent): its reset
reads the task's `traj_data.json`, which the game archive here does not hold, and its heuristic
search is "not guaranteed to succeed" and draws random actions when stuck. The planner plays on the
game's full state, so it walks straight to where a hidden object lies (as the walkthroughs do). It
won all 274 valid_seen and valid_unseen games (docs/envs.md; tests/test_alfworld.py plays a subset,
also after an off-plan move). Cost: none while on the plan; a replan takes 0.2 s in a bedroom to
2-16 s in a large kitchen (2 loaded cores). Off by default: no planner runs, no key in the info.
"""

import copy
import functools
import glob
import json
import os
import random
import tarfile

import fast_downward
import gymnasium
import textworld
import textworld.envs.pddl.textgen as textgen
import textworld.logic as logic
from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos
from textworld.envs.pddl.pddl import PddlEnv
from textworld.envs.wrappers import Filter

from envs import TextSpace


def memoize(fn, size, hand_out=lambda result: result):
    """fn with its results kept (LRU, the last `size` argument sets); each call gets hand_out(result)
    (a copy, where callers change what they get)."""
    cached = functools.lru_cache(maxsize=size)(fn)
    return functools.wraps(fn)(lambda *args, **kwargs: hand_out(cached(*args, **kwargs)))


def clone_symbol(symbol):
    """A grammar symbol copied as deepcopy would, without deepcopy's generic walk: the symbol and the
    symbols it holds (a conditional's expression, a list's item) are new objects; strings and the
    context are shared (callers give a copy a new context, never change the old one in place)."""
    new = copy.copy(symbol)
    for attr in ("expression", "symbol"):
        if isinstance(getattr(new, attr, None), textgen.Symbol):
            setattr(new, attr, clone_symbol(getattr(new, attr)))
    return new


def copy_symbol(self, context):
    """textgen.Symbol.copy: the symbol cloned (not deep-copied with its old context) in a new context."""
    new = clone_symbol(self)
    new.context = textgen.copy_context(context)
    return new


@functools.lru_cache(maxsize=1 << 16)
def fact_key(fact):
    return fact.name, tuple((v.name, v.type) for v in fact.arguments)


def fact_before(self, other):
    """Proposition.__lt__ (the order TextWorld sorts a state's facts in, at every query) on cached
    tuples of strings: the same order as comparing (name, arguments) variable by variable."""
    if not isinstance(other, logic.Proposition):
        return NotImplemented
    return fact_key(self) < fact_key(other)


def shallow_context(context):
    """textgen.copy_context without its deep copies of the `variables` and `mapping` dicts: their
    only users add entries to the copy (textgen.query) or read it; no one changes an entity in them,
    so new dicts hold the same words. The deep copies (of every entity's info) were half of a step."""
    return {**context, "variables": dict(context["variables"]), "mapping": dict(context["mapping"])}


# TextWorld loads a new copy of fast-downward's 33 MB library for each game it starts (a temp file,
# deleted at once and kept mapped: ctypes never unloads it), so the file's disk blocks stay taken
# until the process ends: one per game an env worker ever played. 16 x 8 envs on new games each
# iteration filled the H200 host's 64 GB disk in 8 iterations (two runs). A closed game now gives
# its copy back and the next game loads its task into it (as each reset of a game already does).
FREE_LIBRARIES = []
load_library = fast_downward.load_lib


def reuse_library():
    return FREE_LIBRARIES.pop() if FREE_LIBRARIES else load_library()


def give_library_back(env, free=FREE_LIBRARIES):  # bound now: a game closed at exit finds no globals
    if getattr(env, "downward_lib", None) is not None:
        free.append(env.downward_lib)
        env.downward_lib = None


# TextWorld's slow spots, replaced in this process on import; the library's own kept in ORIGINAL.
# - textgen's template parser: derive() re-parses (tatsu) the template of every admissible command on
#   every step, from a small fixed set of templates; its callers then set each symbol's context.
# - textworld.logic's parser: textgen.query parses the same few conditions ("given" clauses) each time;
#   its rules and facts are values no caller changes, so one parse is handed out to all.
# - textgen.copy_context: deep copies on every derivation step (shallow_context above); Symbol.copy
#   deep-copies a symbol with its old context, which it then replaces (copy_symbol).
# - Proposition.__lt__: every query sorts the state's facts, comparing variable by variable in Python.
# - fast-downward's PDDL -> SAS translation: TextWorld builds a game's state at load and again at
#   every reset, each time translating twice (plain, and optimized for the planner): ~90% of a reset.
#   32 entries = the last 16 games; a reset of a loaded game, and a group's other envs in the same
#   worker, skip it.
SPEEDUPS = {  # name -> (module, attribute, ours)
    "template parses": (
        textgen,
        "_parse_and_convert",
        memoize(textgen._parse_and_convert, 8192, lambda symbols: [clone_symbol(s) for s in symbols]),
    ),
    "condition parses": (logic, "_parse_and_convert", memoize(logic._parse_and_convert, 8192)),
    "shallow contexts": (textgen, "copy_context", shallow_context),
    "symbol copies": (textgen.Symbol, "copy", copy_symbol),
    "fact order": (logic.Proposition, "__lt__", fact_before),
    "PDDL translations": (fast_downward, "pddl2sas", memoize(fast_downward.pddl2sas, 32, copy.deepcopy)),
    "library reuse": (fast_downward, "load_lib", reuse_library),  # the two halves of the reuse
    "library return": (PddlEnv, "close", give_library_back),  # above (not speed: disk)
}
ORIGINAL = {name: getattr(module, attr) for name, (module, attr, _) in SPEEDUPS.items()}


def use_speedups(names=tuple(SPEEDUPS)):
    """Switch SPEEDUPS on by name, the rest back to TextWorld's own (tests and bench.alfworld's A/B)."""
    for name, (module, attr, ours) in SPEEDUPS.items():
        setattr(module, attr, ours if name in names else ORIGINAL[name])


use_speedups()

TASK_TYPES = {  # game folder prefix -> the short name used in the paper's tables
    "pick_and_place_simple": "pick",
    "look_at_obj_in_light": "look",
    "pick_clean_then_place_in_recep": "clean",
    "pick_heat_then_place_in_recep": "heat",
    "pick_cool_then_place_in_recep": "cool",
    "pick_two_obj_and_place": "pick2",
}

INERT = "Nothing happens."  # the answer to an action that changes nothing (not admissible, or no effect)

# The paper's training setup for `--env alfworld` is train.py's PRESETS["alfworld"].
TINY_CORPUS_EPISODES = (
    3  # `--model tiny` trains its word-level tokenizer on this many random episodes (~1 min)
)


def eval_sets(n=None, data_dir=None, names=None):
    """Evaluation sets: name -> (env kwargs, seeds): valid_seen (in-distribution, 140 games) and
    valid_unseen (out-of-distribution, 134), each the whole split in order; n caps the count, taking
    games spread evenly over the split (it is sorted by task type: its first n would be one or two
    types); names picks some (only their games need to be there)."""
    known = ("valid_seen", "valid_unseen")
    unknown = [x for x in names or () if x not in known]
    if unknown:
        raise ValueError(f"--eval_sets {','.join(names)}: alfworld has the eval sets {','.join(known)}")
    sizes = {split: len(game_files(split, data_dir)) for split in names or known}
    return {
        split: ({"split": split}, [k * size // m for k in range(m)])
        for split, size in sizes.items()
        for m in [min(size, n or size)]
    }


def data_root(data_dir=None):
    return os.path.expanduser(data_dir or os.environ.get("ALFWORLD_DATA") or "~/.cache/alfworld")


def game_files(split, data_dir=None):
    root = data_root(data_dir)
    games = sorted(
        g
        for g in glob.glob(os.path.join(root, "json_2.1.1", split, "*", "*", "game.tw-pddl"))
        if not any(w in os.path.relpath(g, root) for w in ("movable", "Sliced"))
    )  # not in root's name
    if not games:
        raise FileNotFoundError(
            f"no ALFWorld games under {root}/json_2.1.1/{split}: run `alfworld-download` (needs internet) "
            f"or unpack json_2.1.1.tgz there (envs.alfworld.unpack), or set $ALFWORLD_DATA"
        )
    return games


def task_type(gamefile):
    folder = os.path.basename(os.path.dirname(os.path.dirname(gamefile)))
    return TASK_TYPES.get(folder.split("-")[0], folder.split("-")[0])


def unpack(archive, dest, splits=("train", "valid_seen", "valid_unseen"), per_type=None):
    """Extract the game files of `splits` from json_2.1.1.tgz into dest (= a $ALFWORLD_DATA).
    per_type: keep only the first k games (sorted) of each task type of each split (tests)."""
    with tarfile.open(archive) as tar:
        members = [
            m for m in tar.getmembers() if m.name.endswith("game.tw-pddl") and m.name.split("/")[1] in splits
        ]
        if per_type:
            kept, count = [], {}
            for m in sorted(members, key=lambda m: m.name):
                key = (m.name.split("/")[1], task_type(m.name))
                count[key] = count.get(key, 0) + 1
                if count[key] <= per_type:
                    kept.append(m)
            members = kept
        tar.extractall(dest, members=members, filter="data")
    return dest


class ALFWorld(gymnasium.Env):
    def __init__(self, split="train", data_dir=None, max_steps=50, expert=False, inert_anchor=False):
        for name, value in (("expert", expert), ("inert_anchor", inert_anchor)):
            if value not in (0, 1):  # True/False/0/1, as --env_args gives them
                raise ValueError(f"--env_args {name}={value!r}: alfworld's {name} is 0 or 1")
        self.expert, self.inert_anchor = bool(expert), bool(inert_anchor)
        self.infos = textworld.EnvInfos(won=True, admissible_commands=True, extras=["gamefile"])
        self.plan, self.admissible = [], set()
        self.games = game_files(split, data_dir)  # listed now: a missing data dir fails at once
        if split == "train":  # sorted = grouped by task type; a fixed shuffle mixes the types
            random.Random(0).shuffle(self.games)
        self.max_steps = max_steps
        self.env, self.gamefile = None, None
        self.observation_space, self.action_space = TextSpace(), TextSpace(["look"])

    def reset(self, seed=None, options=None):
        """reset(seed) or reset(seed=...): game seed % len(split); without a seed, one drawn from
        np_random."""
        super().reset(seed=seed)
        seed = seed if seed is not None else int(self.np_random.integers(2**62))
        gamefile = self.games[seed % len(self.games)]
        if gamefile != self.gamefile:  # a game is loaded once per env and reset in place after
            if self.env is not None:
                self.env.close()
            # Filter (state -> the requested infos) must wrap last, or reset crashes
            self.env = textworld.start(
                gamefile, self.infos, wrappers=[AlfredDemangler(), AlfredInfos, Filter]
            )
            self.gamefile = gamefile
        self.plan = self.walkthrough() if self.expert else []
        self.infos.policy_commands = self.expert and not self.plan  # a game without a walkthrough: plan
        obs, infos = self.env.reset()
        if self.infos.policy_commands:
            self.plan = infos["policy_commands"]
        obs = obs.split("=-\n\n", 1)[-1]  # cut the "-= Welcome to TextWorld, ALFRED! =-" banner
        self.task = obs.partition("Your task is to: ")[2].strip()
        self.steps, self.anchor = 0, obs
        return obs, self._info(obs, infos)

    def close(self):
        if self.env is not None:
            self.env.close()
        self.env, self.gamefile = None, None

    def step(self, action):
        if self.expert:  # replan only after an action that leaves the plan and changes the state
            follows = self.plan[:1] == [action.strip()]
            inert = action.strip() not in self.admissible  # the env answers "Nothing happens."
            self.infos.policy_commands = not (follows or inert)
        obs, _, _, infos = self.env.step(action)
        if self.expert:
            self.plan = self.plan[1:] if follows else self.plan if inert else infos["policy_commands"]
        self.steps += 1
        if not (self.inert_anchor and obs == INERT):  # else the state, and so the anchor, is unchanged
            self.anchor = obs
        won = bool(infos["won"])
        truncated = not won and self.steps >= self.max_steps
        return obs, 10.0 * won, won, truncated, self._info(obs, infos)

    def _info(self, obs, infos):
        info = {
            "task": self.task,
            "admissible_actions": list(infos["admissible_commands"]),
            "won": bool(infos["won"]),
            "anchor": self.anchor,
            "task_type": task_type(self.gamefile),
            "gamefile": self.gamefile,
        }
        if self.expert:
            self.admissible = set(info["admissible_actions"])
            info["expert_action"] = "" if info["won"] else (self.plan or [""])[0]
        return info

    def walkthrough(self):
        """The stored expert plan of the current game (a list of actions that wins it)."""
        with open(self.gamefile) as f:
            return json.load(f)["walkthrough"]


if __name__ == "__main__":
    # replay the walkthrough of every game of a split: checks the data and the engine end to end
    import sys
    import time

    split = sys.argv[1] if len(sys.argv) > 1 else "valid_unseen"
    env, won, t0 = ALFWorld(split), 0, time.perf_counter()
    for seed in range(len(env.games)):
        env.reset(seed)
        for action in env.walkthrough():
            _, reward, done, _, _ = env.step(action)
        won += reward == 10.0
    print(f"{split}: walkthroughs won {won} of {len(env.games)} games in {time.perf_counter() - t0:.0f}s")
