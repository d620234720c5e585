"""One ALFWorld replicate in a fixed time: expert data, a clone, GiGPO and GRPO from it side by side on
one GPU, both splits evaluated, each paired game by game against the clone; and the pooled report.

    python -m bench.pair --model SMOLLM2 --out out/pair1 --minutes 28 --seed 1   # replicate 1, one GPU
    python -m bench.pair --report out/pair1 out/pair2 out/pair3            # pool the replicates
    python -m bench.pair --model SMOLLM2 --out /tmp/pair --minutes 25 --lora_rank 8 --iterations 75
                                                    # a long LoRA pair: the same command on each machine

A replicate (each stage is skipped where its output is whole, so a rerun goes on, with the flags
OUT/stages.json keeps; one bench.pair per OUT at a time; an arm's folder is never moved while a
process runs in it; Ctrl-C or SIGTERM stops the stages running, each keeping what it saved):
  1. collect  the expert on train games 0..--games-1 (bench.bc --collect, over --procs processes)
              -> OUT/bc.jsonl; needs no GPU: --collect_only makes it alone (on a 2-core machine
              ~4 min for 300 games), and OUT (bc.jsonl ~4 MB, stages.json) goes to the GPU host
  2. clone    bench.bc --train from --model, --epochs -> OUT/clone/
  3. eval     the clone on valid_seen and valid_unseen (train.py --eval_only 1) -> OUT/clone_eval/,
              run beside 4 (the arms do not need it)
  4. arms     train.py --algo gigpo and --algo grpo from the clone at once, sharing the GPU (on a host
              of several, each arm on its own: arm_device), with the --time_limit left after 1-2
              (less the final evals: 2x the clone's eval, as an earlier call timed it, else 300 s)
              -> OUT/gigpo/, OUT/grpo/ (each checkpointed where it stops: ~1.6 GB for SmolLM2 with
              its AdamW state);
              an arm dead of CUDA out of memory starts again from its checkpoint (OOM_TRIES times),
              the clone's eval again alone once the arms end
  4b. evals   a time limit's stop saves without an eval: the arms' model/ exports on both splits, at
              once (train.py --eval_only 1) -> OUT/gigpo_eval/, OUT/grpo_eval/
  5. compare  evaluate.compare for clone -> gigpo, clone -> grpo, gigpo -> grpo, and the arms' training
              success in blocks of pair_report.BLOCK iterations -> OUT/pair.md
What a lost host costs: the stage it was in (a clone is whole once its tokenizer, written last, is
there; an eval once its eval.json says "complete"). Small files to copy off as they appear: bc.jsonl (a
few MB), clone_eval/eval.json, the arms' metrics.jsonl (one line an iteration) and ARM_eval/. In a
long pair (below) the arms also save every SAVE_EVERY iterations and OUT/carry.tgz is rewritten
once the clone is made, once its eval is whole and after each save, so there a lost host costs the
iterations since the last one. --caches OUT1: a later replicate's arms start with OUT1's compile caches.

A long pair over several machines (--lora_rank R): the clone and both arms train LoRA adapters, so
everything a replicate needs is MBs, packed in OUT/carry.tgz after every run (expert data, the
clone's adapter, its eval, each arm's checkpoint, log and compile caches). On the next machine,
unpack it into OUT (the same path) and run the same command: the clone is merged again from its
adapter (bench.bc --merge: the same weights, which the arms' --resume checks), the clone eval is
kept, and each arm resumes from its checkpoint for --minutes more (no time kept back for evals: a
stop is saved, not evaluated), until its checkpoint reaches train.py's --iterations, where train.py
evaluates it; then step 5 runs.

Flags it does not know go to train.py, for the clone's eval and both arms (after ARM_FLAGS below:
theirs win). The arms run the ALFWorld preset (train.PRESETS: 16 x 8 envs, 50 steps, window memory,
KL 0.01, entropy 0.001) with the settings of docs/envs.md's RL from the clone.
--report: the replicates pooled (bench/pair_report.py).
"""

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time

import torch

