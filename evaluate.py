"""Evaluation: the eval sets of an env, episodes at eval_temperature on them, a random baseline.

An env module may define `eval_sets(n)` -> {name: (env kwargs, seeds)} (ALFWorld: valid_seen and
valid_unseen, whole splits in order); otherwise the held-out seeds 10**9 + [0, eval_episodes) are
played, the same every run. Each set is reported on its own, never averaged with another: ALFWorld's
splits measure different things (in and out of distribution), and the paper reports them apart.

Every eval also writes out_dir/eval.json (each set's games won, in order), so that two models
evaluated on the same games compare game by game: `python -m evaluate RUN_A RUN_B` (paired()).
"""

import hashlib
import inspect
import json
import math
import os
import random
import sys
import threading
import time

import numpy as np
from tqdm import tqdm

import records
from envs import SAME_GAMES, GroupedEnvs, env_kwargs, env_module, parse_env_args
from memory import make_memory
from rollout import rollout

HELD_OUT = 10**9  # held-out seeds: HELD_OUT + [0, eval_episodes); training seeds skip [HELD_OUT, 2 HELD_OUT)


def eval_plan(cfg):
    """The eval sets {name: (env kwargs, seeds)}. An env module with eval_sets(n) names its own
    (ALFWorld: valid_seen and valid_unseen, whole splits in order; eval_episodes caps each, games
    spread over the split;
    --eval_sets picks some; it gets the --env_args it names, e.g. data_dir); any other env: the
    held-out seeds 10**9 + [0, eval_episodes)."""
    sets_fn = getattr(env_module(cfg.env), "eval_sets", None)  # the optional hook (envs/__init__.py)
    if sets_fn is None:
        if cfg.eval_sets:
            raise ValueError(
                f"--eval_sets {cfg.eval_sets}: {cfg.env} has no named eval sets (it plays held-out seeds)"
            )
        return {"held-out": ({}, [HELD_OUT + k for k in range(cfg.eval_episodes)])}
    params = inspect.signature(sets_fn).parameters  # the --env_args it takes (data_dir: where the sets are)
    env_args = {
        k: v
        for k, v in parse_env_args(cfg.env, cfg.env_args).items()
        if k in params or any(p.kind == p.VAR_KEYWORD for p in params.values())
    }
    return sets_fn(cfg.eval_episodes, names=[n for n in cfg.eval_sets.split(",") if n] or None, **env_args)


def eval_what(cfg):
    """What the eval played, for the last line: '256 seeds, greedy' or 'valid_seen 140 + ... games, T=0.4'."""
    plan = eval_plan(cfg)
    what = (
        f"{cfg.eval_episodes} seeds"
        if "held-out" in plan
        else " + ".join(f"{name} {len(seeds)}" for name, (_, seeds) in plan.items()) + " games"
    )
    return f"{what}, {'greedy' if cfg.eval_temperature == 0 else f'T={cfg.eval_temperature}'}"


def eval_envs_for(cfg, envs, kwargs, seeds):
    """A named set gets its own envs (one group of 1 per game, closed after use), its games starting
    to load at once in their env workers; the held-out seeds are played on `envs`, made once in main()."""
    if not kwargs:
        return envs
    set_envs = GroupedEnvs(
        cfg.env, len(seeds), 1, workers=cfg.env_workers, **{**parse_env_args(cfg.env, cfg.env_args), **kwargs}
    )
    set_envs.prefetch(list(seeds))  # in-process envs: nothing to do
    return set_envs


def made_ahead(cfg, envs, item):
    """item: (name, (kwargs, seeds)) of eval_plan -> {name: its envs, made now, its games loading in
    their workers}; {} for the held-out seeds or in-process envs (nothing to load ahead)."""
    name, (kwargs, seeds) = item
    return {name: eval_envs_for(cfg, envs, kwargs, seeds)} if kwargs and cfg.env_workers else {}


