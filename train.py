"""Train an LLM agent with GiGPO (or GRPO, RLOO, PPO with a critic, REINFORCE++) in a multi-turn text env.

    python train.py                                  # the embedded default: tiny model, treasure game, CPU
    python train.py --algo grpo --seed 3             # any Config field below is a flag (--help: all)
    python train.py --env alfworld                   # the paper's ALFWorld setup (PRESETS below), one GPU
    torchrun --nproc_per_node=8 train.py --env alfworld                           # 8 GPUs of one machine
    torchrun --nnodes=2 --nproc_per_node=8 --node_rank=0 --rdzv_backend=c10d \\
        --rdzv_endpoint=HOST0:29500 train.py --env alfworld                      # machine 0 of 2

main() runs these numbered sections once per iteration:
  1. collect      n_groups x group_size envs, the envs of a group from one seed; every env step is a
                  sample: prompt ids, sampled response ids and their log-probs, reward (rollout.py)
  2. advantages   one per sample: GiGPO, GRPO, RLOO, REINFORCE++, or PPO's GAE on its critic's values
                  (gigpo.py); --dynamic_sampling 1 (DAPO) then drops the groups whose advantages are all 0
                  (GiGPO's A^S still ranks a tied group's steps; ppo and reinforce_pp have no group baseline)
  3. update       old log-probs recomputed by this model, then the PPO-style clipped step, token-mean
                  loss, optional KL to a frozen reference (ppo.py); a non-finite update stops the run
  4. push weights the new weights into the generation engine (engine.push_weights)
  5. eval         every `eval_every` and at the end: greedy on held-out seeds, or an env's own sets
                  (ALFWorld's splits at T=0.4), each reported apart (evaluate.py)
  6. log          the metrics line (docs/training.md, "Metrics"; records.py), then at an eval the checkpoint:
                  ckpt/ and model/ never lead the log; wandb, the progress bar
Below main: the helpers of its sections, then the command line (parse_args; its checks: checks.py).
"""

import contextlib
import dataclasses
import faulthandler
import inspect
import json
import math
import os
import random
import re
import signal
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

import gigpo
import records
from baselines import overlong_rewards, silent_groups
from checkpoint import (
    checkpoint_path,
    claim_out_dir,
    interrupted,
    kept_log,
    load_checkpoint,
    open_metrics_log,
    out_of_memory,
    save,
)
from checks import check_config, check_world, fail
from envs import GroupedEnvs, parse_env_args
from evaluate import (
    HELD_OUT,
    RandomBaseline,
    eval_plan,
    eval_what,
    evaluate,
    first_set,
    headline,
    success_text,
)
from fsdp import (
    all_finite,
    all_gather,
    all_reduce,
    balance_tokens,
    dist_on,
    finish_dist,
    full_parameters,
    setup_dist,
)
from memory import make_memory
from policy import (
    build_engine,
    build_policy,
    load_model,
    make_critic,
    make_optimizer,
    schedule_at,
    stretch_note,
)
from ppo import logprobs, state_values, update
from prompts import prompt_module
from rollout import rollout
from tiny import is_tiny


