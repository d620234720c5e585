"""What a run writes besides its checkpoints: metrics.jsonl, and whole episodes, to see what the
agent did and what GiGPO made of it; and what makes the metrics line (the phase timer, the training
numbers summed over ranks, which keys the line holds), the progress bar and wandb.

`out_dir/metrics.jsonl` gets one line per iteration (docs/training.md, "Metrics"); a resumed run keeps the
lines of the iterations its checkpoint holds (checkpoint.kept_log) and drops the rest. Both logs
only ever hold whole lines: a write that fails (a full disk) is taken back and stops the run in one
line (append_lines).

`out_dir/episodes.jsonl` gets one line per episode: for a few training groups of every iteration
(`--log_groups`, default 1) and the first `--log_groups x 8` episodes of every evaluation set. Per
step: the prompt and the response as text, the parsed action, valid, reward, the discounted step
return, the episode-level advantage A^E, the step-level A^S, the advantage trained on, the anchor
state and its step group (id and size). Evaluation steps have no advantages (null).

Bounded: a prompt is cut to its last PROMPT_CHARS characters, and the file stops growing at
LOG_MB MiB (one line says so); the viewer (`python plots.py OUT_DIR`) reads it.
"""

import contextlib
import dataclasses
import errno
import json
import os
import time

import numpy as np
import torch
from tqdm import tqdm

from checks import fail, first_line
from fsdp import all_reduce

PROMPT_CHARS = 4000
LOG_MB = 100  # episodes.jsonl stops growing at this size, MiB