def first_set(cfg, envs):
    """The first eval set made ahead (made_ahead), for an eval that starts later: --eval_only's while
    the model and the engine are built, a run's during the update."""
    return made_ahead(cfg, envs, next(iter(eval_plan(cfg).items())))


def each_set(cfg, envs, ahead=None):
    """The eval sets in eval_plan's order -> (name, seeds, the envs that play them). With env workers
    the next named set's envs are made, its games loading, while this one plays (an ALFWorld game
    takes seconds to load: the splits' loads were most of an eval); ahead: sets made before (first_set).
    A named set's envs are closed after it."""
    plan, ahead = list(eval_plan(cfg).items()), dict(ahead or {})
    try:
        for k, (name, (kwargs, seeds)) in enumerate(plan):
            set_envs = ahead.pop(name, None) or eval_envs_for(cfg, envs, kwargs, seeds)
            if k + 1 < len(plan):
                ahead |= made_ahead(cfg, envs, plan[k + 1])
            yield name, seeds, set_envs
            if set_envs is not envs:
                set_envs.close()
    finally:  # an eval cut short: the sets made ahead
        for other in ahead.values():
            other.close()


def evaluate(tok, cfg, envs, prompt, engine, on_samples=None, iteration=None, ahead=None):
    """Episodes at eval_temperature (0 = greedy) on the eval sets -> {set: success}, in eval_plan's
    order, plus {"set/type": success} per task type (info["task_type"]) where there is one. Prints a
    line per named set: its success, per task type, and the share of invalid-action steps. Writes
    out_dir/eval.json once the last set ends: the iteration, these rates, each set's games won (1) or
    not (0) in order and (named sets with task types) each game's type, for a game-by-game comparison
    of two evals (`python -m evaluate A B`), and the env, its --env_args and each set's seeds (compare
    refuses two evals of other games, or one cut short). As each set before the last ends, the same
    goes to eval.partial.json ("complete" false): an eval cut short keeps the sets it played there,
    and leaves the last whole eval.json as it was (the partial file goes once the eval is whole). A
    game a dead env worker cut short is no result: null in eval.json, left out of every rate (and
    said so). ahead: first_set's, made before."""
    rates, games, types, played, plan = {}, {}, {}, {}, eval_plan(cfg)
    for name, seeds, set_envs in each_set(cfg, envs, ahead):
        played[name] = list(seeds)
        memories = [make_memory(cfg.memory, cfg.memory_k or None) for _ in range(set_envs.n)]
        samples, episodes, _ = rollout(
            set_envs,
            engine,
            tok,
            prompt,
            memories,
            seeds,
            cfg.eval_temperature,
            1.0,
            cfg.max_response_tokens,
            desc=f"eval {name}" if set_envs is not envs else None,
            overlap=cfg.overlap,
        )
        if on_samples:  # records.py: a few whole episodes of each set go to disk
            on_samples(name, samples)
        games[name] = [None if e.get("worker_died") else int(e["won"]) for e in episodes]
        rates[name] = known_mean(games[name])
        if None in games[name]:
            tqdm.write(
                f"eval {name}: {games[name].count(None)} games cut short by a dead env worker, left out"
            )
        if set_envs is not envs:
            if any(e.get("task_type") for e in episodes):
                types[name] = [e.get("task_type", "") for e in episodes]
            by_type = {}  # task type -> [won, ...]
            for t, won in zip(types.get(name, []), games[name]):
                if t and won is not None:
                    by_type.setdefault(t, []).append(won)
            rates |= {f"{name}/{t}": float(np.mean(w)) for t, w in sorted(by_type.items())}
            per_type = " ".join(
                f"{t} {rates[f'{name}/{t}']:.3f} ({len(w)})" for t, w in sorted(by_type.items())
            )
            invalid = sum(e["invalid"] for e in episodes) / max(1, sum(e["length"] for e in episodes))
            tqdm.write(
                f"eval {name}: success {rates[name]:.3f} "
                f"over {len(episodes) - games[name].count(None)} games, "
                f"invalid actions {invalid:.3f} of steps | {per_type}"
            )
        write_eval(cfg, iteration, rates, games, types, played, whole=len(games) == len(plan))
    return rates


