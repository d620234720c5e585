"""Where GiGPO's step advantage changes the credit: measured on the training episodes of runs.

    python -m bench.credit out/credit/gigpo-s0 out/credit/grpo-s0 ... [--iterations 1 30] [--size 5]

Reads each run's episodes.jsonl (whole training groups, `--log_groups N`), and for the same samples
puts the two algorithms' advantages side by side: GRPO's A = A^E, and GiGPO's A = A^E + omega A^S,
A^S recomputed from the logged step returns and step groups (so a GRPO run's episodes show what
GiGPO would have made of them, and the reverse). Runs named NAME-sSEED are pooled by NAME. Prints:

  * step groups: share of samples in a step group of size 1 (A^S = 0 there), the share of step
    groups of size 1 (the paper's statistic), and the mean step-group size a sample sits in; below
    the table, the most common anchor text and its share of the samples (ALFWorld's "Nothing
    happens.", one anchor for whatever state an inert action was taken in);
  * sign disagreement: among samples where both A^E and A^S are non-zero, the share whose signs
    differ (GiGPO tells those steps the opposite of what their episode says); and the share of
    samples with A^E = 0 (their group's episodes all scored alike: GRPO learns nothing from them)
    but A^S != 0 (GiGPO still does); and over all samples, the share where GiGPO's A and GRPO's
    differ in sign (GRPO's 0 included), and the cosine of the two advantage vectors;
  * by the outcome of each episode group (all lost, mixed, all won): how many groups, the share of
    the samples in them, and the share of GiGPO's step credit (the sum of abs(A^S)) they hold. In an
    all-lost group of a sparse-reward env only the invalid-action penalty moves A^S; in an all-won
    group A^E = 0 and A^S alone ranks the steps (by their discounted returns);
  * the decisive steps of the key-and-door game (envs/keydoor.py): the step that picks up the key,
    and every step towards the current target (`keydoor.good_moves`) against the valid steps that are
    not: the mean advantage each algorithm gives them, in won and in lost episodes, and the
    separation = mean A of steps towards the target - mean A of the other valid steps.

For other envs the first two parts apply (the decisive-step part needs keydoor's observations as
anchors, so under keydoor's `pool_bumps=1` it leaves out the steps anchored on "Nothing happens.").
"""

import argparse
import json
import os
import re
from collections import Counter, defaultdict

import numpy as np

import gigpo


def load(out_dir, first, last):
    """Training episodes of iterations [first, last], grouped: (iteration, group) -> [episode]."""
    groups = defaultdict(list)
    with open(os.path.join(out_dir, "episodes.jsonl")) as f:
        for line in f:
            ep = json.loads(line)
            if ep["split"] == "train" and first <= ep["iteration"] <= last:
                groups[(ep["iteration"], ep["group"])].append(ep)
    return groups


def step_rows(groups, norm, omega, size):
    """One row per step sample: A^E, A^S (recomputed), won, the key pickup flag, towards-target flag."""
    from envs.keydoor import good_moves

    rows = []
    for eps in groups.values():
        outcome = group_outcome(eps)
        steps = [(ep, k, s) for ep in eps for k, s in enumerate(ep["steps"])]
        a_s = gigpo.step_advantage(
            [s["step_return"] for _, _, s in steps], [s["step_group"] for _, _, s in steps], norm
        )
        for (ep, k, s), step_adv in zip(steps, a_s):
            nxt = ep["steps"][k + 1]["anchor"] if k + 1 < len(ep["steps"]) else None
            keydoor = re.match(r"at \(\d+, \d+\)", s["anchor"] or "") and " door (" in s["anchor"]
            rows.append(
                {
                    "a_e": s["adv_episode"],
                    "a_s": omega * step_adv,
                    "size": s["step_group_size"],
                    "anchor": s["anchor"],
                    "group": s["step_group"],
                    "won": ep["return"] > 0,
                    "valid": s["valid"],
                    "outcome": outcome,
                    "pickup": bool(keydoor and " key (" in s["anchor"] and nxt and "have key" in nxt),
                    "toward": bool(keydoor and s["valid"] and s["action"] in good_moves(s["anchor"], size)),
                    "keydoor": bool(keydoor),
                }
            )
    return rows


OUTCOMES = ("lost", "mixed", "won")  # a sample's episode group: none, some, or all of its episodes won


def group_outcome(eps):
    wins = sum(ep["return"] > 0 for ep in eps)
    return "lost" if wins == 0 else "won" if wins == len(eps) else "mixed"


