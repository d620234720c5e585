"""Seed sweeps: run train.py for several named configs x seeds, in parallel processes, and print a
markdown table (success, iterations and wall time to reach a bar, final held-out success).

    python -m bench.sweep --seeds 0 1 2 3 4 --parallel 2 --run gigpo="--algo gigpo" --run grpo="--algo grpo"

Each run gets `--threads` torch threads and its own out dir under --out, OUT/NAME-sSEED (so names are
distinct, without '/', and a --run sets neither --seed nor --out_dir); its metrics.jsonl is read
back. An --out that already holds one of those run dirs is refused (train.py would refuse each run):
`--report` summarises them, a new --out runs again. Runs that fail or end without a held-out eval
are named in the last line, with the first one's last log line (train.py's error), which exits 1;
configs with such runs are not compared. Wall times are those of the machine and the parallelism
the command ran with: compare configs only within one sweep.

Below the table, the first config is compared with every other one, their seeds as two samples: the
difference of mean final held-out success (first - other) with a 95% bootstrap interval (10,000
resamples of each config's seeds), and a two-sided Mann-Whitney U test on the finals and on the
iterations to the bar (a run that never reached it ranks last); the same difference, interval and
test for the sampled policy (T = 1): a run's mean training success over its last 5 iterations.
Its p is exact (all splits of the pooled seeds into two sets of the configs' sizes, ties at
mid-rank) up to 200,000 splits, and from 200,000 random ones above.

`--at N` reads every run as if it had stopped at iteration N: its last eval at or before N is the
"final" (its iterations N-4..N the sampled measure), and the bar counts only up to N (e.g.
`--report --at 10`: did two configs differ that early?; `--at 10 50 150` prints one table per N).
"""

import argparse
import itertools
import json
import math
import os
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository


def parse_runs(specs):
    """--run NAME="flags" -> [(name, [flag, ...])]; bad input is one line (sys.exit), before any run."""
    runs = []
    for spec in specs:
        name, _, extra = spec.partition("=")
        if not name or "/" in name or name.startswith(".") or name in dict(runs):
            sys.exit(
                f"error: --run {name or repr(spec)}: "
                + (
                    "given twice; each config needs its own name (its runs go to OUT/NAME-sSEED)"
                    if name in dict(runs)
                    else "NAME must be a folder name (no '/', not empty, no leading '.')"
                )
            )
        try:
            flags = shlex.split(extra)
        except ValueError as e:  # an unbalanced quote
            sys.exit(f"error: --run {name}: {e} in {extra!r}")
        for flag in ("--seed", "--out_dir"):
            if any(f == flag or f.startswith(flag + "=") for f in flags):
                sys.exit(
                    f"error: --run {name}: {flag} is the sweep's to set ("
                    + ("--seeds" if flag == "--seed" else "--out")
                    + "); remove it from the run's flags"
                )
        runs.append((name, flags))
    return runs


def run_one(k, name, flags, seed, args):
    out = os.path.join(args.out, f"{name}-s{seed}")
    cmd = [
        sys.executable,
        os.path.join(ROOT, "train.py"),
        "--seed",
        str(seed),
        "--threads",
        str(args.threads),
        "--device",
        args.device,
        "--out_dir",
        out,
        *flags,
    ]
    time.sleep(k % args.parallel * args.stagger if k < args.parallel else 0)
    t0 = time.time()
    # "a": a rerun into the same --out appends, so the log of an earlier failed start is kept
    with open(out + ".log", "a") as log:  # on GPU each run is its own world of 1 (a free port each)
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode
    print(f"{name} seed {seed}: rc {rc}, {time.time() - t0:.0f}s", flush=True)
    return name, seed, out, rc


def log_tail(log, since=0):
    """What a run wrote to log past byte `since`: its last 20,000 bytes at most, as text."""
    with open(log, "rb") as f:
        f.seek(max(since, os.path.getsize(log) - 20_000))
        return f.read().decode(errors="replace")


def last_line(log, since=0, limit=300):
    """The last non-empty line a run wrote to log past byte `since` (train.py's one-line error; \r
    splits progress bars), cut to limit; '' if none or no log."""
    try:
        lines = log_tail(log, since).replace("\r", "\n").split("\n")
    except OSError:
        return ""
    line = next((x.strip() for x in reversed(lines) if x.strip()), "")
    return line if len(line) <= limit else line[: limit - 3] + "..."


SAMPLED = 5  # the sampled-policy measure: mean training success over a run's last 5 iterations read