def write_eval(cfg, iteration, rates, games, types, seeds, whole):
    """eval.json once an eval is whole (and its eval.partial.json gone); eval.partial.json before."""
    os.makedirs(cfg.out_dir, exist_ok=True)
    partial = os.path.join(cfg.out_dir, "eval.partial.json")
    ev = dict(iteration=iteration, model=cfg.model, temperature=cfg.eval_temperature, rates=rates)
    ev |= dict(games=games, types=types, env=cfg.env, env_args=cfg.env_args, seeds=seeds, complete=whole)
    records.write_whole(os.path.join(cfg.out_dir, "eval.json") if whole else partial, json.dumps(ev))
    if whole and os.path.exists(partial):
        os.remove(partial)


def known_mean(games):
    """The share won among the games with a result (None: cut short by a dead worker); nan if none."""
    known = [g for g in games if g is not None]
    return float(np.mean(known)) if known else float("nan")


def headline(rates):
    """eval_success: the first eval set's success, not a mean over sets. The held-out seeds; ALFWorld:
    valid_seen (in distribution, the paper's headline), or the first set --eval_sets names."""
    return next(iter(rates.values()))


def success_text(rates):
    """'0.953' for the held-out seeds; 'valid_seen 0.871, valid_unseen 0.802' for named sets."""
    sets = {name: r for name, r in rates.items() if "/" not in name}
    if list(sets) == ["held-out"]:
        return f"{sets['held-out']:.3f}"
    return ", ".join(f"{name} {r:.3f}" for name, r in sets.items())


def random_policy_key(cfg):
    """A hash of what the random policy's success depends on: the env, its arguments and the eval
    episodes. A checkpoint keeps the rates under it, so --resume does not play them again (ALFWorld's
    two splits, ~13,700 random steps, take minutes) unless the eval changed."""
    played = json.dumps([cfg.env, cfg.env_args, eval_plan(cfg)], sort_keys=True, default=str)
    return hashlib.sha256(played.encode()).hexdigest()[:16]


def random_policy_success(cfg, envs):
    """The same eval episodes played by a uniformly random admissible action -> {set: success}. A step
    whose env lists none (free-text answers) plays the empty action, a no-op (README, "Add an env")."""
    rng, rates = random.Random(0), {}
    for name, seeds, set_envs in each_set(cfg, envs):
        wins = []
        obs, infos = set_envs.reset(seeds)
        active = list(range(set_envs.n))
        while active:
            res = set_envs.step({i: rng.choice(infos[i]["admissible_actions"] or [""]) for i in active})
            for i, (o, r, term, trunc, info) in res.items():
                infos[i] = info
                if (term or trunc) and not info.get("worker_died"):
                    wins.append(bool(info.get("won")))
            active = [i for i in active if not (res[i][2] or res[i][3])]
        rates[name] = known_mean(wins)
    return rates