import checkpoint
import checks
import evaluate
import records
import train
from bench.pair_report import arm_eval, rates, report, saved_iteration, trajectory
from bench.sweep import last_line, log_tail
from engine import cache_files

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # stages run from here
ARMS = ("gigpo", "grpo")
# the arms' (and the clone eval's) settings: docs/envs.md, "RL from the tagged clone"; two runs share
# one GPU, so each engine has a fixed cache and 8 env workers, and the compiled update 32768-token
# micro-batches with activation checkpointing (the same gradients: tests/test_dist.py). Two arms
# beside the clone's eval ran out of an H100's 80 GB (replicate 2). Torch's peak reserve was 36-48 GiB
# an arm without checkpointing, 39-44 with, and an arm kept its update's cached blocks while
# generating until train.py gave them back after each update (release_cached_memory); pair.md's
# gpu_alloc_gib shows what an arm uses. --metrics all: each line also splits the update's time
# (time_logprobs, time_ref_logprobs) and the rollout's
ARM_FLAGS = (
    "--max_response_tokens 64 --lr 1e-5 --engine vllm --gpu_memory_utilization 0 --kv_cache_mb 4096 "
    "--env_workers 8 --micro_batch_tokens 32768 --grad_ckpt 1 --eval_every 100000 --metrics all"
).split()


SAVE_EVERY = 1  # a long pair's arms checkpoint every iteration (~1.5 min on an H100), each in the carry
POLL = 20  # seconds between looks at the arms' checkpoints
OOM_TRIES = 3  # an arm dead of CUDA out of memory starts again (from its checkpoint) this many times
STAGE_FLAGS = ("games", "epochs", "bc_flags", "lora_rank", "seed")  # what OUT's data and clone are made with


def same_stages(out, args):
    """OUT/stages.json: the flags OUT's expert data and clone were made with (written when OUT is
    new). A later call with others would reuse them unsaid: one line instead (the arms' own flags are
    checked by train.py's --resume)."""
    path, now = os.path.join(out, "stages.json"), {k: getattr(args, k) for k in STAGE_FLAGS}
    if os.path.exists(path):
        before = json.load(open(path))
        if os.path.exists(os.path.join(out, "clone")):  # made before --seed was recorded: with seed 0
            before = {"seed": 0, **before}
        diff = [
            f"--{k} {before[k]!r} (this call: {now[k]!r})" for k in now if k in before and before[k] != now[k]
        ]
        if diff:
            sys.exit(
                f"error: bench.pair: {out} was made with {', '.join(diff)}: give the same, or a new --out"
            )
        if set(now) - set(before):  # an older OUT: the flags it did not record are this call's from now on
            records.write_whole(path, json.dumps({**now, **before}))
    elif not os.path.exists(os.path.join(out, "bc.jsonl")):  # a new OUT (an older one's flags: not known)
        records.write_whole(path, json.dumps(now))


STAGES = []  # the stages' processes: stopped with bench.pair (Ctrl-C, SIGTERM), not left running


