"""One ALFWorld replicate in a fixed time: expert data, a clone, GiGPO and GRPO from it side by side on
one GPU, both splits evaluated, each paired game by game against the clone; and the pooled report.

    python -m bench.pair --model SMOLLM2 --out out/pair1 --minutes 28      # one replicate, one GPU
    python -m bench.pair --report out/pair1 out/pair2 out/pair3            # pool the replicates

A replicate (each stage is skipped where its output is already there, so a rerun goes on):
  1. collect  the expert on train games 0..--games-1 (bench.bc --collect, over --procs processes)
              -> OUT/bc.jsonl
  2. clone    bench.bc --train from --model, --epochs -> OUT/clone/
  3. eval     the clone on valid_seen and valid_unseen (train.py --eval_only 1) -> OUT/clone_eval/
  4. arms     train.py --algo gigpo and --algo grpo from the clone at once, sharing the GPU, with the
              --time_limit left after 1-3 (less the final evals, timed by the clone's) -> OUT/gigpo/,
              OUT/grpo/ (each checkpointed at its final eval: ~1.6 GB for SmolLM2 with its AdamW state)
  5. compare  evaluate.compare for clone -> gigpo, clone -> grpo, gigpo -> grpo -> OUT/pair.md
What a lost host costs: the stage it was in. Small files to copy off as they appear: bc.jsonl (a
few MB), clone_eval/eval.json, the arms' metrics.jsonl (one line an iteration) and eval.json.

Flags it does not know go to train.py, for the clone's eval and both arms (after ARM_FLAGS below:
theirs win). The arms run the ALFWorld preset (train.PRESETS: 16 x 8 envs, 50 steps, window memory,
KL 0.01, entropy 0.001) with the settings of docs/envs.md's RL from the clone.
--report: per replicate, each split's success for the clone and both arms and the arms' gains;
pooled over replicates, the exact sign test game by game (every replicate's games in one list) and
across replicates (one gain difference per replicate); the same by task type, games pooled.
"""

import argparse
import os
import subprocess
import sys
import time

import evaluate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # stages run from here
ARMS = ("gigpo", "grpo")
# the arms' (and the clone eval's) settings: docs/envs.md, "RL from the tagged clone"; two runs share
# one GPU, so each engine has a fixed cache and 8 env workers, and the compiled update 32768-token
# micro-batches (65536 took 39 GiB for this model: two would not fit an 80 GB card)
ARM_FLAGS = (
    "--max_response_tokens 64 --lr 1e-5 --engine vllm --gpu_memory_utilization 0 --kv_cache_mb 4096 "
    "--env_workers 8 --micro_batch_tokens 32768 --eval_every 100000"
).split()