class RandomBaseline(threading.Thread):
    """The random policy's success on the eval episodes (rank 0), played once a run: the checkpoint
    keeps it under the eval's key (ALFWorld's two splits take minutes). The play runs in this thread
    beside the policy's build and, with envs in worker processes, the first iterations (see set_up);
    result() waits for it, before an eval (the same envs) or a save (the checkpoint keeps it)."""

    def __init__(self, cfg, meta, eval_envs, rank):
        super().__init__(daemon=True)  # daemon: a run that fails does not wait for the play to end
        self.cfg, self.eval_envs, self.error, self.seconds, self.shown = cfg, eval_envs, None, None, False
        self.key = random_policy_key(cfg) if rank == 0 else None
        self.kept = (meta or {}).get("random_policy", {}).get(self.key)
        self.rates = self.kept
        if rank == 0 and not self.kept:
            self.t0 = time.perf_counter()
            self.start()

    def run(self):
        try:
            self.rates = random_policy_success(self.cfg, self.eval_envs)
        except BaseException as e:  # raised again in main's thread, by result()
            self.error = e
        self.seconds = time.perf_counter() - self.t0

    def set_up(self, print0, t_set_up, engine):
        """Prints the set-up's seconds (t_set_up: when main started, built the envs, built the policy;
        engine: the one built, its start's note) and how the random play stands. Training goes on
        beside it where the envs run in worker processes; in-process envs (--env_workers 0) wait for
        it here, as their libraries' state may be shared with the play's (TextWorld's planner is not
        thread-safe)."""
        if not self.cfg.env_workers:
            self.result(print0)
        parts = [f"{k} {v:.1f}" for k, v in zip(("checks and envs", "model and engine"), np.diff(t_set_up))]
        parts[-1] += f" ({engine.started})" if engine.started else ""
        going = "kept in the checkpoint" if self.kept else "playing on beside the first iterations"
        if self.seconds is not None:
            going = f"played in {self.seconds:.1f} beside them"
        print0(f"set-up (s): {', '.join(parts)}; random policy {going}")
        if self.kept:
            self.result(print0)

    def result(self, print0):
        """Waits for the play -> (key, rates). Prints them the first time."""
        if self.ident is not None:
            self.join()
        if self.error is not None:
            raise self.error
        if not self.shown:
            self.shown = True
            print0(
                f"random policy on the eval episodes ({eval_what(self.cfg).split(',')[0]}): success "
                f"{self.rates and success_text(self.rates)}"
                f"{' (as played before the checkpoint)' * bool(self.kept)}"
                f"{'' if self.seconds is None else f' (played in {self.seconds:.1f} s)'}"
            )
        return self.key, self.rates

    def envs(self, print0):
        """The eval envs, once the play on them has ended."""
        self.result(print0)
        return self.eval_envs


def paired(a, b):
    """Two evals of the same games (lists of 0/1) -> (games only A won, games only B won, p): the exact
    two-sided sign test on the games they disagree on (McNemar's, exact). Games both won or both lost
    say nothing about which is better, so a paired test sees a difference that two independent
    success rates on the same games hide in their shared noise."""
    if len(a) != len(b):
        raise ValueError(f"the evals played {len(a)} and {len(b)} games: not the same set")
    only_a = sum(x > y for x, y in zip(a, b))
    only_b = sum(y > x for x, y in zip(a, b))
    n, k = only_a + only_b, min(only_a, only_b)
    p = min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n) if n else 1.0
    return only_a, only_b, p


def load_eval(path):
    """An eval.json (or the out dir that holds one) -> its dict; anything else is one line."""
    path = os.path.join(path, "eval.json") if os.path.isdir(path) else path
    try:
        ev = json.load(open(path))
        if not isinstance(ev.get("games"), dict) or not isinstance(ev.get("rates"), dict):
            raise ValueError("no games or rates: written by an older version, or not an eval")
        return ev
    except (OSError, ValueError, AttributeError) as e:
        sys.exit(f"error: {path}: {str(e).splitlines()[0][:200]}")


def complete(path):
    """Whether an eval.json (or the out dir that holds one) is there with every set of its plan
    played: an eval cut short keeps the sets it finished, marked "complete": false."""
    path = os.path.join(path, "eval.json") if os.path.isdir(path) else path
    try:
        return json.load(open(path)).get("complete", True) is not False  # older files: whole
    except (OSError, ValueError, AttributeError):
        return False