def write_whole(path, text):
    """Write a file whole, then rename it into place: a kill mid-write leaves the old file, never half;
    a full disk leaves the old file too, and stops the run in one line."""
    try:
        with open(path + ".tmp", "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())  # on the disk before the rename: a power cut leaves old or new, not empty
        os.replace(path + ".tmp", path)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.remove(path + ".tmp")
        fail(f"cannot write {path} ({os_error(e)}); it is left as it was")


def log_lines(path):
    """A log's lines as (line, ending in a newline; its iteration, None where the line is no record:
    one a crash cut short)."""
    for line in open(path) if os.path.exists(path) else []:
        try:
            it = json.loads(line)["iteration"]
        except (ValueError, KeyError, TypeError):
            it = None
        yield (line if line.endswith("\n") else line + "\n"), it


def set_aside(path, upto):
    """A log (metrics.jsonl, episodes.jsonl) split at iteration `upto` -> its lines up to it; the later
    ones, which a resume redoes, are appended to its .redone.jsonl twin before the log drops them (once,
    though a kill in between sets them aside again), so the last iterations before a crash stay
    readable. A line a crash cut short is no record: in neither."""
    kept, later = [], []
    for line, it in log_lines(path):
        if it is not None:
            (kept if it <= upto else later).append(line)
    twin, text = path.removesuffix(".jsonl") + ".redone.jsonl", "".join(later).encode()
    tail = _tail(twin, len(text)) if os.path.exists(twin) else b""
    if text and tail != text:  # else a kill came before the cut (the log kept the lines set aside): once
        cut = bool(tail) and not tail.endswith(b"\n")  # half a line a kill left: it stays on its own
        append_lines(twin, "\n" * cut + text.decode())
    return kept


def _tail(path, n):
    with open(path, "rb") as f:
        f.seek(max(0, f.seek(0, os.SEEK_END) - n))
        return f.read()


def os_error(e):
    """An OSError in words for a one-line error: 'no space left on device' for a full disk."""
    return "no space left on device" if e.errno == errno.ENOSPC else e.strerror or str(e)


def append_lines(path, text):
    """Append whole lines to a log. A write that fails part-way (a full disk) is taken back, so the
    file never keeps half a line, and the run stops in one line (its last checkpoint stays)."""
    with open(path, "ab", buffering=0) as f:
        size, data = f.seek(0, os.SEEK_END), text.encode()
        try:
            done = 0
            while done < len(data):  # an unbuffered write may write part and return its count
                done += f.write(data[done:])
        except OSError as e:
            f.truncate(size)
            fail(
                f"cannot write {path} ({os_error(e)}); it keeps whole lines only, and the last checkpoint "
                f"stays (--resume 1 goes on from it once fixed)"
            )


def advantage_parts(parts, ks):
    """-> {step_return, adv_episode, adv_step, step_group, step_group_size} at the samples ks, from the
    parts gigpo.advantages returned with the advantage the update saw (train.advantages): the trained
    advantage is adv_episode + step_weight * adv_step, where adv_step is GiGPO's A^S before the weight
    omega; grpo and rloo have no step term (0), ppo and reinforce_pp no episode term (0, and their
    whole advantage is adv_step, weight 1). ks: whole episode groups (their step groups' sizes count)."""
    size = np.bincount(parts["step_group"])  # step group ids are dense
    return {
        "step_return": parts["step_return"][ks],
        "adv_episode": parts["adv_episode"][ks],
        "adv_step": parts["adv_step"][ks],
        "step_group": parts["step_group"][ks],
        "step_group_size": size[parts["step_group"][ks]],
    }


def episodes(samples, tok, iteration, split, adv=None, parts=None, max_episodes=None):
    """Samples -> episode records (dicts), in trajectory order; max_episodes: the first n
    trajectories. adv/parts (advantage_parts of the same samples): training only."""
    by_traj = {}
    for k, s in enumerate(samples):
        by_traj.setdefault(s.traj, []).append(k)
    out = []
    for traj, ks in list(by_traj.items())[:max_episodes]:
        steps = []
        for k in ks:
            s = samples[k]
            prompt = tok.decode(s.prompt_ids, skip_special_tokens=False)
            step = {
                "step": s.step,
                "prompt": prompt[-PROMPT_CHARS:],
                "response": tok.decode(s.response_ids),
                "action": s.action,
                "valid": s.valid,
                "reward": s.reward,
                "anchor": s.anchor,
            }
            if parts is not None:
                step |= {"adv": float(adv[k])} | {
                    name: v[k].item() if hasattr(v[k], "item") else v[k] for name, v in parts.items()
                }
            steps.append(step)
        out.append(
            {
                "iteration": iteration,
                "split": split,
                "group": samples[ks[0]].group,
                "traj": traj,
                "return": sum(x["reward"] for x in steps),
                "length": len(steps),
                "steps": steps,
            }
        )
    return out


class EpisodeLog:
    """Appends episode records to out_dir/episodes.jsonl until it holds max_mb MiB. A run resumed
    at iteration `start` keeps the records of iterations <= start (as its metrics log; the later ones
    go to episodes.redone.jsonl); a new run starts the file afresh."""

    def __init__(self, out_dir, max_mb, start=0):
        self.path, self.cap, self.full = os.path.join(out_dir, "episodes.jsonl"), max_mb << 20, False
        if os.path.exists(self.path):
            write_whole(self.path, "".join(set_aside(self.path, start)) if start else "")

    def write(self, records):
        if self.full or not records:
            return
        text = "".join(json.dumps(r, default=str) + "\n" for r in records)
        size = os.path.getsize(self.path) if os.path.exists(self.path) else 0
        if size + len(text) > self.cap:
            self.full = True
            print(f"note: {self.path} reached {self.cap >> 20} MiB; no more episodes are written to it")
            return
        append_lines(self.path, text)


def wandb_table(wandb, recs):
    """A wandb.Table of the steps of some episode records: one row per step."""
    cols = [
        "iteration",
        "traj",
        "step",
        "observation",
        "response",
        "action",
        "valid",
        "reward",
        "adv_episode",
        "adv_step",
        "adv",
    ]
    rows = [
        [
            r["iteration"],
            r["traj"],
            x["step"],
            x["anchor"],
            x["response"],
            x["action"],
            x["valid"],
            x["reward"],
            x.get("adv_episode"),
            x.get("adv_step"),
            x.get("adv"),
        ]
        for r in recs
        for x in r["steps"]
    ]
    return wandb.Table(columns=cols, data=rows)


# ---- the metrics line: phase timer, the training numbers, its keys, the progress bar and wandb ----
class Timer(dict):
    """Seconds per phase of one iteration: `with timer("update", device):` adds the block's seconds to
    timer["update"] (on CUDA once the device has finished the block's work); since_start() is the
    whole iteration so far."""

    def __init__(self):
        super().__init__()
        self.t0 = time.perf_counter()

    @contextlib.contextmanager
    def __call__(self, name, device=None):
        t0 = time.perf_counter()
        yield
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize()
        self[name] = self.get(name, 0.0) + time.perf_counter() - t0

    def since_start(self):
        return time.perf_counter() - self.t0


def training_metrics(samples, trained, episodes, n_dead, adv, old):
    """The iteration's training numbers (docs/training.md, "Metrics"). Summed over all ranks, then divided:
    episodes won, their returns and lengths, episodes, episode groups and those that won every
    episode, step samples (collected), valid ones, |rollout - training log-prob| over the trained
    response tokens that have rollout log-probs (old: the training model's; DAPO's dynamic sampling
    may leave none) and their count, episodes lost to dead workers. The token means (of the
    collected samples) and adv_abs (of the trained ones) are this rank's."""
    gap = torch.cat(
        [torch.zeros(0)]
        + [(o - torch.tensor(s.logprobs)).abs() for o, s in zip(old, trained) if s.logprobs is not None]
    )  # vLLM: one sample in engine.LOGP_EVERY
    lost = {e["group"] for e in episodes if not e["won"]}
    groups = {e["group"] for e in episodes}
    sums = {
        "won": sum(e["won"] for e in episodes),
        "return": sum(e["return"] for e in episodes),
        "groups": len(groups),
        "won_groups": len(groups - lost),
        "length": sum(e["length"] for e in episodes),
        "episodes": len(episodes),
        "samples": len(samples),
        "valid": sum(s.valid for s in samples),
        "gap": float(gap.sum()),
        "gap_tokens": len(gap),
        "worker_died": n_dead,
    }
    tot = dict(zip(sums, all_reduce(torch.tensor(list(sums.values()), dtype=torch.float64)).tolist()))
    return {
        "success": tot["won"] / tot["episodes"],
        "reward": tot["return"] / tot["episodes"],
        "won_group_frac": tot["won_groups"] / tot["groups"],
        "valid_ratio": tot["valid"] / tot["samples"],
        "episode_length": tot["length"] / tot["episodes"],
        "samples": tot["samples"],
        "worker_died": tot["worker_died"],
        "prompt_tokens": float(np.mean([len(s.prompt_ids) for s in samples])),
        "response_tokens": float(np.mean([len(s.response_ids) for s in samples])),
        "adv_abs": float(np.abs(adv).mean()) if len(adv) else 0.0,
        "logp_gap": tot["gap"] / max(tot["gap_tokens"], 1),
    }


# the metrics line's default keys (docs/training.md, "Metrics"): what a reader needs to judge a run;
# eval_success/SET (named eval sets) come with eval_success. --metrics all adds the rest: histograms,
# sub-timers, throughput, update details.
DEFAULT_METRICS = (
    "iteration",
    "success",
    "reward",
    "valid_ratio",
    "episode_length",
    "samples",
    "tokens",
    "zero_var_group_frac",
    "mean_step_group_size",
    "kl_ref",
    "entropy",
    "logp_gap",
    "loss",
    "grad_norm",
    "time_gen",
    "time_env",
    "time_update",
    "time_iteration",
    "eval_success",
    "wall",
)


def metrics_line(cfg, m):
    """All of an iteration's metrics -> those its metrics.jsonl line holds: every one under --metrics
    all; else DEFAULT_METRICS, eval_success/SET, and a feature's own keys while it is on."""
    if cfg.metrics == "all":
        return m
    feature = {
        "tis_weight": cfg.tis_cap > 0,
        "tis_trunc_frac": cfg.tis_cap > 0,
        "value_loss": cfg.algo == "ppo",
        "vf_clip_frac": cfg.algo == "ppo",
        "dropped_groups": cfg.dynamic_sampling,
        "worker_died": cfg.env_workers > 0,
        **{k: m.get(k) is not None for k in ("gpu_mem_gib", "gpu_alloc_gib")},  # on a GPU
    }
    return {
        k: v for k, v in m.items() if k in DEFAULT_METRICS or k.startswith("eval_success/") or feature.get(k)
    }


def progress_bar(start, iterations, rank):
    """The iterations after start, as a bar on rank 0 (show_progress writes its figures and lines)."""
    its = range(start + 1, iterations + 1)
    return tqdm(its, "train", initial=start, total=iterations, disable=rank != 0, dynamic_ncols=True)


def show_progress(bar, m, it, wandb, line):
    """Rank 0: the metrics to wandb (when asked), the live numbers on the bar, and with `line` a
    printed summary (the first iteration and every eval)."""
    if wandb:
        wandb.log({k: v for k, v in m.items() if isinstance(v, (int, float))}, step=it)
    ev = m["eval_success"]
    bar.set_postfix(
        success=f"{m['success']:.2f}",
        reward=f"{m['reward']:.2f}",
        valid=f"{m['valid_ratio']:.2f}",
        eval=ev if ev is None else f"{ev:.2f}",
        refresh=False,
    )
    if line:  # from the default keys: "rest" is the iteration less generation, env and update
        dt = m["time_iteration"]
        rest = dt - m["time_gen"] - m["time_env"] - m["time_update"]
        tqdm.write(
            f"it {it}: {int(m['samples'])} samples, {m['samples'] / dt:.0f} samples/s "
            f"| time gen {m['time_gen']:.2f}s env {m['time_env']:.2f}s update {m['time_update']:.2f}s "
            f"rest {rest:.2f}s | success {m['success']:.2f} valid {m['valid_ratio']:.2f} eval {ev}"
        )


def logged_rates(meta):
    """The eval rates a checkpoint's metrics line shows (eval_success, eval_success/SET...) as the dict
    train.metrics turns back into those keys: a resumed run's lines show the last eval until its next
    one, as a run left alone does. None (a fresh run) or a line before any eval -> {}."""
    m = json.loads((meta or {}).get("metrics_line") or "{}")
    sets = {k.split("/", 1)[1]: v for k, v in m.items() if k.startswith("eval_success/")}
    return sets or ({"held-out": m["eval_success"]} if m.get("eval_success") is not None else {})


def open_wandb(cfg):
    """--wandb 1 (rank 0): a Weights & Biases run with the config, its files under out_dir; where wandb
    cannot start (no API key, no network), one line before the model is built."""
    import wandb

    try:
        wandb.init(project="gigpo", config=dataclasses.asdict(cfg), dir=cfg.out_dir)
    except (wandb.errors.Error, OSError) as e:
        fail(
            f"--wandb 1: wandb could not start ({first_line(e)}); run `wandb login`, set WANDB_MODE=offline "
            "(no account or network), or drop --wandb"
        )
    return wandb
