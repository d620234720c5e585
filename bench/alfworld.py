"""ALFWorld benchmarks: env throughput with worker processes, and prompt length per step by memory.

    python -m bench.alfworld                      # both, markdown tables on stdout
    python -m bench.alfworld --workers 1 2 4 8 16 --tokenizer PATH_OR_NAME
    python -m bench.alfworld --speedup_ab 1 --rounds 20   # envs.alfworld's speed-ups, A/B

1. 16 groups x 8 envs (the paper's batch) on valid_unseen games, in 1, 2, 4, ... worker processes:
   resets/s (one reset of all 128 envs: 16 games loaded 8 times each; it includes the workers'
   start-up) and steps/s (all 128 envs step `--rounds` times with random admissible actions).
2. Prompt tokens of each step against the step index for window memory (k = 2, the paper's) and
   full history (the concatenation baseline), on real episodes: `--episodes` valid_unseen games
   played 50 steps by a random admissible policy, each step's prompt built by prompts/alfworld.py
   and counted with the tokenizer's chat template (or whitespace words when there is no tokenizer).
"""

import argparse
import random
import time

from envs import GroupedEnvs
from envs.alfworld import ALFWorld
from memory import make_memory
from prompts import alfworld as prompt
from rollout import render_prompts


def env_throughput(workers, n_groups=16, group_size=8, rounds=5, split="valid_unseen"):
    envs = GroupedEnvs("alfworld", n_groups, group_size, workers=workers, split=split)
    t0 = time.perf_counter()
    _, infos = envs.reset(list(range(n_groups)))
    t_reset = time.perf_counter() - t0
    rng, t_step = random.Random(0), 0.0
    for _ in range(rounds):
        actions = {i: rng.choice(info["admissible_actions"]) for i, info in enumerate(infos)}
        t0 = time.perf_counter()
        res = envs.step(actions)
        t_step += time.perf_counter() - t0
        infos = [res[i][4] for i in range(envs.n)]
    envs.close()
    return envs.n / t_reset, envs.n * rounds / t_step


def prompt_lengths(episodes, tokenizer=None, steps=50):
    """-> {memory name: list over step index of the mean prompt length}."""
    count = (
        (lambda m: len(render_prompts(tokenizer, [m])[0]))  # as the rollout does it
        if tokenizer
        else (lambda m: len(m[-1]["content"].split()))
    )
    env, rng = ALFWorld("valid_unseen", max_steps=steps), random.Random(0)
    lengths = {"window": [[] for _ in range(steps)], "full": [[] for _ in range(steps)]}
    for seed in range(episodes):
        obs, info = env.reset(seed)
        mems = {name: make_memory(name, 2) for name in lengths}
        for mem in mems.values():
            mem.reset(info["task"])
        for step in range(steps):
            for name, mem in mems.items():
                msgs = prompt.build(info["task"], mem.text(), obs, info["admissible_actions"], step)
                lengths[name][step].append(count(msgs))
            action = rng.choice(info["admissible_actions"])
            new_obs, reward, term, trunc, info = env.step(action)
            for mem in mems.values():
                mem.add(obs, action, reward)
            obs = new_obs
            if term or trunc:
                break
    return {name: [sum(x) / len(x) for x in per_step if x] for name, per_step in lengths.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--rounds", type=int, default=5, help="steps of all 128 envs per worker count")
    ap.add_argument("--episodes", type=int, default=8, help="games for the prompt-length table")
    ap.add_argument("--tokenizer", default=None, help="HF tokenizer name/path; default: whitespace words")
    ap.add_argument("--skip", choices=["envs", "prompts"], default=None)
    ap.add_argument(
        "--speedup_ab",
        type=int,
        default=0,
        help="1: only the A/B of envs.alfworld's SPEEDUPS: 4 x 4 envs in-process, without, "
        "adding one at a time, without again",
    )
    args = ap.parse_args()
    if args.speedup_ab:
        import envs.alfworld as alf

        print(
            "| envs.alfworld's speed-ups (in-process, 4 x 4 envs) | resets/s (16 envs) "
            "| steps/s (16 envs) |\n"
            "|---|---|---|"
        )
        names = list(alf.SPEEDUPS)
        configs = [names[:k] for k in range(len(names) + 1)] + [[]]  # none, adding one at a time, none again
        for k, on in enumerate(configs):
            label = (
                (" + ".join(on) + (" (the default)" if on == names else ""))
                if on
                else "none (TextWorld's own)" + (", again" if k else "")
            )
            alf.use_speedups(on)
            resets, steps = env_throughput(0, n_groups=4, group_size=4, rounds=args.rounds)
            print(f"| {label} | {resets:.1f} | {steps:.1f} |", flush=True)
        alf.use_speedups()
        return
    if args.skip != "envs":
        print("| env workers | resets/s (128 envs) | steps/s (128 envs) |\n|---|---|---|", flush=True)
        for w in args.workers:
            resets, steps = env_throughput(w, rounds=args.rounds)
            print(f"| {w} | {resets:.1f} | {steps:.1f} |", flush=True)
    if args.skip != "prompts":
        tok = None
        if args.tokenizer:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(args.tokenizer)
        unit = f"tokens ({args.tokenizer})" if tok else "whitespace words"
        lengths = prompt_lengths(args.episodes, tok)
        print(f"\nprompt length in {unit}, mean over {args.episodes} valid_unseen games, random policy")
        print("| step | window (k=2) | full history |\n|---|---|---|")
        for s in [0, 1, 2, 5, 10, 20, 30, 40, 49]:
            if s < len(lengths["window"]):
                print(f"| {s} | {lengths['window'][s]:.0f} | {lengths['full'][s]:.0f} |")


if __name__ == "__main__":
    main()