def run(cmd, log, wait=True, env=None):
    """A stage's command, its output into log; a failure is one line: the stage's own last line
    (each ends a failure in one) and the log's path."""
    since, f = log_size(log), open(log, "a")
    p = subprocess.Popen([sys.executable, *cmd], stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    STAGES.append(p)
    if not wait:
        return p
    if p.wait():
        fail(f"{' '.join(cmd[:3])} ... failed (exit {p.returncode})", log, since)
    return p


def fail(what, log, since):
    """Ends bench.pair in one line: what failed, the last line its stage wrote to log past byte
    `since`, and where the log is."""
    last = last_line(log, since) or "(it wrote nothing)"
    sys.exit(f"error: bench.pair: {what}: {last} (log: {log})")


def replicate(args, extra):
    """The stages in order, each skipped where its output is there (a rerun goes on where one stopped)."""
    out = args.out
    checkpoint.lock(out, flag="--out")  # one bench.pair per OUT (its arms lock their own folders)
    same_stages(out, args)
    t0, log = time.time(), os.path.join(out, "pair.log")
    data, clone = os.path.join(out, "bc.jsonl"), os.path.join(out, "clone")
    lora = ["--lora_rank", str(args.lora_rank)] * bool(args.lora_rank)
    if not os.path.exists(data):
        collect_expert(args, data, log, t0)
    if args.collect_only:
        print(f"bench.pair: {data} made; a GPU host's same command (without --collect_only) goes on")
        return
    if not os.path.exists(os.path.join(clone, "tokenizer_config.json")):
        make_clone(args, data, clone, lora, log, t0)
    evals = {"clone": os.path.join(out, "clone_eval")}
    timing = os.path.join(evals["clone"], "eval_seconds.txt")
    try:  # the clone's eval time (an earlier call's), which the arms of a replicate leave for their evals
        t_eval = float(open(timing).read())
    except (OSError, ValueError):
        t_eval = 300.0  # none yet: ~the H100's (docs/envs.md)
    # 4. the arms at once. A replicate: one run each, for what is left less their evals after it (two at
    #    once: 2x the clone's); done once saved. A long pair (--lora_rank): all that is left, each call;
    #    done at the target iteration (evaluated there by train.py), resumed while short of it
    target = train.parse_args(["--env", "alfworld", *ARM_FLAGS, *extra]).iterations
    evals_left = 0 if args.lora_rank else 2 * t_eval
    minutes = (
        (args.minutes * 60 - (time.time() - t0) - evals_left - args.start_up) / 60 if args.minutes else 0
    )
    at = {arm: saved_iteration(os.path.join(out, arm)) for arm in args.arms}
    done = lambda arm: at[arm] >= target or (at[arm] > 0 and not args.lora_rank)  # noqa: E731
    logs, t_arms, tries = {arm: os.path.join(out, f"{arm}.log") for arm in args.arms}, time.time(), {}
    since = {arm: log_size(logs[arm]) for arm in args.arms}  # where each arm's output of this call begins

    def again(arm):  # an arm dead of GPU memory: started again with the time left, else None
        left = minutes - (time.time() - t_arms) / 60 if minutes else 0
        if not died_of_oom(logs[arm], since[arm]) or tries.get(arm, 0) == OOM_TRIES or (minutes and left < 1):
            return None
        tries[arm] = tries.get(arm, 0) + 1
        since[arm], at[arm] = log_size(logs[arm]), saved_iteration(os.path.join(out, arm))
        print(
            f"{arm}: out of GPU memory beside the other runs; again from iteration {at[arm]} ({tries[arm]})"
        )
        return start_arms(args, extra, clone, lora, left, [arm], at)[arm]

    procs = start_arms(args, extra, clone, lora, minutes, [arm for arm in args.arms if not done(arm)], at)
    print(f"arms {', '.join(procs) or '(done before)'}: {minutes:.1f} min each, logs {out}/ARM.log")
    # 3. the clone on both splits (again if cut short), beside the arms, which do not need it: its
    #    engine's start and game loads overlap theirs instead of delaying them
    clone_eval, t_clone_eval, since_eval = None, time.time(), log_size(log)
    cmd = ["train.py", "--env", "alfworld", "--eval_only", "1", "--model", clone]
    cmd += ["--out_dir", evals["clone"], *ARM_FLAGS, *extra]
    if not evaluate.complete(evals["clone"]):
        clone_eval = run(cmd, log, wait=False)
    failed = wait_for_arms(out, procs, args.arms, refresh=bool(args.lora_rank), again=again)
    if clone_eval:
        if clone_eval.wait() and died_of_oom(log, since_eval):  # beside the arms: now alone
            print("clone eval: out of GPU memory beside the arms; again, alone")
            clone_eval = run(cmd, log)
        if clone_eval.returncode:
            fail("the clone's eval failed", log, since_eval)
        records.write_whole(timing, f"{time.time() - t_clone_eval:.1f}\n")
        print(f"clone eval: {rates(evals['clone'])}, {time.time() - t_clone_eval:.0f} s (beside the arms)")
    at.update({arm: saved_iteration(os.path.join(out, arm)) for arm in args.arms})  # done() reads it
    if not carry(out, args.arms, with_ckpt=bool(args.lora_rank)):  # also what a failed arm had saved
        print(f"warning: bench.pair: packing {out}/carry.tgz after the stop failed; the one there is older")
    if failed:
        fail(f"{', '.join(failed)} failed; {failed[0]}", logs[failed[0]], since[failed[0]])
    if not all(map(done, args.arms)):
        print(
            f"bench.pair: the arms are at iterations {at} of {target}: run the same command again to go on "
            f"(on another machine: unpack {out}/carry.tgz into {out} first)"
        )
        return
    evaluate_exports(args, extra, log)
    evals.update({arm: arm_eval(out, arm) for arm in args.arms})
    # 5. paired, game by game
    pairs = [("clone", a) for a in args.arms] + [tuple(args.arms)] * (len(args.arms) == 2)
    text = "\n\n".join(
        [*(evaluate.compare(evals[a], evals[b]) for a, b in pairs), trajectory(out, args.arms)]
    )
    open(os.path.join(out, "pair.md"), "w").write(text + "\n")
    carry(out, args.arms, with_ckpt=bool(args.lora_rank))
    print(text)
    print(f"bench.pair: {out} in {(time.time() - t0) / 60:.1f} min")


def collect_expert(args, data, log, t0):
    """1. The expert's steps on train games 0..games-1, the games split evenly over the processes."""
    k = max(1, min(args.procs, args.games))
    spans = [(args.games * i // k, args.games * (i + 1) // k) for i in range(k)]
    parts = [f"{data}.{i}" for i in range(k)]
    since = log_size(log)
    procs = [
        run(["-m", "bench.bc", "--collect", part, "--first", str(a), "--games", str(b - a)], log, wait=False)
        for part, (a, b) in zip(parts, spans)
    ]
    if any(p.wait() for p in procs):
        fail("the expert's collection failed", log, since)
    with open(data + ".tmp", "w") as f:
        for part in parts:
            f.write(open(part).read())
    os.replace(data + ".tmp", data)
    for part in parts:
        os.remove(part)
    n = sum(1 for _ in open(data))
    print(f"collect: {n} expert steps of {args.games} games, {time.time() - t0:.0f} s")


def make_clone(args, data, clone, lora, log, t0):
    """2. The clone (bench.bc, which writes the tokenizer after the weights), or its carried adapter
    merged onto --model again."""
    adapter = os.path.join(clone, "adapter")
    if os.path.exists(os.path.join(adapter, "adapter_config.json")):
        run(["-m", "bench.bc", "--merge", adapter, "--model", args.model, "--out", clone], log)
    else:
        cmd = ["-m", "bench.bc", "--train", data, "--model", args.model, "--out", clone]
        cmd += ["--epochs", str(args.epochs), *lora, *args.bc_flags.split(), "--seed", str(args.seed)]
        run(cmd, log)
    print(f"clone: {clone}, {time.time() - t0:.0f} s in")
    if args.lora_rank:  # the expert data and the clone's adapter: a host lost from here keeps them
        carry(args.out, args.arms, with_ckpt=True)


def start_arms(args, extra, clone, lora, minutes, arms, at):
    """4. The arms not done yet, at once: {arm: its train.py process}; at: each arm's saved iteration
    (0: none, a fresh start)."""
    procs = {}
    for arm in arms:
        if args.minutes and minutes < 1:
            sys.exit(f"error: bench.pair: {minutes:.1f} min left for the arms: raise --minutes")
        resume, run_dir = ["--resume", "1"] if at[arm] else [], os.path.join(args.out, arm)
        if os.path.exists(run_dir) and not resume:  # an arm cut short before its checkpoint: kept aside
            if who := checkpoint.holder(run_dir):  # not cut short: still running (an earlier bench.pair's)
                sys.exit(f"error: bench.pair: {run_dir} is in use ({who}): stop it first")
            kept = next(f"{run_dir}.cut{k}" for k in range(1, 999) if not os.path.exists(f"{run_dir}.cut{k}"))
            os.rename(run_dir, kept)
            print(f"{arm}: a run cut short before its checkpoint is kept in {kept}; starting it again")
        if args.caches and not resume:
            seed_caches(args.caches, run_dir, arm)
        cmd = ["train.py", "--env", "alfworld", "--model", clone, "--algo", arm, "--out_dir", run_dir]
        limit = ["--time_limit", f"{minutes:.2f}"] if minutes else []
        saves = ["--save_every", str(SAVE_EVERY)] if args.lora_rank else []  # carried as they come
        env = compile_caches(run_dir) if args.lora_rank else dict(os.environ)
        procs[arm] = run(
            [*cmd, *ARM_FLAGS, *lora, *saves, *limit, *resume, *extra],
            os.path.join(args.out, f"{arm}.log"),
            wait=False,
            env={**env, **arm_device(args.arms, arm)},
        )
    return procs


def arm_device(arms, arm):
    """Where an arm runs: on a host of several GPUs, the k-th arm on the k-th GPU (of those
    CUDA_VISIBLE_DEVICES lists, if set), each at one GPU's speed; on one GPU, beside the others ({})."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = visible.split(",") if visible else [str(k) for k in range(torch.cuda.device_count())]
    return {"CUDA_VISIBLE_DEVICES": gpus[arms.index(arm) % len(gpus)]} if len(gpus) > 1 else {}


def evaluate_exports(args, extra, log):
    """4b. The evals the arms' runs did not make (a --time_limit stop saves, not evaluates): their
    model/ exports, all at once, as the clone's -> OUT/ARM_eval/."""
    procs, since = {}, log_size(log)
    for arm in args.arms:
        if evaluated(args.out, arm):
            continue
        model, out_dir = os.path.join(args.out, arm, "model"), os.path.join(args.out, f"{arm}_eval")
        cmd = ["train.py", "--env", "alfworld", "--eval_only", "1", "--model", model, "--out_dir", out_dir]
        env = {**os.environ, **arm_device(args.arms, arm)}
        procs[arm] = run([*cmd, *ARM_FLAGS, *extra], log, wait=False, env=env)
    if any(p.wait() for p in procs.values()):
        fail("an arm's eval failed", log, since)


def evaluated(out, arm):
    """Whether the arm's final eval is there: bench.pair's (OUT/ARM_eval), or its run's own at its ckpt."""
    run_dir = os.path.join(out, arm)
    if arm_eval(out, arm) != run_dir:
        return True
    own = os.path.join(run_dir, "eval.json")
    return evaluate.complete(own) and json.load(open(own)).get("iteration") == saved_iteration(run_dir)


def compile_caches(run_dir):
    """The environment of a long pair's arm: torch.compile's kernels (the trainer's layers; Triton's
    cache is inside) and vLLM's compiled model kept in RUN_DIR/compile_cache, which the carry takes
    along, so that an arm resumed on a fresh machine loads them instead of compiling again (on an
    H100 each session's first update took 165-200 s, against 31-47 s later, and the engine's start
    ~86 s). They replace any set in this process's environment: torch sets TORCHINDUCTOR_CACHE_DIR
    there itself (to its /tmp default) once it compiles anything."""
    cache = os.path.join(run_dir, "compile_cache")
    return {
        **os.environ,
        "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache, "inductor"),
        "VLLM_CACHE_ROOT": os.path.join(cache, "vllm"),
    }


def seed_caches(src, run_dir, arm):
    """A fresh arm starts with the compile caches of an earlier replicate's same arm (--caches SRC: its
    OUT folder or carry.tgz): the graphs are the same for every clone of one model, so its engine's
    start and first update load kernels instead of compiling them (what does not match is compiled)."""
    name, dst = f"{arm}/compile_cache", os.path.join(run_dir, "compile_cache")
    if os.path.isdir(src):
        if not os.path.isdir(os.path.join(src, name)):
            sys.exit(f"error: bench.pair: --caches {src} has no {name}: give an earlier replicate's OUT")
        shutil.copytree(os.path.join(src, name), dst, dirs_exist_ok=True)
    else:
        try:
            with tarfile.open(src) as tar:
                members = [m for m in tar.getmembers() if m.name == name or m.name.startswith(name + "/")]
                tar.extractall(os.path.dirname(run_dir), members=members, filter="data")
        except (OSError, tarfile.TarError) as e:
            sys.exit(
                f"error: bench.pair: --caches {src}: {checks.first_line(e)}: give an earlier replicate's OUT "
                "or carry.tgz"
            )
        if not members:
            sys.exit(f"error: bench.pair: --caches {src} has no {name}: give an earlier replicate's carry")
    print(f"{arm}: {cache_files(dst)} compile cache files from {src}")


def wait_for_arms(out, procs, arms, refresh, again=lambda arm: None):
    """Wait for the arms' processes -> the arms that failed. refresh (a long pair): OUT/carry.tgz is
    written again each time an arm's checkpoint moves on or the clone's eval (beside them) becomes
    whole, so a host lost mid-session costs only the iterations since (copy carry.tgz off as it
    changes). again(arm): for an arm that failed, its process started again, or None (it failed)."""
    state = lambda: (checkpoints(out, arms), evaluate.complete(os.path.join(out, "clone_eval")))  # noqa: E731
    seen, running, failed = state(), list(procs.values()), set()
    while running:
        try:
            running[0].wait(timeout=POLL)  # returns as soon as it ends
        except subprocess.TimeoutExpired:
            pass
        running, now = [p for p in running if p.poll() is None], state()
        for arm, p in procs.items():
            if p.returncode and arm not in failed:
                if (new := again(arm)) is None:
                    failed.add(arm)
                else:
                    procs[arm] = new
                    running.append(new)
        if refresh and now != seen and carry(out, arms, with_ckpt=True):
            seen = now
    return [arm for arm in procs if arm in failed]


def log_size(path):
    return os.path.getsize(path) if os.path.exists(path) else 0


def died_of_oom(log, since):
    """Whether what a stage wrote to log past byte `since` ends in GPU memory running out (torch's
    "CUDA out of memory" in train.py's last line, or the engine's "GPU out of memory" on waking)."""
    return "out of memory" in log_tail(log, since)


def checkpoints(out, arms):
    """Which checkpoint each arm holds now: its ckpt/ folder's inode (a save swaps in a new folder)
    and iteration; None where there is none."""
    ids = {}
    for arm in arms:
        run_dir = os.path.join(out, arm)
        try:
            ids[arm] = (os.stat(checkpoint.checkpoint_path(run_dir)).st_ino, saved_iteration(run_dir))
        except OSError:
            ids[arm] = None
    return ids


def carry(out, arms, with_ckpt):
    """OUT/carry.tgz: what a replicate needs to go on elsewhere, the small files only: the expert data,
    the clone's adapter (--lora_rank) and eval, each arm's logs (episodes.jsonl: bench.credit's input),
    eval and (with LoRA: MBs) checkpoint and compile caches. Not the merged clone or the arms' model/
    exports, which are rebuilt or rewritten."""
    names = ["bc.jsonl", "stages.json", "clone/bc.json", "clone/adapter", "clone_eval", "pair.log", "pair.md"]
    for arm in arms:
        names += [
            f"{arm}.log",
            f"{arm}/metrics.jsonl",
            f"{arm}/episodes.jsonl",
            f"{arm}/eval.json",
            f"{arm}_eval",
        ]
        if with_ckpt:
            names.append(os.path.relpath(checkpoint.checkpoint_path(os.path.join(out, arm)), out))
            names.append(f"{arm}/compile_cache")
    path, before = os.path.join(out, "carry.tgz"), checkpoints(out, arms)
    try:
        with tarfile.open(path + ".tmp", "w:gz") as tar:
            for name in names:
                if os.path.exists(os.path.join(out, name)):
                    tar.add(os.path.join(out, name), arcname=name)
    except (OSError, tarfile.TarError):  # a file gone mid-walk (an arm swapping in a checkpoint), a full disk
        return dropped(path + ".tmp")
    if checkpoints(out, arms) != before:  # a checkpoint swapped in while packing: parts of two saves
        return dropped(path + ".tmp")
    os.replace(path + ".tmp", path)
    print(f"bench.pair: {path}, {os.path.getsize(path) / 2**20:.1f} MiB", flush=True)
    return path


def dropped(path):
    """A half-made or mixed carry is removed (on a full disk it holds the space the next save needs)."""
    with contextlib.suppress(OSError):
        os.remove(path)


def main(argv=None):
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--model", help="the HF folder to clone from (python smollm2.py DIR)")
    ap.add_argument("--out", help="the replicate's folder")
    ap.add_argument("--games", type=int, default=300, help="expert train games 0..N-1")
    ap.add_argument(
        "--procs",
        type=int,
        default=min(12, os.cpu_count() or 1),
        help="processes for the expert's collection (default: the cores, at most 12)",
    )
    ap.add_argument("--epochs", type=int, default=1, help="bench.bc --train --epochs")
    ap.add_argument("--bc_flags", default="", help="more bench.bc --train flags, one string")
    ap.add_argument(
        "--minutes", type=float, default=0, help="the replicate's whole time; 0 = the arms' --iterations"
    )
    ap.add_argument("--start_up", type=float, default=120, help="seconds an arm takes to start (compile)")
    ap.add_argument("--arms", nargs="+", default=list(ARMS), help="train.py --algo names")
    ap.add_argument(
        "--seed",
        type=int,
        default=0,
        help="the replicate's seed: its clone's (bench.bc) and its arms' and evals' (train.py); "
        "replicate k of a pooled report: its own seed, else the replicates differ only by GPU noise",
    )
    ap.add_argument(
        "--lora_rank",
        type=int,
        default=0,
        help="clone and arms as LoRA adapters of this rank: their checkpoints are MBs, so a long pair "
        "goes on across machines (OUT/carry.tgz)",
    )
    ap.add_argument(
        "--caches",
        metavar="SRC",
        help="an earlier replicate's OUT or carry.tgz (--lora_rank): new arms start with its compile caches",
    )
    ap.add_argument(
        "--collect_only",
        action="store_true",
        help="stage 1 alone (CPU, no --model): OUT's expert data, made before a GPU host's same command",
    )
    ap.add_argument("--report", nargs="+", metavar="OUT", help="pool these replicates' folders instead")
    args, extra = ap.parse_known_args(argv)
    extra = [*extra, "--seed", str(args.seed)]  # train.py's, for the clone's eval and both arms
    if args.report:
        text = report(args.report, args.arms)
        print(text)
        return text
    if not (args.model or args.collect_only) or not args.out:
        sys.exit(
            "error: bench.pair: give --model DIR and --out DIR "
            "(or --collect_only --out DIR, or --report OUT ...)"
        )
    if args.games < 1 or args.procs < 1 or args.epochs < 1 or args.minutes < 0:
        sys.exit("error: bench.pair: --games, --procs and --epochs must be >= 1, --minutes >= 0")
    if args.caches and not args.lora_rank:
        sys.exit(
            f"error: bench.pair: --caches {args.caches} needs --lora_rank (only its arms keep caches in OUT)"
        )
    if args.caches and not os.path.exists(args.caches):
        sys.exit(f"error: bench.pair: --caches {args.caches}: not found")
    if not args.collect_only and not os.path.isdir(args.model):
        sys.exit(f"error: bench.pair: --model {args.model}: no such folder (python smollm2.py DIR makes one)")
    args.out, args.model = os.path.abspath(args.out), args.model and os.path.abspath(args.model)
    try:
        replicate(args, extra)
    except KeyboardInterrupt:  # the stages still running get SIGTERM, as train.py's own Ctrl-C: each keeps
        stopped = stop_stages()  # what it saved, and the same command goes on from there
        sys.exit(
            f"interrupted: bench.pair stopped {stopped} running stage(s); {args.out} keeps what they saved"
        )


def stop_stages(grace=120):
    """SIGTERM to every stage process still running, then wait for them (a kill after grace s) -> how many."""
    live = [p for p in STAGES if p.poll() is None]
    for p in live:
        p.send_signal(signal.SIGTERM)
    for p in live:
        try:
            p.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    return len(live)


def _interrupt(signum, frame):
    raise KeyboardInterrupt  # SIGTERM (a scheduler's kill) ends like Ctrl-C: the stages are stopped too


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _interrupt)
    main()