@dataclass
class Config:
    # ---- env, memory, groups
    env: str = "treasure"  # env name, see envs/__init__.py
    env_args: str = ""  # env constructor arguments, e.g. "size=6,walls=3,progress=0" (treasure)
    memory: str = "none"  # none | window | full | visited | boxes (Sokoban) (memory.py); the game is Markov
    memory_k: int = 0  # window length / positions shown; 0 = the memory's default (window: 2)
    n_groups: int = 32  # episode groups per iteration (paper: 16)
    group_size: int = 8  # envs per group, all started from the same seed (paper: 8)
    env_workers: int = 0  # env worker processes; 0 = step in-process (fine for the toy game)
    overlap: bool = False  # with env workers: step envs while the engine generates (no gain so far: docs)
    # ---- model and generation
    model: str = "tiny"  # "tiny" = built here from scratch (tiny.py), or an HF name/path
    prompt: str = ""  # a prompt variant of prompts/<env>.py (build_NAME), e.g. "choice" (ALFWorld:
    # answer with an action's number); "" = the tiny model's or the chat prompt
    temperature: float = 1.0  # rollout sampling temperature (paper: 1.0)
    max_response_tokens: int = 1  # tokens per step response: the tiny model says one word (paper: 512)
    engine: str = "auto"  # auto (hf for a model under 10M parameters on CPU, e.g. the tiny default; else
    # vllm where it imports and serves the model, else hf) | hf | vllm (rollout.py)
    kv_cache_mb: int = 1024  # vLLM on CPU (or GPU with --gpu_memory_utilization 0): KV cache size, MiB
    gpu_memory_utilization: float = 0.3  # vLLM on GPU: share of GPU memory it takes (weights + KV cache);
    # 0 = a fixed --kv_cache_mb cache, no start-up profiling (runs sharing a GPU)
    # ---- algorithm (gigpo.py; its fixed values, the paper's, by advantages() below: gamma, omega, penalty)
    algo: str = "gigpo"  # gigpo | grpo | rloo | ppo (a learned critic) | reinforce_pp (gigpo.ALGOS)
    tied_step: bool = True  # A^S also in episode groups whose scores all tie (paper); 0 = ablation: not there
    norm: str = "mean_norm"  # mean_norm (paper "w/o std") | mean_std_norm ("w/ std"; plateaus here, LOG.md)
    similarity: float = 0.0  # 0 = exact anchor match; else difflib ratio threshold for step groups
    # ---- optimisation
    iterations: int = 250  # training iterations (paper: 150)
    lr: float = 3e-3  # peak learning rate (paper: 1e-6 for 1.5B)
    lr_min: float = 0.1  # cosine decay to lr * lr_min at the end; 1.0 = constant (paper)
    weight_decay: float = 0.0  # AdamW weight decay (paper: 0.01)
    clip: float = 0.2  # PPO clip epsilon, the ratio's lower side 1 - clip (paper: 0.2; GSPO: 3e-4)
    clip_high: float = 0.0  # upper side 1 + clip_high; 0 = --clip (DAPO's clip-higher: 0.28; GSPO: 4e-4)
    loss: str = "ppo"  # ppo (token ratio) | gspo (one ratio per sequence; pass GSPO's --clip/--clip_high)
    dynamic_sampling: bool = False  # DAPO: drop episode groups whose scores all tie (advantage 0), no refill
    kl_coef: float = 0.0  # k3 KL to the frozen initial model; 0 = no reference (paper: 0.01)
    entropy_coef: float = 0.0  # entropy bonus (paper: 0.001)
    tis_cap: float = (
        0.0  # > 0: truncated importance sampling, token loss x min(pi_old / pi_rollout, cap) (verl: 2)
    )
    mini_batch: int = 512  # step samples per optimizer step (paper: 256)
    micro_batch_tokens: int = 8192  # tokens per forward/backward (padded rows on CPU, packed rows on GPU)
    grad_ckpt: bool = False  # activation checkpointing (saves memory on big models, costs ~1/3 more compute)
    compile: str = (
        "auto"  # 1: torch.compile each decoder layer of the trainer and, on GPU, vLLM's model | 0 |
    )
    # auto: 1 where vLLM generates on a GPU without --lora_rank, else 0 (docs/training.md)
    lora_rank: int = (
        0  # > 0: train LoRA adapters of this rank (peft, all linear layers) instead of all weights
    )
    # ---- evaluation, logging, io
    eval_every: int = 5  # evaluate (evaluate.py) every k iterations (and at the end); checkpoint there
    save_every: int = 0  # also checkpoint every k iterations, evaluated or not (0: only where above)
    eval_episodes: int = 256  # held-out seeds 10**9 + [0, n): the same set every run
    eval_temperature: float = 0.0  # 0 = greedy (paper: 0.4 sampled)
    seed: int = 0  # seeds torch, python and the training env seeds (train_seed)
    threads: int = 1  # torch CPU threads; 1: the tiny model's ops are too small to split, and 2 on a
    # loaded 2-core machine made default iterations 7x slower (docs/training.md)
    device: str = "auto"  # auto | cpu | cuda
    out_dir: str = "out"  # metrics.jsonl, episodes.jsonl, ckpt/ (to resume), model/ (HF format)
    wandb: bool = False  # log to Weights & Biases (rank 0): metrics, and a table of episodes at each eval
    metrics: str = "default"  # metrics.jsonl keys: default (what judges a run) | all (+ histograms,
    # sub-timers, throughput, update details; docs/training.md, "Metrics")
    log_groups: int = 1  # whole episodes to out_dir/episodes.jsonl: this many training groups per iteration,
    # 8x this many episodes per eval set (records.py); 0 = none
    resume: bool = False  # continue from out_dir/ckpt (same config; --iterations may grow)
    time_limit: float = 0.0  # minutes of this call's training: stop at the first iteration past them,
    # saved (not evaluated, unless an eval falls there; --resume goes on); 0 = none
    eval_only: bool = False  # load --model, evaluate it (as above), print the result, exit
    eval_sets: str = ""  # envs with named eval sets (alfworld): comma-separated names to run; "" = all