def summarise(name, runs, bar, at=None, show=True):
    """One table row for a config's runs (printed with show); at: read each run only up to that iteration."""
    rows = []
    for out in runs:
        path = os.path.join(out, "metrics.jsonl")
        ms = [json.loads(l) for l in open(path)] if os.path.exists(path) else []
        ms = [m for m in ms if at is None or m["iteration"] <= at]
        evals = [m for m in ms if m.get("eval_success") is not None]
        hit = next((m for m in ms if (m.get("eval_success") or 0) >= bar), None)
        rows.append(
            {
                "final": evals[-1]["eval_success"] if evals else float("nan"),  # a stopped run: its last eval
                "it_bar": hit["iteration"] if hit else None,
                "wall_bar": hit["wall"] if hit else None,
                "wall": ms[-1]["wall"] if ms else float("nan"),
                "peak": max([m["eval_success"] for m in evals] or [0]),
                "last": ms[-1]["iteration"] if ms else 0,
                # the sampled policy (T = 1) on fresh training seeds, played before the update on them
                "sampled": np.mean([m["success"] for m in ms[-SAMPLED:]]) if ms else float("nan"),
            }
        )
    fin, sampled = np.array([r["final"] for r in rows]), [r["sampled"] for r in rows]
    reached = [r for r in rows if r["it_bar"] is not None]
    its = np.array([r["it_bar"] for r in reached], float)
    walls = np.array([r["wall_bar"] for r in reached], float)
    fmt = lambda a, p: f"{a.mean():.{p}f} +- {a.std():.{p}f}" if len(a) else "-"
    if show:
        print(
            f"| {name} | {len(reached)}/{len(rows)} | {fmt(its, 0)} | {fmt(walls, 0)} | {fmt(fin, 3)} | "
            f"{sum(f >= 0.9 for f in fin)}/{len(rows)} | {np.mean([r['wall'] for r in rows]):.0f} | "
            f"{' '.join(f'{f:.2f}' for f in fin)} | {' '.join(f'{x:.2f}' for x in sampled)} |"
        )
    return rows


def mann_whitney(a, b, max_splits=200_000, seed=0):
    """Two-sided Mann-Whitney U test of samples a and b -> (U of a, p).

    U = (sum of a's ranks in the pooled sample) - n_a (n_a + 1) / 2, ties at their mid-rank. p = share
    of the splits of the pooled sample into n_a and n_b values whose |U - n_a n_b / 2| is at least the
    observed one: every split when there are at most max_splits, else max_splits random ones."""
    x = np.concatenate([np.asarray(a, float), np.asarray(b, float)])
    values, inverse, counts = np.unique(x, return_inverse=True, return_counts=True)
    ranks = (np.cumsum(counts) - (counts - 1) / 2)[inverse]  # 1-based mid-ranks
    na, n = len(a), len(x)
    if na == 0 or na == n:
        return float("nan"), float("nan")
    if math.comb(n, na) <= max_splits:
        picks = np.array(list(itertools.combinations(range(n), na)))
    else:
        rng = np.random.default_rng(seed)
        picks = np.argsort(rng.random((max_splits, n)), axis=1)[:, :na]
    u_all = ranks[picks].sum(1) - na * (na + 1) / 2
    u = ranks[:na].sum() - na * (na + 1) / 2
    centre = na * (n - na) / 2
    return float(u), float(np.mean(np.abs(u_all - centre) >= abs(u - centre) - 1e-9))


def bootstrap_diff(a, b, n=10_000, seed=0):
    """mean(a) - mean(b) and its 95% percentile bootstrap interval (each sample resampled apart)."""
    rng = np.random.default_rng(seed)
    a, b = np.asarray(a, float), np.asarray(b, float)
    d = a[rng.integers(len(a), size=(n, len(a)))].mean(1) - b[rng.integers(len(b), size=(n, len(b)))].mean(1)
    return float(a.mean() - b.mean()), float(np.percentile(d, 2.5)), float(np.percentile(d, 97.5))