def report(name, rows):
    a_e = np.array([r["a_e"] for r in rows])
    a_s = np.array([r["a_s"] for r in rows])
    size = np.array([r["size"] for r in rows])
    both = (a_e != 0) & (a_s != 0)
    out = {
        "name": name,
        "samples": len(rows),
        "singleton_samples": float(np.mean(size == 1)),
        "singleton_groups": float(np.sum(size == 1) / np.sum(1 / size)),  # a group of s samples adds s x 1/s
        "mean_group_size": float(np.mean(size)),
        "sign_disagree": float(np.mean(np.sign(a_e[both]) != np.sign(a_s[both])))
        if both.any()
        else float("nan"),
        "step_only": float(np.mean((a_e == 0) & (a_s != 0))),
        "flips": float(np.mean(np.sign(a_e + a_s) != np.sign(a_e))),
        "cosine": float((a_e + a_s) @ a_e / (np.linalg.norm(a_e + a_s) * np.linalg.norm(a_e) or 1.0)),
    }
    outcome = np.array([r["outcome"] for r in rows])
    for o in OUTCOMES:  # where the samples are, and where A^S (GiGPO's step credit) puts its weight
        out[f"{o}_samples"] = float(np.mean(outcome == o))
        out[f"{o}_step_mass"] = float(np.abs(a_s[outcome == o]).sum() / (np.abs(a_s).sum() or 1.0))
    out["top_anchor"], count = Counter(r["anchor"] for r in rows).most_common(1)[0]
    out["top_anchor_share"] = count / len(rows)
    adv = {"grpo": a_e, "gigpo": a_e + a_s}
    if any(r["keydoor"] for r in rows):
        won = np.array([r["won"] for r in rows])
        pick = np.array([r["pickup"] for r in rows])
        toward = np.array([r["toward"] for r in rows])
        other = np.array([r["valid"] and r["keydoor"] and not r["toward"] for r in rows])
        mean = lambda x, m: float(x[m].mean()) if m.any() else float("nan")  # noqa: E731
        for algo, a in adv.items():
            out[f"{algo}_pickup_won"], out[f"{algo}_pickup_lost"] = mean(a, pick & won), mean(a, pick & ~won)
            out[f"{algo}_sep_won"] = mean(a, toward & won) - mean(a, other & won)
            out[f"{algo}_sep_lost"] = mean(a, toward & ~won) - mean(a, other & ~won)
            out[f"{algo}_sep_all"] = mean(a, toward) - mean(a, other)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument(
        "runs", nargs="+", help="out dirs of train.py runs (episodes.jsonl with --log_groups >= 1)"
    )
    ap.add_argument("--iterations", type=int, nargs=2, default=[1, 10**9], metavar=("FIRST", "LAST"))
    ap.add_argument("--norm", default="mean_norm", help="the runs' --norm (A^S is recomputed with it)")
    ap.add_argument("--omega", type=float, default=1.0, help="the runs' omega (train.OMEGA, the paper's 1.0)")
    ap.add_argument(
        "--size", type=int, default=5, help="keydoor's grid size (for the steps towards the target)"
    )
    args = ap.parse_args(argv)
    pooled, n_groups = defaultdict(list), defaultdict(Counter)
    for run in args.runs:
        if not os.path.exists(os.path.join(run, "episodes.jsonl")):
            raise SystemExit(
                f"bench.credit: {run}/episodes.jsonl not found (run train.py with --log_groups >= 1)"
            )
        name = re.sub(r"-s\d+$", "", os.path.basename(os.path.normpath(run)))
        groups = load(run, *args.iterations)
        n_groups[name].update(group_outcome(eps) for eps in groups.values())
        pooled[name] += step_rows(groups, args.norm, args.omega, args.size)
    results = [
        report(name, rows) | {f"{o}_groups": n_groups[name][o] for o in OUTCOMES}
        for name, rows in pooled.items()
        if rows
    ]
    print(
        f"training episodes of iterations {args.iterations[0]}-{args.iterations[1]}; A^S recomputed "
        f"(norm {args.norm}, omega {args.omega}); GRPO's A = A^E, GiGPO's A = A^E + A^S, "
        "on the same samples\n"
    )
    print(
        "| runs | samples | in a singleton step group | singleton step groups | mean step-group size "
        "| sign(A^S) != sign(A^E) | A^E = 0, A^S != 0 | sign(GiGPO's A) != sign(GRPO's) | cosine of the two |"
        "\n|---|---|---|---|---|---|---|---|---|"
    )
    for r in results:
        print(
            f"| {r['name']} | {r['samples']} | {r['singleton_samples']:.3f} | {r['singleton_groups']:.3f} | "
            f"{r['mean_group_size']:.1f} | {r['sign_disagree']:.3f} | {r['step_only']:.3f} | "
            f"{r['flips']:.3f} | {r['cosine']:.3f} |"
        )
    print(
        "\nmost common anchor: "
        + "; ".join(
            f"{r['name']} {str(r['top_anchor'])[:40]!r} on {r['top_anchor_share']:.3f} of samples"
            for r in results
        )
    )
    print(
        "\nby the outcome of the sample's episode group (GRPO's A^E is 0 where all its episodes tie):\n\n"
        "| runs | groups: all lost / mixed / all won | samples: all lost | mixed | all won "
        "| share of sum abs(A^S): all lost | mixed | all won |\n|---|---|---|---|---|---|---|---|"
    )
    for r in results:
        print(
            f"| {r['name']} | "
            + " / ".join(str(r[f"{o}_groups"]) for o in OUTCOMES)
            + " | "
            + " | ".join(f"{r[f'{o}_{k}']:.3f}" for k in ("samples", "step_mass") for o in OUTCOMES)
            + " |"
        )
    if any("grpo_sep_all" in r for r in results):
        print(
            "\n| runs | advantage | key pickup, won | key pickup, lost | towards - other, won "
            "| towards - other, lost | towards - other, all |\n|---|---|---|---|---|---|---|"
        )
        for r in results:
            for algo in ("grpo", "gigpo"):
                cells = [
                    r[f"{algo}_{k}"] for k in ("pickup_won", "pickup_lost", "sep_won", "sep_lost", "sep_all")
                ]
                print(
                    f"| {r['name']} | {algo} | "
                    + " | ".join("-" if np.isnan(x) else f"{x:+.3f}" for x in cells)
                    + " |"
                )
    return results


if __name__ == "__main__":
    main()