# Per-env presets: `--env NAME` applies its Config values first, then the flags (which still override).
PRESETS = {
    # the paper's ALFWorld setup: Qwen2.5-1.5B-Instruct, 16 groups x 8 envs of one game each, window
    # memory k = 2, 512 response tokens, constant lr 1e-6, KL 0.01, entropy 0.001, mean_std_norm, 150
    # iterations; evaluation at T = 0.4 on the whole valid_seen / valid_unseen splits every 10
    "alfworld": dict(
        model="Qwen/Qwen2.5-1.5B-Instruct",
        memory="window",
        memory_k=2,
        n_groups=16,
        group_size=8,
        env_workers=8,
        max_response_tokens=512,
        temperature=1.0,
        eval_temperature=0.4,
        iterations=150,
        lr=1e-6,
        lr_min=1.0,
        weight_decay=0.01,
        kl_coef=0.01,
        entropy_coef=0.001,
        mini_batch=256,
        norm="mean_std_norm",
        eval_every=10,
        eval_episodes=140,
        micro_batch_tokens=16384,
    ),
    # WebShop and Search-R1: the ALFWorld setup's prompt shape
    **{env: dict(memory="window", memory_k=2, max_response_tokens=512) for env in ("webshop", "search")},
}
TOP_P = 1.0  # rollout nucleus sampling: off, the whole distribution (paper: 1.0)