def compare(path_a, path_b):
    """The eval.json of two runs (or their out dirs) -> a markdown table, one row per set both played
    (and per task type in it, where both evals list the same games' types). A game that either eval
    has no result for (null: a dead env worker) is left out of that row. Evals of other envs, or of a
    set played on other seeds, are not the same games: ValueError (an eval.json from before env and
    seeds were written is taken as it is). Other --env_args are refused where they change the games
    (size, walls, max_steps, a split, ...), and shown in the first line where they do not (SAME_GAMES:
    a reward term, progress=0, or an anchor, pool_bumps=1, changes the run, not the games)."""
    a, b = (load_eval(p) for p in (path_a, path_b))
    for path, ev in ((path_a, a), (path_b, b)):
        if ev.get("complete") is False:  # its missing sets would drop out of the table unseen
            raise ValueError(f"{path}: an eval cut short (only {', '.join(ev['games'])}): evaluate it again")
    if a.get("env", b.get("env")) != b.get("env", a.get("env")):
        raise ValueError(f"the evals are of {a['env']} and {b['env']}: not the same games")
    for name in set(a.get("seeds", {})) & set(b.get("seeds", {})):
        if a["seeds"][name] != b["seeds"][name]:
            raise ValueError(
                f"{name}: the evals played other seeds ({len(a['seeds'][name])} and "
                f"{len(b['seeds'][name])} games): not the same set"
            )
    args = ""
    if {"env_args"} <= set(a) & set(b) and a["env_args"] != b["env_args"]:
        try:
            ka, kb = (env_kwargs(a["env"], ev["env_args"]) for ev in (a, b))
        except (KeyError, ValueError, TypeError):  # no env named, or no longer its arguments: the words
            ka, kb = ({"env_args": ev["env_args"]} for ev in (a, b))
        if changed := sorted(
            k for k in ka.keys() | kb.keys() if ka.get(k) != kb.get(k) and k not in SAME_GAMES
        ):
            raise ValueError(f"the evals' env_args {a['env_args']!r} and {b['env_args']!r} differ in "
                             f"{', '.join(changed)}: not the same games")  # fmt: skip
        args = f"; env_args {a['env_args']!r} and {b['env_args']!r}"
    rows = [
        "| set | games | A success | B success | only A won | only B won | paired p |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in a["games"]:
        if name not in b["games"]:
            continue
        if len(a["games"][name]) != len(b["games"][name]):
            raise ValueError(
                f"{name}: the evals played {len(a['games'][name])} and {len(b['games'][name])} games: "
                "not the same set"
            )
        subsets = {name: range(len(a["games"][name]))}  # a game either eval has no result for is left out
        kinds = a.get("types", {}).get(name)
        if kinds and kinds == b.get("types", {}).get(name):  # then a row per task type as well
            subsets |= {f"{name}/{t}": [i for i, k in enumerate(kinds) if k == t] for t in sorted(set(kinds))}
        for label, idx in subsets.items():
            both = [i for i in idx if a["games"][name][i] is not None and b["games"][name][i] is not None]
            ga, gb = [a["games"][name][i] for i in both], [b["games"][name][i] for i in both]
            only_a, only_b, p = paired(ga, gb)
            rows.append(
                f"| {label} | {len(ga)} | {known_mean(ga):.3f} | {known_mean(gb):.3f} | "
                f"{only_a} | {only_b} | {p:.3f} |"
            )
    if len(rows) == 2:
        raise ValueError(f"the evals share no set ({', '.join(a['games'])} and {', '.join(b['games'])})")
    head = f"A = {path_a} (iteration {a['iteration']}), B = {path_b} (iteration {b['iteration']}){args}"
    return "\n".join([head, *rows])


USAGE = "usage: python -m evaluate RUN_A RUN_B   (out dirs, or their eval.json files)"


def main(argv=None):
    """python -m evaluate RUN_A RUN_B: two evals of the same games, game by game (compare())."""
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        print(USAGE)
        return
    if len(argv) != 2:
        sys.exit(USAGE)
    try:
        print(compare(*argv))
    except ValueError as e:  # paired(): not the same games
        sys.exit(f"error: {e}")
    except (KeyError, TypeError, AttributeError, IndexError) as e:  # a hand-made eval.json
        sys.exit(f"error: an eval.json is not as evaluate.py writes it ({type(e).__name__}: {e})")


if __name__ == "__main__":
    main()
