"""The one-line checks of a run's flags (train.py's Config), before any heavy work.

A bad value that would only fail later would do so after minutes, mid-run, or as a stack trace:
here every bad input stops the run with one line that names the flag to change, before
metrics.jsonl is touched. The tests feed it bad flags (tests/test_checks.py, tests/test_train.py and
each env's tests). `fail` and `first_line` make that one line, here and wherever else a run stops
on bad input (a corrupt checkpoint, a model that does not load).
"""

import dataclasses
import math
import os
import sys
import tempfile

import torch

import gigpo
from engine import ENGINES
from envs import ENVS, env_module, make_env, parse_env_args
from memory import MEMORIES
from prompts import prompt_module

DEVICES = ("auto", "cpu", "cuda")


def fail(msg):
    """Stop with one line, printed by rank 0 only (under torchrun every rank checks the same flags)."""
    sys.exit(f"error: {msg}" if os.environ.get("RANK", "0") == "0" else 1)


def first_line(e):
    """An exception's message cut to its first line and sentence: what a one-line error can carry."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0].split(". ")[0][:200]


def idle_flags(cfg, defaults):
    """Flags set away from their default (defaults: train.py's Config under the env's preset) that the
    rest of cfg never reads -> one note each. A note, not an error: a sweep gives all its arms one set
    of flags (bench.pair's --similarity reaches its GRPO arm too)."""
    idle = {
        "similarity": (cfg.algo != "gigpo", f"--algo {cfg.algo} has no step groups"),
        "norm": (cfg.algo not in ("gigpo", "grpo"), f"--algo {cfg.algo} has no group normalization"),
        "memory_k": (cfg.memory in ("none", "full"), f"--memory {cfg.memory} has no length"),
        "overlap": (not cfg.env_workers, "envs stepped in-process have no wait to hide (--env_workers N)"),
    }
    show = lambda v: int(v) if isinstance(v, bool) else v  # noqa: E731  (a bool flag is given as 1 / 0)
    return [
        f"note: --{k} {show(getattr(cfg, k))} does nothing: {why}"
        for k, (unread, why) in idle.items()
        if unread and getattr(cfg, k) != getattr(defaults, k)
    ]


def check_config(cfg, defaults=None):
    """Bad input -> one line that names the flag, before any heavy work (and before metrics.jsonl
    is touched): a value that would only fail later would do so after minutes, mid-run. With
    defaults, a note (stderr, rank 0) for each flag given that does nothing (idle_flags)."""
    import ppo  # here, not at the top: ppo -> fsdp -> checks (fail)

    if defaults is not None and os.environ.get("RANK", "0") == "0":
        for note in idle_flags(cfg, defaults):
            print(note, file=sys.stderr)

    bad = fail
    for f in dataclasses.fields(cfg):  # nan / inf in any float flag ends as NaN weights
        value = getattr(cfg, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            bad(f"--{f.name} {value}: must be a finite number")
    for flag, names in (
        ("env", ENVS),
        ("memory", MEMORIES),
        ("algo", gigpo.ALGOS),
        ("norm", gigpo.NORMS),
        ("loss", ppo.LOSSES),
        ("engine", ENGINES),
        ("device", DEVICES),
        ("compile", ("auto", "1", "0")),
        ("metrics", ("default", "all")),
    ):
        if getattr(cfg, flag) not in names:
            bad(f"unknown {flag} {getattr(cfg, flag)!r}: use --{flag} with one of {', '.join(names)}")
    try:
        prompt_module(cfg.env, variant=cfg.prompt)
    except ValueError as e:
        bad(str(e))
    try:
        env_args = parse_env_args(cfg.env, cfg.env_args)
        # an env without data (no eval_sets hook: treasure, keydoor, sokoban) is cheap to build: build it
        # and reset it once (a value the room cannot hold, sokoban's boxes, fails there); those with data
        # build one in eval_plan below
        if env_args and not hasattr(env_module(cfg.env), "eval_sets"):
            make_env(cfg.env, **env_args).reset(seed=0)
    except ModuleNotFoundError as e:  # the env's own package (alfworld) is not installed
        bad(f"--env {cfg.env} needs the package {e.name!r}: pip install -r requirements.txt")
    except (ValueError, TypeError) as e:
        bad(str(e) if str(e).startswith("--env_args") else f"--env_args {cfg.env_args!r}: {e}")
    if cfg.group_size < 2 and (cfg.algo not in gigpo.BATCH_ALGOS or cfg.dynamic_sampling):
        bad(
            f"--group_size {cfg.group_size}: {'--dynamic_sampling 1' if cfg.dynamic_sampling else cfg.algo} "
            f"compares the envs of a group, use >= 2"
        )
    if not cfg.tied_step and cfg.algo != "gigpo":
        bad(
            "--tied_step 0 removes part of GiGPO's step advantage; "
            f"--algo {cfg.algo} has none: use --algo gigpo"
        )
    # a negative weight would reward what it is there to curb; a 0 keeps its meaning (off, greedy, none)
    for low, names in (
        (1, "n_groups iterations max_response_tokens mini_batch micro_batch_tokens eval_every"),
        (1, "eval_episodes threads"),
        (0, "seed memory_k env_workers kl_coef weight_decay lr_min clip_high entropy_coef time_limit"),
        (0, "save_every lora_rank eval_temperature log_groups"),
    ):
        for name in names.split():
            if getattr(cfg, name) < low:
                bad(f"--{name} {getattr(cfg, name)} must be >= {low}")
    if not cfg.temperature > 0:
        bad(
            f"--temperature {cfg.temperature} must be > 0: rollouts sample at it and the trainer divides "
            f"the logits by it (greedy is for evaluation: --eval_temperature 0)"
        )
    if not cfg.lr > 0:
        bad(f"--lr {cfg.lr} must be > 0")
    if cfg.lr_min > 1:
        bad(f"--lr_min {cfg.lr_min} must be <= 1: the cosine decay's floor, a share of --lr (1 = constant)")
    if not cfg.clip > 0:
        bad(f"--clip {cfg.clip} must be > 0")
    if cfg.lora_rank:
        import importlib.util

        if importlib.util.find_spec("peft") is None:
            bad("--lora_rank needs the package 'peft': pip install -r requirements.txt")
    if not cfg.tis_cap >= 0 or math.isinf(cfg.tis_cap):
        bad(f"--tis_cap {cfg.tis_cap} must be a finite number >= 0 (0 = off; a typical cap is 2)")
    if cfg.tis_cap and cfg.loss == "gspo":
        bad(f"--tis_cap {cfg.tis_cap} weighs tokens; --loss gspo has one ratio per sequence: use --tis_cap 0")
    if not 0 <= cfg.similarity <= 1:
        bad(f"--similarity {cfg.similarity} must be in [0, 1] (0 = exact anchor match)")
    if cfg.kv_cache_mb < 1 or not 0 <= cfg.gpu_memory_utilization < 1:
        bad("--kv_cache_mb must be >= 1 and --gpu_memory_utilization in [0, 1)")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        bad("--device cuda but no GPU is visible; use --device cpu")
    if cfg.eval_only and cfg.model == "tiny":
        bad("--eval_only evaluates a saved or hub model: give --model NAME_OR_PATH")
    from evaluate import eval_plan  # here, not at the top: evaluate -> records -> checks (fail)

    try:  # also: the env's data is there (ALFWorld lists its games here); --eval_sets names exist
        eval_plan(cfg)
    except FileNotFoundError as e:
        bad(str(e))
    except ValueError as e:  # an --eval_sets name, or (WebShop, Search: built here) a bad --env_args value
        bad(str(e) if str(e).startswith("--") else f"--env_args {cfg.env_args!r}: {e}")
    local = os.path.isabs(cfg.model) or cfg.model.startswith(".")
    if cfg.model != "tiny" and local and not os.path.isdir(cfg.model):
        bad(f"--model {cfg.model}: no such folder (give a saved model folder or a hub name)")
    made = not cfg.eval_only and not os.path.exists(cfg.out_dir)  # made below: gone again if --model fails
    if not cfg.eval_only:  # out_dir is written from the first iteration on: a folder we can write
        if os.path.exists(cfg.out_dir) and not os.path.isdir(cfg.out_dir):
            bad(f"--out_dir {cfg.out_dir} is a file, not a folder")
        try:
            os.makedirs(cfg.out_dir, exist_ok=True)
            tempfile.TemporaryFile(dir=cfg.out_dir).close()
        except OSError as e:
            bad(f"--out_dir {cfg.out_dir}: cannot write there ({e.strerror or first_line(e)})")
    if cfg.model != "tiny":  # last: a hub name is looked up (with retries when offline)
        from transformers import AutoConfig

        try:
            AutoConfig.from_pretrained(cfg.model)
        except Exception as e:  # transformers and the hub client say "not found" in many types
            if made and not os.listdir(cfg.out_dir):
                os.rmdir(cfg.out_dir)
            bad(f"--model {cfg.model}: {first_line(e)}")


def check_world(cfg, world):
    """The flags that depend on the number of ranks: one line if they do not fit it."""
    if cfg.n_groups % world:
        fail(f"--n_groups {cfg.n_groups} must divide over {world} ranks (each owns whole groups)")