def compare(name_a, rows_a, name_b, rows_b, bar, what="final held-out success"):
    """One line per measure: config a against config b over their seeds (see the module docstring)."""
    fa, fb = [r["final"] for r in rows_a], [r["final"] for r in rows_b]
    if len(fa) < 2 or len(fb) < 2:
        return
    if any(math.isnan(f) for f in fa + fb):  # a failed run, or one with no eval by --at
        n = sum(map(math.isnan, fa + fb))
        print(f"{name_a} vs {name_b}: not compared ({n} run{'s' * (n > 1)} without a {what})")
        return
    for label, key in (
        (what, "final"),
        (f"training success at T = 1 (its last {SAMPLED} iterations)", "sampled"),
    ):
        a, b = [r[key] for r in rows_a], [r[key] for r in rows_b]
        d, lo, hi = bootstrap_diff(a, b)
        u, p = mann_whitney(a, b)
        print(
            f"{name_a} - {name_b}: {label} {d:+.3f} ({np.mean(a):.3f} vs {np.mean(b):.3f}; 95% bootstrap "
            f"CI {lo:+.3f} .. {hi:+.3f}); Mann-Whitney U = {u:.1f}, p = {p:.3f} (n = {len(a)}, {len(b)})"
        )
    never = 1 + max([r["last"] for r in rows_a + rows_b] + [0])  # never reached: ranks last
    ia = [r["it_bar"] if r["it_bar"] is not None else never for r in rows_a]
    ib = [r["it_bar"] if r["it_bar"] is not None else never for r in rows_b]
    u, p = mann_whitney(ia, ib)
    med = lambda x: "never" if np.median(x) >= never else f"{np.median(x):.0f}"  # noqa: E731
    print(
        f"{name_a} vs {name_b}: iterations to {bar}: median {med(ia)} vs {med(ib)}; "
        f"Mann-Whitney U = {u:.1f}, p = {p:.3f}"
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", action="append", required=True, help='NAME="train.py flags"')
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--parallel", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="cpu | cuda (all runs share the GPU)")
    ap.add_argument(
        "--stagger",
        type=float,
        default=0.0,
        help="seconds between the first starts (vLLM "
        "engines sizing their memory at the same moment on one GPU can misjudge it)",
    )
    ap.add_argument("--bar", type=float, default=0.8, help="held-out success to time")
    ap.add_argument("--out", default="out/bench")
    ap.add_argument("--report", action="store_true", help="only summarise the runs already in --out")
    ap.add_argument(
        "--at",
        type=int,
        nargs="+",
        default=[None],
        help="read the runs only up to this iteration "
        "('final' = the last eval at or before it); several: one table each",
    )
    args = ap.parse_args()
    runs = parse_runs(args.run)
    jobs = [(name, flags, seed) for name, flags in runs for seed in args.seeds]
    dirs = [os.path.join(args.out, f"{name}-s{seed}") for name, _, seed in jobs]
    held = [d for d in dirs if os.path.isdir(d) and os.listdir(d)]
    if held and not args.report:
        sys.exit(
            f"error: {held[0]} already holds a run ({len(held)} of the {len(dirs)} run dirs do): "
            f"--report summarises them; a new --out runs the sweep again"
        )
    if args.report and not held:
        what = "holds none of the runs' folders" if os.path.isdir(args.out) else "no such folder"
        sys.exit(f"error: bench.sweep --report: {args.out}: {what} (run the sweep first, without --report)")
    if args.parallel < 1:
        sys.exit(f"error: --parallel {args.parallel}: give 1 or more (the runs at a time)")
    if args.report:
        done = [(name, seed, d, None) for (name, _, seed), d in zip(jobs, dirs)]
    else:
        os.makedirs(args.out, exist_ok=True)
        with ThreadPoolExecutor(args.parallel) as pool:
            done = list(pool.map(lambda kj: run_one(kj[0], *kj[1], args), enumerate(jobs)))
    for at in args.at:
        final = "final" if at is None else f"at iteration {at}:"
        print(
            f"\n| config | reached {args.bar} | iterations to {args.bar} | seconds to {args.bar} "
            f"| {final} held-out success | {final} >= 0.9 | run seconds | {final} "
            f"| training success at T = 1, last {SAMPLED} iterations |\n" + "|---" * 9 + "|"
        )
        rows = {
            name: summarise(name, [out for n, _, out, _ in done if n == name], args.bar, at)
            for name, _ in runs
        }
        first, *others = list(rows)
        if others:
            print()
        for other in others:
            compare(
                first,
                rows[first],
                other,
                rows[other],
                args.bar,
                "final held-out success" if at is None else f"held-out success at iteration {at}",
            )
    final = [
        r
        for name, _ in runs
        for r in summarise(name, [d for n, _, d, _ in done if n == name], args.bar, show=False)
    ]
    failed = [
        (name, seed, d) for (name, seed, d, rc), row in zip(done, final) if rc or math.isnan(row["final"])
    ]
    if failed:  # the first failed run's own last line (train.py's one-line error) says why
        why = next(
            (f"{os.path.basename(d)}: {line}; " for *_, d in failed if (line := last_line(d + ".log"))), ""
        )
        sys.exit(
            f"error: {len(failed)} of {len(done)} runs failed or have no held-out eval ({why}logs: "
            + ", ".join(f"{d}.log" for *_, d in failed)
            + ")"
        )


if __name__ == "__main__":
    main()
