"""What a replicate's folder says, read back: the arms' final evals, their training success and cost
per iteration (OUT/pair.md's last table), and the report that pools replicates:

    python -m bench.pair --report out/pair1 out/pair2 out/pair3

per replicate, each split's success for the clone and both arms and the arms' gains; pooled over
replicates, the exact sign test game by game (every replicate's games in one list) and across
replicates (one gain difference per replicate); the same by task type, games pooled. bench/pair.py
makes the folders; nothing here runs a stage.
"""

import os
import statistics
import sys

import checkpoint
import evaluate
import plots

BLOCK = 15  # iterations a block of the training-success trajectory in OUT/pair.md (75 = 5 blocks)


def arm_eval(out, arm):
    """The folder of an arm's final eval: OUT/ARM_eval where bench.pair evaluated its export (a run
    stopped by --time_limit is saved, not evaluated), else the run's own (at --iterations)."""
    made = os.path.join(out, f"{arm}_eval")
    return made if evaluate.complete(made) else os.path.join(out, arm)


def saved_iteration(out_dir):
    """The iteration of a run's checkpoint (0: none)."""
    return (checkpoint.saved(out_dir) or (None, 0))[1]


def rates(path):
    ev = evaluate.load_eval(path)
    return ", ".join(f"{k} {v:.3f}" for k, v in ev["rates"].items() if "/" not in k)


def table(header, rows):
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + [
        "| " + " | ".join(map(str, r)) + " |" for r in rows
    ]


def trajectory(out, arms, block=BLOCK):
    """The arms' training success (episodes won at T = 1, per iteration, from ARM/metrics.jsonl) as
    means over blocks of iterations: how a run moved between its final evals (a long pair's stops
    are saved, not evaluated). Descriptive: no test is run on it."""
    lines = {}
    for arm in arms:
        path = os.path.join(out, arm, "metrics.jsonl")  # a line a crash cut short is skipped
        lines[arm] = list(plots.read_jsonl(path)) if os.path.exists(path) else []
    success = {arm: [m["success"] for m in ms] for arm, ms in lines.items()}
    n = max(map(len, success.values()))
    if not n:
        return ""
    spans = [(i + 1, min(i + block, n)) for i in range(0, n, block)]
    rows = [
        [arm, *(f"{sum(s[a - 1 : b]) / len(s[a - 1 : b]):.3f}" if len(s) >= b else "-" for a, b in spans)]
        for arm, s in success.items()
    ]
    head = ["training success (T = 1)", *(f"iterations {a}-{b}" for a, b in spans)]
    return "\n".join(table(head, rows) + ["", *cost(lines)])


def cost(lines):
    """What each arm's iterations cost: median seconds of an iteration and of its update after the
    first (compile's warm-up), and the peaks of GPU memory torch reserved and used (on a GPU)."""

    def show(ms, key, how):
        values = [m[key] for m in ms if m.get(key) is not None]
        return f"{how(values):.1f}" if values else "-"

    median = statistics.median
    rows = [
        [arm, show(ms[1:], "time_iteration", median), show(ms[1:], "time_update", median),
         show(ms, "gpu_mem_gib", max), show(ms, "gpu_alloc_gib", max)]
        for arm, ms in lines.items()
    ]  # fmt: skip
    return table(["arm", "iteration s", "update s", "gpu_mem_gib", "gpu_alloc_gib"], rows)


def report(dirs, arms):
    """The replicates in dirs (each with clone_eval/ and an out dir per arm) -> markdown tables."""
    runs = ("clone_eval", *arms)
    where = lambda d, k: arm_eval(d, k) if k in arms else os.path.join(d, k)  # noqa: E731
    for d in dirs:
        if not os.path.isdir(d):
            sys.exit(f"error: bench.pair --report: {d}: no such folder (give replicates' --out folders)")
    for d, k in ((d, k) for d in dirs for k in runs):
        if not evaluate.complete(where(d, k)):
            sys.exit(
                f"error: bench.pair --report: {d} has no whole final eval of {k} ({where(d, k)}/eval.json): "
                "its replicate has not ended; its own command goes on from where it stopped"
            )
    evs = [{k: evaluate.load_eval(where(d, k)) for k in runs} for d in dirs]
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
            its = "/".join(str(ev[a]["iteration"] or saved_iteration(os.path.join(d, a))) for a in arms)
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
        floor = 0.5 ** (len(dirs) - 1)  # the smallest two-sided p of a sign test on this many
        note = f" (its smallest possible p here: {floor:.3f})" if floor >= 0.05 else ""
        across.append(
            f"{s}: {arms[0]}'s gain above {arms[1]}'s in {above} of {len(dirs)} replicates, below in "
            f"{below}, sign test p {p:.3f}{note}"
        )
    head = ["replicate", "split", "iterations", "clone", *arms, *(f"{a} gain" for a in arms)]
    lines = table(head, per_rep) + [
        "",
        "Pooled game by game (B vs A: games only B won / only A won, exact p):",
    ]
    lines += table(["split", "games", *(f"{y} vs {x}" for x, y in pairs)], pooled)
    moved = [f"{d}:\n{t}" for d in dirs if (t := trajectory(d, arms))]
    return "\n".join(lines + [""] + across + [""] + moved)