def run(cmd, log, wait=True):
    """A stage's command, its output into log; a failure is one line that names the log."""
    f = open(log, "a")
    p = subprocess.Popen([sys.executable, *cmd], stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
    if not wait:
        return p
    if p.wait():
        sys.exit(f"error: bench.pair: {' '.join(cmd[:3])} ... failed (exit {p.returncode}): see {log}")
    return p


def replicate(args, extra):
    out = args.out
    os.makedirs(out, exist_ok=True)
    t0, log = time.time(), os.path.join(out, "pair.log")
    data = os.path.join(out, "bc.jsonl")
    if not os.path.exists(data):  # 1. the expert's steps, games split evenly over the processes
        k = max(1, min(args.procs, args.games))
        spans = [(args.games * i // k, args.games * (i + 1) // k) for i in range(k)]
        parts = [f"{data}.{i}" for i in range(k)]
        procs = [
            run(
                ["-m", "bench.bc", "--collect", part, "--first", str(a), "--games", str(b - a)],
                log,
                wait=False,
            )
            for part, (a, b) in zip(parts, spans)
        ]
        if any(p.wait() for p in procs):
            sys.exit(f"error: bench.pair: the expert's collection failed: see {log}")
        with open(data + ".tmp", "w") as f:
            for part in parts:
                f.write(open(part).read())
        os.replace(data + ".tmp", data)
        for part in parts:
            os.remove(part)
        n = sum(1 for _ in open(data))
        print(f"collect: {n} expert steps of {args.games} games, {time.time() - t0:.0f} s")
    clone = os.path.join(out, "clone")
    if not os.path.exists(os.path.join(clone, "config.json")):  # 2. the clone
        cmd = ["-m", "bench.bc", "--train", data, "--model", args.model, "--out", clone]
        run([*cmd, "--epochs", str(args.epochs), *args.bc_flags.split()], log)
        print(f"clone: {clone}, {time.time() - t0:.0f} s in")
    evals = {"clone": os.path.join(out, "clone_eval")}
    t_eval = time.time()
    if not os.path.exists(os.path.join(evals["clone"], "eval.json")):  # 3. the clone on both splits
        cmd = ["train.py", "--env", "alfworld", "--eval_only", "1", "--model", clone]
        run([*cmd, "--out_dir", evals["clone"], *ARM_FLAGS, *extra], log)
        print(f"clone eval: {rates(evals['clone'])}, {time.time() - t_eval:.0f} s")
    t_eval = time.time() - t_eval
    # 4. the arms at once; their time: what is left, less their final evals (two at once: 2x the clone's)
    minutes = (
        (args.minutes * 60 - (time.time() - t0) - 2 * t_eval - args.start_up) / 60 if args.minutes else 0
    )
    if args.minutes and minutes < 1:
        sys.exit(f"error: bench.pair: {minutes:.1f} min left for the arms: raise --minutes")
    procs = {}
    for arm in args.arms:
        evals[arm] = os.path.join(out, arm)
        if os.path.exists(os.path.join(evals[arm], "eval.json")):
            continue
        resume = ["--resume", "1"] if os.path.exists(os.path.join(evals[arm], "ckpt")) else []
        if os.path.exists(evals[arm]) and not resume:  # an arm cut short before its checkpoint: kept aside
            kept = next(
                f"{evals[arm]}.cut{k}" for k in range(1, 1000) if not os.path.exists(f"{evals[arm]}.cut{k}")
            )
            os.rename(evals[arm], kept)
            print(f"{arm}: a run cut short before its checkpoint is kept in {kept}; starting it again")
        cmd = ["train.py", "--env", "alfworld", "--model", clone, "--algo", arm, "--out_dir", evals[arm]]
        limit = ["--time_limit", f"{minutes:.2f}"] if minutes else []
        procs[arm] = run(
            [*cmd, *ARM_FLAGS, *limit, *resume, *extra], os.path.join(out, f"{arm}.log"), wait=False
        )
    print(f"arms {', '.join(procs) or '(done before)'}: {minutes:.1f} min each, logs {out}/ARM.log")
    failed = [arm for arm, p in procs.items() if p.wait()]
    if failed:
        sys.exit(f"error: bench.pair: {', '.join(failed)} failed: see {out}/{failed[0]}.log")
    # 5. paired, game by game
    pairs = [("clone", a) for a in args.arms] + [tuple(args.arms)] * (len(args.arms) == 2)
    text = "\n\n".join(evaluate.compare(evals[a], evals[b]) for a, b in pairs)
    open(os.path.join(out, "pair.md"), "w").write(text + "\n")
    print(text)
    print(f"bench.pair: {out} in {(time.time() - t0) / 60:.1f} min")


def rates(path):
    ev = evaluate.load_eval(path)
    return ", ".join(f"{k} {v:.3f}" for k, v in ev["rates"].items() if "/" not in k)


def table(header, rows):
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + [
        "| " + " | ".join(map(str, r)) + " |" for r in rows
    ]


def report(dirs, arms=ARMS):
    """The replicates in dirs (each with clone_eval/ and an out dir per arm) -> markdown tables."""
    runs = ("clone_eval", *arms)
    evs = [{k: evaluate.load_eval(os.path.join(d, k)) for k in runs} for d in dirs]
    splits = [
        s for s in evs[0]["clone_eval"]["games"] if all(s in ev[k]["games"] for ev in evs for k in runs)
    ]
    pairs = [("clone_eval", a) for a in arms] + [tuple(arms)] * (len(arms) == 2)
    gains, per_rep = {s: {a: [] for a in arms} for s in splits}, []
    for d, ev in zip(dirs, evs):
        for s in splits:
            r = {k: ev[k]["rates"][s] for k in runs}
            for a in arms:
                gains[s][a].append(r[a] - r["clone_eval"])
            its = "/".join(str(ev[a]["iteration"]) for a in arms)
            per_rep.append(
                [d, s, its, *(f"{r[k]:.3f}" for k in runs), *(f"{r[a] - r['clone_eval']:+.3f}" for a in arms)]
            )
    pooled = []
    for s in splits:
        for t in [None, *sorted(set(evs[0]["clone_eval"].get("types", {}).get(s) or []))]:
            games = {k: [] for k in runs}
            for ev in evs:  # every replicate's games of this split (and task type) in one list per run
                kinds = ev["clone_eval"].get("types", {}).get(s) or []
                for i in range(len(ev["clone_eval"]["games"][s])):
                    known = all(ev[k]["games"][s][i] is not None for k in runs)
                    if known and (t is None or kinds[i] == t):
                        for k in runs:
                            games[k].append(ev[k]["games"][s][i])
            cells = ["{} / {}, p {:.3f}".format(*evaluate.paired(games[y], games[x])) for x, y in pairs]
            pooled.append([s if t is None else f"{s}/{t}", len(games["clone_eval"]), *cells])
    across = []  # one gain difference per replicate and split
    for s in splits[: len(splits) * (len(arms) == 2)]:
        above, below, p = evaluate.paired(gains[s][arms[0]], gains[s][arms[1]])
        across.append(
            f"{s}: {arms[0]}'s gain above {arms[1]}'s in {above} of {len(dirs)} replicates, below in "
            f"{below}, sign test p {p:.3f}"
        )
    head = ["replicate", "split", "iterations", "clone", *arms, *(f"{a} gain" for a in arms)]
    lines = table(head, per_rep) + [
        "",
        "Pooled game by game (B vs A: games only B won / only A won, exact p):",
    ]
    lines += table(["split", "games", *(f"{y} vs {x}" for x, y in pairs)], pooled)
    return "\n".join(lines + [""] + across)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="the HF folder to clone from (python smollm2.py DIR)")
    ap.add_argument("--out", help="the replicate's folder")
    ap.add_argument("--games", type=int, default=300, help="expert train games 0..N-1")
    ap.add_argument("--procs", type=int, default=12, help="processes for the expert's collection")
    ap.add_argument("--epochs", type=int, default=1, help="bench.bc --train --epochs")
    ap.add_argument("--bc_flags", default="", help="more bench.bc --train flags, one string")
    ap.add_argument(
        "--minutes", type=float, default=0, help="the replicate's whole time; 0 = the arms' --iterations"
    )
    ap.add_argument("--start_up", type=float, default=120, help="seconds an arm takes to start (compile)")
    ap.add_argument("--arms", nargs="+", default=list(ARMS), help="train.py --algo names")
    ap.add_argument("--report", nargs="+", metavar="OUT", help="pool these replicates' folders instead")
    args, extra = ap.parse_known_args(argv)
    if args.report:
        text = report(args.report, args.arms)
        print(text)
        return text
    if not args.model or not args.out:
        sys.exit("error: bench.pair: give --model DIR and --out DIR (or --report OUT ...)")
    if args.games < 1 or args.procs < 1 or args.epochs < 1 or args.minutes < 0:
        sys.exit("error: bench.pair: --games, --procs and --epochs must be >= 1, --minutes >= 0")
    args.out, args.model = os.path.abspath(args.out), os.path.abspath(args.model)
    replicate(args, extra)


if __name__ == "__main__":
    main()