def main(argv=None):
    """One run: set-up, then sections 1-6 of the module docstring for every iteration -> the final
    eval success on rank 0 (None on the others)."""
    cfg, t_set_up = parse_args(sys.argv[1:] if argv is None else argv), [time.perf_counter()]
    check_config(cfg, env_defaults(cfg.env))
    meta = claim_out_dir(cfg)  # out_dir locked; a fresh run never writes over a run
    log_path, config = os.path.join(cfg.out_dir, "metrics.jsonl"), dataclasses.asdict(cfg)
    kept = kept_log(log_path, meta["iteration"], meta.get("metrics_line")) if meta else []
    rank, world, device = setup_dist(cfg)
    check_world(cfg, world)
    print0 = print if rank == 0 else (lambda *a, **k: None)
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed + rank)
    random.seed(cfg.seed + rank)
    # a pretrained model gets the chat prompt (instructions), the tiny one the bare observation
    prompt = prompt_module(cfg.env, chat=not is_tiny(cfg.model), variant=cfg.prompt)
    env_args = parse_env_args(cfg.env, cfg.env_args)
    eval_envs = held_out_envs(cfg, env_args) if rank == 0 else None
    if cfg.eval_only:
        return evaluate_only(cfg, rank, device, eval_envs, prompt)
    envs = GroupedEnvs(cfg.env, cfg.n_groups // world, cfg.group_size, workers=cfg.env_workers, **env_args)
    print0(f"config: {json.dumps(config)}\n{batch_arithmetic(cfg, world, envs)}")
    wandb = records.open_wandb(cfg) if cfg.wandb and rank == 0 else None  # before the build: fails fast
    t_set_up.append(time.perf_counter())
    if not meta or meta["iteration"] < cfg.iterations:  # env workers: the first games load beside the build
        envs.prefetch(rank_seeds(cfg, envs, rank, (meta["iteration"] if meta else 0) + 1))
    random_play = RandomBaseline(cfg, meta, eval_envs, rank)  # played beside the build and training
    model, tok, ref, engine, gen_model, packed = build_policy(cfg, device, world, print0)
    opt, sched = make_optimizer(cfg, model, device)
    critic = make_critic(cfg, model, device)
    extra = {"critic": critic} if critic else None
    start = resume(cfg, meta, model, opt, sched, rank, extra, engine, print0) if meta else 0
    t_set_up.append(time.perf_counter())
    random_play.set_up(print0, t_set_up, engine)
    log = open_metrics_log(cfg.out_dir, kept, start) if rank == 0 else None
    episode_log = records.EpisodeLog(cfg.out_dir, records.LOG_MB, start) if rank == 0 else None
    # shown: this iteration's recorded training episodes, wandb's table at the next eval
    shown, t_run, limit = [], time.perf_counter(), 60 * cfg.time_limit
    # the last eval's rates and iteration (logged: a resume's, in its lines until an eval); ckpt/'s iteration
    eval_rates, eval_it, logged, saved = {}, start, records.logged_rates(meta), start
    lp = dict(cfg=cfg, device=device, pad_id=tok.pad_token_id, packed=packed)  # the log-prob passes' inputs
    bar = records.progress_bar(start, cfg.iterations, rank)
    for it in bar:
        timer = records.Timer()
        # 1. collect: this rank's groups, each from its own seed; every env step is a sample
        samples, episodes, n_dead, timing = collect(cfg, envs, engine, tok, prompt, it, rank, saved)
        # 2. advantages (--algo ppo: GAE on the critic's values), a few whole groups recorded with GiGPO's
        #    view of each step; the update trains on all but DAPO's tied groups, tokens balanced over ranks
        with timer("update", device):
            values = state_values(model, critic, samples, **lp) if critic else None
        parts, targets, keep, adv_stats = advantages(cfg, samples, it, rank, values, tok.eos_token_id)
        if rank == 0 and cfg.log_groups:
            shown = record_groups(cfg, samples, parts, tok, it)
        trained, adv, targets = balance_tokens([samples[k] for k in keep], parts["adv"][keep], targets[keep])
        # 3. update: old (and reference) log-probs by the training model, then the clipped step
        evaluate_now, ahead = eval_ahead(cfg, it, rank, eval_envs)  # an eval's first games load meanwhile
        with timer("sync"):
            engine.sleep()  # vLLM on GPU: its memory goes to the update
        old, upd = update_policy(cfg, model, ref, opt, sched, critic, trained, adv, targets, lp, timer)
        stop_if_not_finite(model, critic, upd, it, cfg, saved)
        if rank == 0 and cfg.log_groups:  # written once the update is known finite, like everything else
            episode_log.write(shown)
        # 4. push weights into the engine (and reset its prefix cache)
        with timer("sync"):
            engine.wake()
            engine.push_weights(full_parameters(model))
        # 5. eval, every eval_every and at the end (rank 0; a few episodes of each set recorded)
        out_of_time = limit > 0 and all_reduce(time.perf_counter() - t_run, "max") > limit
        checkpoint = evaluate_now or out_of_time or (cfg.save_every and it % cfg.save_every == 0)
        if evaluate_now and rank == 0:
            eval_rates, eval_it = run_eval(cfg, tok, random_play, prompt, engine, it, episode_log, ahead), it
            if wandb and shown:
                wandb.log({"episodes": records.wandb_table(wandb, shown)}, step=it)
        # 6. log: the metrics line first, then the checkpoint (ckpt/ and model/ never lead the log)
        batch = (samples, trained, episodes, n_dead, adv, old)
        m = metrics(cfg, it, batch, {**adv_stats, **upd}, timing, timer, eval_rates or logged, t_run)
        if rank == 0:
            records.append_lines(log, json.dumps(m) + "\n")
        if checkpoint:
            notes = {"metrics_line": json.dumps(m), "random_policy": dict([random_play.result(print0)])}
            save(cfg.out_dir, it, model, tok, opt, sched, rank, config, gen_model, extra, notes)
            saved = it
        if rank == 0:
            records.show_progress(bar, m, it, wandb, line=it == start + 1 or it % cfg.eval_every == 0)
        if out_of_time and it < cfg.iterations:
            stop = f"after iteration {it} of {cfg.iterations} (--resume 1 goes on; saved, not evaluated)"
            print0(f"--time_limit {cfg.time_limit:g} min: stopped {stop}")
            break
    bar.close()
    envs.close()
    if rank == 0:
        if not eval_rates and saved >= cfg.iterations:  # resumed at the end: nothing trained, still report
            eval_rates = evaluate(tok, cfg, random_play.envs(print), prompt, engine, iteration=start)
        eval_envs and eval_envs.close()
        print(f"done in {time.perf_counter() - t_run:.0f}s; model saved to {cfg.out_dir}/model")
        if eval_rates:
            what = f"({eval_what(cfg)}; random policy {success_text(random_play.result(print0)[1])})"
            print(f"held-out success {success_text(eval_rates)} {what} at iteration {eval_it}")
    finish_dist(engine)
    return headline(eval_rates) if rank == 0 and eval_rates else None


# ---- the helpers of main's set-up and sections, in the order main calls them ----
def held_out_envs(cfg, env_args):
    """The held-out seeds' envs, one group of one each; None where the env has named eval sets (e.g.
    ALFWorld's splits: evaluate makes their envs)."""
    if "held-out" in eval_plan(cfg):
        return GroupedEnvs(cfg.env, cfg.eval_episodes, 1, workers=cfg.env_workers, **env_args)
    return None


def resume(cfg, meta, model, opt, sched, rank, extra, engine, print0):
    """--resume 1: the checkpoint's weights, optimizer and RNG in, its weights pushed to the engine ->
    the iteration it holds. A changed --iterations stretches the cosine (one line says by how much)."""
    start = load_checkpoint(checkpoint_path(cfg.out_dir), model, opt, sched, rank, meta, extra)
    for s in [sched] + ([extra["critic"].sched] if extra else []):  # the lr of this --iterations' schedule
        schedule_at(s, start)
    if start:
        engine.push_weights(full_parameters(model))
        print0(f"resumed from {checkpoint_path(cfg.out_dir)} at iteration {start}")
        if meta["config"]["iterations"] != cfg.iterations and cfg.lr_min != 1 and start < cfg.iterations:
            print0(stretch_note(cfg, meta["config"]["iterations"], start))
    return start


def collect(cfg, envs, engine, tok, prompt, it, rank, saved):
    """Section 1: this rank's groups play one batch, each group from its own seed -> (samples,
    episodes, episodes a dead env worker cut short, rollout timings). Every episode cut short (a full
    disk, an env that cannot start) stops the run in one line."""
    memories = [make_memory(cfg.memory, cfg.memory_k or None) for _ in range(envs.n)]
    samples, episodes, timing = rollout(
        envs,
        engine,
        tok,
        prompt,
        memories,
        rank_seeds(cfg, envs, rank, it),
        cfg.temperature,
        TOP_P,
        cfg.max_response_tokens,
        overlap=cfg.overlap,
    )
    if it < cfg.iterations:  # the env workers load the next iteration's games while this one updates
        envs.prefetch(rank_seeds(cfg, envs, rank, it + 1))
    samples, episodes, n_dead = drop_dead_workers(samples, episodes)
    if all_reduce(len(episodes)) == 0:
        sys.exit(
            f"error: iteration {it}: every episode was cut short by a dead env worker (the workers' "
            f"errors are above); out/ keeps iteration {saved}'s checkpoint (--resume 1 once fixed)"
        )
    return samples, episodes, n_dead, timing


def update_policy(cfg, model, ref, opt, sched, critic, trained, adv, targets, lp, timer):
    """Section 3: old (and KL reference) log-probs by the training model, then the clipped step ->
    (old log-probs, the update's metrics); then its cached GPU memory goes back to the card. Their
    seconds: time_logprobs (the reference's also time_ref_logprobs), within time_update."""
    device = lp["device"]
    with timer("update", device):
        with timer("logprobs", device):
            old, ref_lp = logprobs(model, trained, **lp), None
            if cfg.kl_coef > 0:  # the frozen copy, or with LoRA the model itself with its adapters off
                with (
                    timer("ref", device),
                    model.disable_adapter() if cfg.lora_rank else contextlib.nullcontext(),
                ):
                    ref_lp = logprobs(model if ref is None else ref, trained, **lp)
        upd = update(
            model, opt, sched, trained, old=old, ref=ref_lp, adv=adv, critic=critic, targets=targets, **lp
        )
    release_cached_memory(device)
    return old, upd


def release_cached_memory(device):
    """After the update, the blocks torch's allocator cached for it go back to the card: to vLLM's
    wake (a 1.5B update on an H200 left it no room otherwise) and to any other run on this GPU. A
    process keeps its cached blocks otherwise, even while generating: an engine with a fixed cache
    (--gpu_memory_utilization 0) never sleeps, and two bench.pair arms beside the clone's eval ran an
    H100 out of memory with 43.7 GiB reserved by one of them (gpu_mem_gib; gpu_alloc_gib is its peak
    in use)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def metrics(cfg, it, batch, stats, timing, timer, eval_rates, t_run):
    """Section 6: the metrics line (docs/training.md, "Metrics"): the default keys, or all (--metrics all).
    batch: (samples, trained samples, episodes, dead-worker episodes, advantages, old log-probs)."""
    dt, trained, gpu = timer.since_start(), batch[1], torch.cuda.is_initialized()
    summed = records.training_metrics(*batch)  # all ranks
    tokens = all_reduce(sum(len(s.prompt_ids) + len(s.response_ids) for s in trained))
    return records.metrics_line(
        cfg,
        {
            "iteration": it,
            **summed,
            "tokens": int(tokens),
            **stats,
            "time_gen": timing["gen"],
            "time_env": timing["env"],
            "time_rollout_other": timing["other"],
            "time_update": timer["update"],
            "time_logprobs": timer.get("logprobs", 0.0),
            "time_ref_logprobs": timer.get("ref", 0.0),
            "time_sync": timer["sync"],
            "time_iteration": dt,
            "samples_per_s": summed["samples"] / dt,
            "update_tokens_per_s": tokens / timer["update"],
            # the last eval's headline; named sets (ALFWorld): also eval_success/<set>[/<task type>]
            "eval_success": headline(eval_rates) if eval_rates else None,
            **{f"eval_success/{k}": v for k, v in eval_rates.items() if k != "held-out"},
            "wall": time.perf_counter() - t_run,
            # what sizes bench.sweep's --parallel on a shared GPU: torch's peak reserve in this process,
            # and its peak in use
            "gpu_mem_gib": torch.cuda.max_memory_reserved() / 2**30 if gpu else None,
            "gpu_alloc_gib": torch.cuda.max_memory_allocated() / 2**30 if gpu else None,
        },
    )


def eval_ahead(cfg, it, rank, eval_envs):
    """Whether iteration `it` ends in an eval (every eval_every and the last; not at a --time_limit
    stop) -> (that, its first named set's envs, made now so that their games load during the update:
    rank 0 with env workers; else {})."""
    now = it % cfg.eval_every == 0 or it == cfg.iterations
    return now, first_set(cfg, eval_envs) if now and rank == 0 else {}


def run_eval(cfg, tok, random_play, prompt, engine, it, episode_log, ahead):
    """Section 5: every eval set (evaluate.py), a few episodes of each recorded -> the rates. On the
    eval envs once the random policy's play on them has ended (random_play.envs()); ahead: eval_ahead's."""
    eval_envs = random_play.envs(print)

    def record(name, samples):
        episode_log.write(records.episodes(samples, tok, it, name, max_episodes=8 * cfg.log_groups))

    return evaluate(tok, cfg, eval_envs, prompt, engine, iteration=it, on_samples=record, ahead=ahead)


def evaluate_only(cfg, rank, device, eval_envs, prompt):
    """--eval_only: load --model, evaluate it as a run would (rank 0), print the result -> the headline."""
    t0, ahead = time.perf_counter(), first_set(cfg, eval_envs) if rank == 0 else {}  # loads during the build
    model, tok = load_model(cfg, device)
    engine = build_engine(cfg, model, tok, device)
    t1 = time.perf_counter()
    rates = evaluate(tok, cfg, eval_envs, prompt, engine, ahead=ahead) if rank == 0 else None
    if rank == 0:
        print(
            f"seconds: model and engine {t1 - t0:.1f}{f' ({engine.started})' if engine.started else ''}, "
            f"the eval (its envs too) {time.perf_counter() - t1:.1f}"
        )
        print(
            f"eval-only success {rates and success_text(rates)} ({eval_what(cfg)}; model {cfg.model}, "
            f"prompt {prompt.build.__module__}.{prompt.build.__name__})"
        )
        if any("/" in k for k in rates):  # named sets: per task type too (all of it in out_dir/eval.json)
            print("per task type: " + ", ".join(f"{k} {v:.3f}" for k, v in rates.items() if "/" in k))
    eval_envs and eval_envs.close()
    finish_dist(engine)
    return rates and headline(rates)


def batch_arithmetic(cfg, world, envs):
    """The batch arithmetic, printed once: episodes, step samples, optimizer steps, micro-batches."""
    max_steps = getattr(envs.envs[0], "max_steps", None) if envs.workers == 0 else None
    n_envs = cfg.n_groups * cfg.group_size
    return (
        f"batch: {cfg.n_groups} groups x {cfg.group_size} envs = {n_envs} episodes/iteration on {world} "
        f"rank(s); <= {max_steps or '?'} steps each -> <= {n_envs * (max_steps or 0) or '?'} step samples; "
        f"{cfg.mini_batch} samples/optimizer step in micro-batches of <= {cfg.micro_batch_tokens} tokens; "
        f"<= {cfg.max_response_tokens} response tokens/sample"
    )


def rank_seeds(cfg, envs, rank, it):
    """This rank's group seeds in iteration it: its groups are rank * local + j, j < local."""
    local = envs.n_groups
    return [train_seed(cfg.seed, it, g, cfg.n_groups) for g in range(rank * local, (rank + 1) * local)]


def train_seed(seed, it, g, n_groups):
    """The env seed of group g in iteration it: seed * 10**7 + it * n_groups + g. A value that
    reaches HELD_OUT moves up by HELD_OUT, past [HELD_OUT, 2 HELD_OUT), where the held-out seeds are:
    no --seed or --iterations trains on them (--seed 100 did); below it (the default run: 32..8031)
    the seed is unchanged."""
    raw = seed * 10**7 + it * n_groups + g
    return raw + HELD_OUT if raw >= HELD_OUT else raw


def drop_dead_workers(samples, episodes):
    """A dead env worker cut some episodes short (envs/vector.py): their returns say nothing about the
    policy, so they are neither trained on nor counted in success -> (samples, episodes, how many)."""
    dead = {i for i, e in enumerate(episodes) if e.get("worker_died")}
    return (
        [s for s in samples if s.traj not in dead],
        [e for e in episodes if not e.get("worker_died")],
        len(dead),
    )


# DAPO's overlong penalty, reward units: off (0); > 0 takes it off the rewards of replies cut at
# --max_response_tokens (DAPO: a soft ramp to 1 over the last 4096 tokens before its 20480 cap). No
# result here used it; the tiny model's one-word replies never reach EOS, so all of them would count as cut.
OVERLONG_PENALTY = 0.0


def shaped_rewards(cfg, samples, eos):
    """The rewards the advantages see: the env's, minus OVERLONG_PENALTY (DAPO) on replies cut at
    --max_response_tokens."""
    rewards = [s.reward for s in samples]
    if OVERLONG_PENALTY:
        rewards = overlong_rewards(
            rewards,
            [len(s.response_ids) for s in samples],
            [s.response_ids[-1:] == [eos] for s in samples],
            cfg.max_response_tokens,
            OVERLONG_PENALTY,
        )
    return rewards


# GiGPO's fixed values (the paper's) and --algo ppo's GAE lambda: gigpo.advantages' arguments
GAMMA = 0.95  # discount of step returns over an episode's turns (paper: 0.95)
OMEGA = 1.0  # weight of the step-level advantage A^S, A = A^E + omega A^S (paper: 1.0)
PENALTY = 0.1  # invalid-action penalty lambda, reward units, per invalid action (paper: 0.1)
GROUP_STATS = "step"  # episode-group statistics over step samples (the reference's); "traj": over
# trajectories, one R(tau) each (the paper's text; README, "Where we depart")
GAE_LAMBDA = 0.95  # --algo ppo: GAE lambda over env steps, 1 = returns, 0 = one-step TD (PPO paper: 0.95)


def advantages(cfg, samples, it, rank, values=None, eos=None):
    """-> (gigpo.advantages of this rank's samples: "adv", one per sample, and its parts; (N, 2) the
    critic's old value and lambda-return target per sample, zeros without one; the indices of the
    samples to train on: all, or under --dynamic_sampling 1 all but the groups whose advantages are
    all 0 (baselines.silent_groups); gigpo.advantage_stats of the groups + dropped_groups, for the log).
    OVERLONG_PENALTY (DAPO; off) comes off the cut replies' rewards first. BATCH_ALGOS (ppo, reinforce_pp)
    normalise over the whole batch: under torchrun, every rank's samples. NaN/inf rewards stop the run
    here, in one line (the last checkpoint stays)."""
    trajs, groups, anchors, valid = (
        [getattr(s, f) for s in samples] for f in ("traj", "group", "anchor", "valid")
    )
    rewards = shaped_rewards(cfg, samples, eos)
    cols, lo = [rewards, trajs, groups, anchors, valid, values], 0
    if cfg.algo in gigpo.BATCH_ALGOS and dist_on():  # every rank's samples, their ids tagged by rank
        ranks = all_gather(
            [list(rewards), [(rank, t) for t in trajs], [(rank, g) for g in groups], anchors, valid, values]
        )
        lo = sum(len(p[0]) for p in ranks[:rank])
        cols = [[x for p in ranks for x in p[k]] for k in range(5)] + [
            None if values is None else np.concatenate([p[5] for p in ranks])
        ]
    try:
        parts = gigpo.advantages(
            *cols[:5],
            algo=cfg.algo,
            gamma=GAMMA,
            omega=OMEGA,
            penalty=PENALTY,
            norm=cfg.norm,
            stats=GROUP_STATS,
            similarity=cfg.similarity or None,
            values=cols[5],
            gae_lambda=GAE_LAMBDA,
            tied_step=cfg.tied_step,
        )
    except ValueError as e:
        sys.exit(f"error: iteration {it}: {e}")
    parts = {k: v[lo : lo + len(samples)] if isinstance(v, np.ndarray) else v for k, v in parts.items()}
    targets = np.zeros((len(samples), 2))
    if "value_target" in parts:  # ppo: on the env's rewards (the invalid-action penalty shapes A only)
        targets[:, 0], targets[:, 1] = values, parts["value_target"]
    # DAPO's dynamic sampling drops a group only where its advantages are all 0 (silent_groups says why
    # not where its scores tie: GiGPO's A^S, and ppo's and reinforce_pp's batch baselines, still rank it)
    dropped = silent_groups(parts["adv"], groups) if cfg.dynamic_sampling else np.zeros(len(samples), bool)
    stats = gigpo.advantage_stats(parts["score"], groups, parts["step_group"])
    stats["dropped_groups"] = int(all_reduce(len({g for g, d in zip(groups, dropped) if d})))
    return parts, targets, np.flatnonzero(~dropped), stats


def record_groups(cfg, samples, parts, tok, it):
    """The first --log_groups training groups as whole episodes, with the advantage's parts at every
    step (advantages' `parts`; records.py)."""
    keep = set(sorted({s.group for s in samples})[: cfg.log_groups])
    ks = [k for k, s in enumerate(samples) if s.group in keep]
    return records.episodes(
        [samples[k] for k in ks], tok, it, "train", parts["adv"][ks], records.advantage_parts(parts, ks)
    )


def stop_if_not_finite(model, critic, upd, it, cfg, saved):
    """NaN/inf from any cause (a huge --lr, a bad input) stops the run here, before it reaches ckpt/ or
    model/, with one line that says which iteration they still hold."""
    finite = all_finite([*model.parameters(), *(critic.head.parameters() if critic else ())])
    if not (finite and math.isfinite(upd["loss"]) and math.isfinite(upd["grad_norm"])):
        fail(
            f"iteration {it}: non-finite update (loss {upd['loss']:.4g}, grad norm {upd['grad_norm']:.4g}, "
            f"weights {'finite' if finite else 'not finite'}); stopped before saving it: "
            + (
                f"{cfg.out_dir}/ckpt and model/ still hold iteration {saved}"
                if saved
                else "this run has saved nothing yet"
            )
            + " (a lower --lr may help)"
        )


# ---- the command line and its checks ----


def parse_args(argv):
    """--key value / --key=value for every Config field; anything else is an error. The chosen env's
    preset (PRESETS, e.g. the paper's ALFWorld setup) applies first, so flags still override."""
    fields, env = {f.name: f for f in dataclasses.fields(Config)}, Config.env
    for k, arg in enumerate(argv):
        if arg == "--env" and k + 1 < len(argv) or arg.startswith("--env="):
            env = arg[6:] if arg.startswith("--env=") else argv[k + 1]
    cfg = env_defaults(env)
    if "--help" in argv or "-h" in argv:  # each flag's meaning: the comment beside it in Config
        print(flag_help(dataclasses.replace(cfg, env=env)))
        sys.exit(0)
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            fail(f"unexpected argument {arg!r}; flags look like --name value")
        key, _, value = arg[2:].partition("=")
        if key not in fields:
            fail(f"unknown flag --{key}; known flags: {', '.join('--' + k for k in fields)}")
        if not _:
            if i + 1 >= len(argv):
                fail(f"flag --{key} needs a value")
            value, i = argv[i + 1], i + 1
        kind = type(getattr(cfg, key))
        if key == "compile":  # a str field (auto; check_config checks it) that takes the bool spellings too
            value = {"true": "1", "false": "0"}.get(value.lower(), value)
        try:
            if kind is bool:
                if value.lower() not in ("1", "0", "true", "false"):
                    raise ValueError
                value = value.lower() in ("1", "true")
            setattr(cfg, key, kind(value))
        except ValueError:
            fail(f"--{key} wants a {kind.__name__}, got {value!r}")
        i += 1
    return cfg


def env_defaults(env):
    """Config under env's preset (PRESETS): what a run of that env gets without flags."""
    return dataclasses.replace(Config(), **PRESETS.get(env, {}))


def flag_help(cfg):
    """--help's lines: each flag, its value in cfg (a bool as 1/0) and its meaning, the comment beside
    its Config field and on the comment lines after it (a section's title, "# ----", is no field's)."""
    notes, name = {}, None
    for line in inspect.getsource(Config).splitlines():
        name = m[1] if (m := re.match(r"    (\w+): ", line)) else name
        if "# " in line and "# ----" not in line:
            notes[name] = (notes.get(name, "") + " " + line.split("# ", 1)[1]).strip()
    show = lambda v: int(v) if isinstance(v, bool) else repr(v)  # noqa: E731
    head = (
        f"python train.py [--flag value ...]; the flags with --env {cfg.env}'s defaults, and what each means"
    )
    rows = [f"  {f'--{k} {show(v)}':<34} {notes.get(k, '')}" for k, v in dataclasses.asdict(cfg).items()]
    return "\n".join([head, *rows])


def _interrupt(signum, frame):
    raise KeyboardInterrupt  # SIGTERM (a scheduler's kill) ends like Ctrl-C: env workers stopped, one line


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _interrupt)
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 PID`: every thread's stack to stderr (a hung run)
    try:
        main()
    except KeyboardInterrupt:  # Ctrl-C: one line that says what is kept, not a traceback
        print(file=sys.stderr)  # below the progress bar's line
        fail(interrupted(parse_args(sys.argv[1:]).out_dir))
    except torch.OutOfMemoryError as e:  # the rank it struck says so (fail() speaks for rank 0 only)
        sys.exit(f"error: {out_of_memory(e, parse_args(sys.argv[1:]).out_dir)}")
