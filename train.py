"""Train an LLM agent with GiGPO (or GRPO / RLOO) in a multi-turn text env.

    python train.py                                  # the embedded default: tiny model, treasure game, CPU
    python train.py --algo grpo --seed 3             # any Config field below is a flag
    python train.py --model Qwen/Qwen2.5-1.5B-Instruct --lr 1e-6 ...   # any HF causal LM

One iteration: collect (rollout.py) -> advantages (gigpo.py) -> PPO-style update (old log-probs
recomputed by this model; token-mean loss; optional KL to a frozen reference) -> push weights to the
engine -> log -> greedy evaluation on held-out seeds every `eval_every` -> save.
"""
import copy
import dataclasses
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

import gigpo
from envs import ENVS, GroupedEnvs
from memory import MEMORIES, make_memory
from prompts import prompt_module
from rollout import HFEngine, rollout


@dataclass
class Config:
    # env, memory, groups
    env: str = "treasure"          # env name, see envs/__init__.py
    memory: str = "none"           # none | window | full | visited (memory.py); the game is Markov
    memory_k: int = 0              # window length / positions shown; 0 = the memory's default (window: 2)
    n_groups: int = 32             # episode groups per iteration (paper: 16)
    group_size: int = 8            # envs per group, all started from the same seed (paper: 8)
    env_workers: int = 0           # env worker processes; 0 = step in-process (fine for the toy game)
    # model and generation
    model: str = "tiny"            # "tiny" = built here from scratch (tiny.py), or an HF name/path
    tiny_hidden: int = 64          # tiny model: hidden size (head_dim = hidden / heads >= 32 for vLLM CPU)
    tiny_layers: int = 2           # tiny model: decoder layers
    tiny_heads: int = 2            # tiny model: attention heads
    temperature: float = 1.0       # rollout sampling temperature (paper: 1.0)
    top_p: float = 1.0             # rollout nucleus sampling
    max_response_tokens: int = 3   # tokens per step response (paper: 512)
    # algorithm (gigpo.py)
    algo: str = "gigpo"            # gigpo | grpo | rloo
    gamma: float = 0.95            # discount of step returns (paper: 0.95)
    omega: float = 1.0             # weight of the step-level advantage (paper: 1.0)
    penalty: float = 0.1           # invalid-action penalty lambda (paper: 0.1)
    norm: str = "mean_norm"        # mean_norm (paper "w/o std") | mean_std_norm ("w/ std"; plateaus here, README)
    stats: str = "step"            # episode-group statistics over step samples (reference) | traj (paper text)
    similarity: float = 0.0        # 0 = exact anchor match; else difflib ratio threshold for step groups
    # optimisation
    iterations: int = 200          # training iterations (paper: 150)
    lr: float = 3e-3               # peak learning rate (paper: 1e-6 for 1.5B)
    lr_min: float = 0.1            # cosine decay to lr * lr_min at the end; 1.0 = constant (paper)
    weight_decay: float = 0.0      # AdamW weight decay (paper: 0.01)
    grad_clip: float = 1.0         # max grad norm (paper: 1.0)
    clip: float = 0.2              # PPO clip epsilon (paper: 0.2)
    dual_clip: float = 3.0         # dual-clip c for negative advantages; 0 = off (paper: 3)
    kl_coef: float = 0.0           # k3 KL to the frozen initial model; 0 = no reference (paper: 0.01)
    entropy_coef: float = 0.0      # entropy bonus (paper: 0.001)
    ppo_epochs: int = 1            # passes over each batch (paper: 1)
    mini_batch: int = 512          # step samples per optimizer step (paper: 256)
    micro_batch: int = 512         # step samples per forward/backward (paper: 32 per GPU)
    # evaluation, logging, io
    eval_every: int = 5            # greedy eval on held-out seeds every k iterations (and at the end)
    eval_episodes: int = 256       # held-out seeds 10**9 + [0, n): the same set every run
    eval_temperature: float = 0.0  # 0 = greedy (paper: 0.4 sampled)
    seed: int = 0                  # seeds torch, python and the training env seeds
    train_seeds: int = 0           # 0 = fresh env seeds every iteration; N = cycle N fixed tasks (overfit check)
    threads: int = 2               # torch CPU threads
    device: str = "auto"           # auto | cpu | cuda
    out_dir: str = "out"           # metrics.jsonl, ckpt.pt, model/ (HF format)
    wandb: bool = False            # log to Weights & Biases (rank 0)


def parse_args(argv):
    """--key value / --key=value for every Config field; anything else is an error."""
    cfg, fields = Config(), {f.name: f for f in dataclasses.fields(Config)}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            sys.exit(f"error: unexpected argument {arg!r}; flags look like --name value")
        key, _, value = arg[2:].partition("=")
        if key not in fields:
            sys.exit(f"error: unknown flag --{key}; known flags: {', '.join('--' + k for k in fields)}")
        if not _:
            if i + 1 >= len(argv):
                sys.exit(f"error: flag --{key} needs a value")
            value, i = argv[i + 1], i + 1
        kind = type(getattr(cfg, key))
        try:
            if kind is bool:
                if value.lower() not in ("1", "0", "true", "false"):
                    raise ValueError
                value = value.lower() in ("1", "true")
            setattr(cfg, key, kind(value))
        except ValueError:
            sys.exit(f"error: --{key} wants a {kind.__name__}, got {value!r}")
        i += 1
    return cfg


def check_config(cfg):
    """Bad input -> one line that names the flag, before any heavy work."""
    def bad(msg):
        sys.exit(f"error: {msg}")
    if cfg.env not in ENVS:
        bad(f"unknown env {cfg.env!r}: use --env with one of {sorted(ENVS)}")
    if cfg.memory not in MEMORIES:
        bad(f"unknown memory {cfg.memory!r}: use --memory with one of {sorted(MEMORIES)}")
    if cfg.algo not in ("gigpo", "grpo", "rloo"):
        bad(f"unknown algo {cfg.algo!r}: use --algo gigpo, grpo or rloo")
    if cfg.norm not in ("mean_norm", "mean_std_norm"):
        bad(f"unknown norm {cfg.norm!r}: use --norm mean_std_norm or mean_norm")
    if cfg.stats not in ("step", "traj"):
        bad(f"unknown stats {cfg.stats!r}: use --stats step or traj")
    if cfg.group_size < 2:
        bad(f"--group_size {cfg.group_size}: {cfg.algo} compares the envs of a group, use >= 2")
    if cfg.n_groups < 1 or cfg.iterations < 1 or cfg.max_response_tokens < 1:
        bad("--n_groups, --iterations and --max_response_tokens must be >= 1")
    if cfg.micro_batch < 1 or cfg.mini_batch < 1 or cfg.mini_batch % cfg.micro_batch:
        bad(f"--mini_batch {cfg.mini_batch} must be a positive multiple of --micro_batch {cfg.micro_batch}")
    if not 0 <= cfg.similarity <= 1:
        bad(f"--similarity {cfg.similarity} must be in [0, 1] (0 = exact anchor match)")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        bad("--device cuda but no GPU is visible; use --device cpu")


def load_model(cfg, device):
    if cfg.model == "tiny":
        from tiny import build_tiny
        model, tok = build_tiny(cfg.env, cfg.tiny_hidden, cfg.tiny_layers, cfg.tiny_heads, seed=cfg.seed)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        tok = AutoTokenizer.from_pretrained(cfg.model)
        model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=dtype)
        if tok.pad_token_id is None:
            tok.pad_token = tok.eos_token
    return model.to(device), tok


def token_logprobs(model, ids, attn, temperature=1.0):
    """Log-prob of every next token and the entropy of each prediction: (B, T-1) each."""
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()   # (B, T-1, V)
    logp_all = torch.log_softmax(logits / temperature, -1)
    logp = logp_all.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)            # (B, T-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)                              # (B, T-1)
    return logp, entropy


def collate(samples, pad_id):
    """Samples -> right-padded tensors. resp: (B, T-1) mask of positions that predict a response token."""
    width = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    B = len(samples)
    ids = torch.full((B, width), pad_id, dtype=torch.long)
    attn = torch.zeros(B, width, dtype=torch.long)
    resp = torch.zeros(B, width - 1)
    rollout_logp = torch.zeros(B, width - 1)
    for b, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        ids[b, :p + r] = torch.tensor(s.prompt_ids + s.response_ids)
        attn[b, :p + r] = 1
        resp[b, p - 1:p - 1 + r] = 1
        rollout_logp[b, p - 1:p - 1 + r] = torch.tensor(s.logprobs)
    return ids, attn, resp, rollout_logp


def micro_batches(idx, size, ids, attn):
    """Split sample indices into micro-batches, trimming each to its own longest sequence."""
    for k in range(0, len(idx), size):
        mb = idx[k:k + size]
        width = int(attn[mb].sum(1).max())
        yield mb, ids[mb, :width], attn[mb, :width], width


@torch.no_grad()
def score(model, ids, attn, cfg, device):
    """Log-probs of all sequences under `model`, in micro-batches: (B, T-1)."""
    out = torch.zeros(ids.shape[0], ids.shape[1] - 1)
    for mb, x, a, w in micro_batches(torch.arange(ids.shape[0]), cfg.micro_batch, ids, attn):
        out[mb, :w - 1] = token_logprobs(model, x.to(device), a.to(device), cfg.temperature)[0].cpu()
    return out


def update(model, ref, opt, sched, batch, cfg, device):
    """PPO-style clipped update over the batch -> metrics. Token-mean: each mini-batch's loss is the
    sum over its response tokens divided by its token count, however it splits into micro-batches."""
    ids, attn, resp, old_logp, ref_logp, adv = batch
    stats = {"loss": 0.0, "clip_frac": 0.0, "kl_ref": 0.0, "entropy": 0.0, "grad_norm": 0.0}
    n_steps = 0
    for _ in range(cfg.ppo_epochs):
        perm = torch.randperm(ids.shape[0])
        for k in range(0, len(perm), cfg.mini_batch):
            mini = perm[k:k + cfg.mini_batch]
            n_tok = resp[mini].sum().clamp(min=1).to(device)
            opt.zero_grad(set_to_none=True)
            acc = {key: torch.zeros((), device=device) for key in ("loss", "clip_frac", "kl_ref", "entropy")}
            for mb, x, a, w in micro_batches(mini, cfg.micro_batch, ids, attn):
                m = resp[mb, :w - 1].to(device)                                           # (b, w-1)
                logp, ent = token_logprobs(model, x.to(device), a.to(device), cfg.temperature)
                loss, pst = gigpo.policy_loss(logp, old_logp[mb, :w - 1].to(device), adv[mb].to(device),
                                              m, cfg.clip, cfg.dual_clip or None, token_count=n_tok)
                ent_sum = (ent * m).sum() / n_tok
                loss = loss - cfg.entropy_coef * ent_sum
                if ref is not None:
                    kl = (gigpo.kl_k3(logp, ref_logp[mb, :w - 1].to(device)) * m).sum() / n_tok
                    loss = loss + cfg.kl_coef * kl
                    acc["kl_ref"] += kl.detach()
                loss.backward()
                acc["loss"] += loss.detach()
                acc["entropy"] += ent_sum.detach()
                acc["clip_frac"] += pst["clip_frac"] * (m.sum() / n_tok)
            gn = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
            for key in acc:
                stats[key] += acc[key]
            stats["grad_norm"] += gn.detach()
            n_steps += 1
    sched.step()
    return {k: float(v) / max(n_steps, 1) for k, v in stats.items()} | {"optimizer_steps": n_steps}


def evaluate(tok, cfg, envs, prompt, engine):
    """Greedy (or eval_temperature) episodes on the held-out seeds -> success rate."""
    memories = [make_memory(cfg.memory, cfg.memory_k or None) for _ in range(envs.n)]
    seeds = [10**9 + k for k in range(envs.n_groups)]
    _, episodes, _ = rollout(envs, engine, tok, prompt, memories, seeds, cfg.eval_temperature,
                             1.0, cfg.max_response_tokens)
    return float(np.mean([e["won"] for e in episodes]))


def random_policy_success(cfg, envs):
    """The same held-out seeds played by a uniformly random admissible action."""
    rng, wins = random.Random(0), []
    obs, infos = envs.reset([10**9 + k for k in range(envs.n_groups)])
    active = list(range(envs.n))
    while active:
        res = envs.step({i: rng.choice(infos[i]["admissible_actions"]) for i in active})
        for i, (o, r, term, trunc, info) in res.items():
            infos[i] = info
            if term or trunc:
                wins.append(bool(info.get("won")))
        active = [i for i in active if not (res[i][2] or res[i][3])]
    return float(np.mean(wins))


def save(model, tok, opt, cfg, it, out_dir):
    """Resumable checkpoint + HF-format model, each written to a temp name then renamed, so a crash
    mid-write never destroys the last good one."""
    os.makedirs(out_dir, exist_ok=True)
    ckpt = {"model": model.state_dict(), "optimizer": opt.state_dict(), "iteration": it,
            "config": dataclasses.asdict(cfg), "rng": {"torch": torch.get_rng_state(),
                                                       "python": random.getstate()}}
    torch.save(ckpt, os.path.join(out_dir, "ckpt.pt.tmp"))
    os.replace(os.path.join(out_dir, "ckpt.pt.tmp"), os.path.join(out_dir, "ckpt.pt"))
    tmp, final, old = (os.path.join(out_dir, n) for n in ("model.tmp", "model", "model.old"))
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    if os.path.exists(final):
        os.replace(final, old)
    os.replace(tmp, final)
    if os.path.exists(old):
        import shutil
        shutil.rmtree(old)


def main(argv=None):
    cfg = parse_args(sys.argv[1:] if argv is None else argv)
    check_config(cfg)
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    device = torch.device("cuda" if cfg.device == "auto" and torch.cuda.is_available() else
                          "cpu" if cfg.device == "auto" else cfg.device)
    prompt = prompt_module(cfg.env)
    envs = GroupedEnvs(cfg.env, cfg.n_groups, cfg.group_size, workers=cfg.env_workers)
    eval_envs = GroupedEnvs(cfg.env, cfg.eval_episodes, 1, workers=cfg.env_workers)
    max_steps = getattr(envs.envs[0], "max_steps", None) if envs.workers == 0 else None

    # the batch arithmetic, printed once
    n_envs = cfg.n_groups * cfg.group_size
    print(f"config: {json.dumps(dataclasses.asdict(cfg))}")
    print(f"batch: {cfg.n_groups} groups x {cfg.group_size} envs = {n_envs} episodes/iteration; "
          f"<= {max_steps or '?'} steps each -> <= {n_envs * (max_steps or 0) or '?'} step samples; "
          f"{cfg.mini_batch} samples/optimizer step in micro-batches of {cfg.micro_batch}; "
          f"<= {cfg.max_response_tokens} response tokens/sample")

    model, tok = load_model(cfg, device)
    engine = HFEngine(model, tok)
    ref = copy.deepcopy(model).eval().requires_grad_(False) if cfg.kl_coef > 0 else None
    print(f"model: {cfg.model}, {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, "
          f"vocab {len(tok)}, device {device}")
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda it: cfg.lr_min + (1 - cfg.lr_min) * 0.5 * (
        1 + math.cos(math.pi * min(it, cfg.iterations) / cfg.iterations)))
    baseline = random_policy_success(cfg, eval_envs)
    print(f"random policy on the {cfg.eval_episodes} held-out seeds: success {baseline:.3f}")

    os.makedirs(cfg.out_dir, exist_ok=True)
    log = open(os.path.join(cfg.out_dir, "metrics.jsonl"), "w")
    wandb = None
    if cfg.wandb:
        import wandb
        wandb.init(project="gigpo", config=dataclasses.asdict(cfg))
    t_run = time.perf_counter()
    eval_success = None
    bar = tqdm(range(1, cfg.iterations + 1), desc="train", dynamic_ncols=True)
    for it in bar:
        t_it = time.perf_counter()
        memories = [make_memory(cfg.memory, cfg.memory_k or None) for _ in range(n_envs)]
        base = cfg.seed * 10**7
        seeds = [base + (g % cfg.train_seeds if cfg.train_seeds else it * cfg.n_groups + g)
                 for g in range(cfg.n_groups)]
        samples, episodes, timing = rollout(envs, engine, tok, prompt, memories, seeds, cfg.temperature,
                                            cfg.top_p, cfg.max_response_tokens)
        rewards, trajs, groups, anchors, valid = (
            [getattr(s, f) for s in samples] for f in ("reward", "traj", "group", "anchor", "valid"))
        try:  # NaN/inf rewards fail here, loudly, in one line (the last checkpoint stays)
            adv = gigpo.compute_advantages(
                rewards, trajs, groups, anchors, valid, algo=cfg.algo, gamma=cfg.gamma, omega=cfg.omega,
                penalty=cfg.penalty, norm=cfg.norm, stats=cfg.stats, similarity=cfg.similarity or None)
        except ValueError as e:
            sys.exit(f"error: iteration {it}: {e}")
        # diagnostics only: compute_advantages keeps its intermediates private (a pure one-call API)
        step_groups = gigpo.step_groups(anchors, groups, cfg.similarity or None)
        scores = gigpo.episode_scores(rewards, trajs, valid, cfg.penalty)
        adv_stats = gigpo.advantage_stats(scores, groups, step_groups)

        t0 = time.perf_counter()
        ids, attn, resp, rollout_logp = collate(samples, tok.pad_token_id)
        old_logp = score(model, ids, attn, cfg, device)
        ref_logp = score(ref, ids, attn, cfg, device) if ref is not None else None
        logp_gap = float(((old_logp - rollout_logp).abs() * resp).sum() / resp.sum())
        upd = update(model, ref, opt, sched, (ids, attn, resp, old_logp, ref_logp,
                                              torch.tensor(adv, dtype=torch.float32)), cfg, device)
        t_update = time.perf_counter() - t0
        t0 = time.perf_counter()
        engine.load_weights(model.state_dict())
        t_sync = time.perf_counter() - t0

        if it % cfg.eval_every == 0 or it == cfg.iterations:
            eval_success = evaluate(tok, cfg, eval_envs, prompt, engine)
            save(model, tok, opt, cfg, it, cfg.out_dir)
        dt = time.perf_counter() - t_it
        m = {
            "iteration": it, "success": np.mean([e["won"] for e in episodes]),
            "reward": np.mean([e["return"] for e in episodes]),
            "valid_ratio": np.mean([s.valid for s in samples]),
            "episode_length": np.mean([e["length"] for e in episodes]),
            "samples": len(samples), "prompt_tokens": np.mean([len(s.prompt_ids) for s in samples]),
            "response_tokens": np.mean([len(s.response_ids) for s in samples]),
            "adv_abs": float(np.abs(adv).mean()), "logp_gap": logp_gap, "lr": sched.get_last_lr()[0],
            **{k: v for k, v in adv_stats.items() if k != "step_group_size_hist"},
            "step_group_size_hist": adv_stats.get("step_group_size_hist"),
            **upd, "time_gen": timing["gen"], "time_env": timing["env"],
            "time_rollout_other": timing["other"], "time_update": t_update, "time_sync": t_sync,
            "time_iteration": dt, "samples_per_s": len(samples) / dt,
            "eval_success": eval_success, "wall": time.perf_counter() - t_run,
        }
        m = {k: (float(v) if isinstance(v, (np.floating, np.integer)) else v) for k, v in m.items()}
        log.write(json.dumps(m) + "\n")
        log.flush()
        if wandb:
            wandb.log({k: v for k, v in m.items() if isinstance(v, (int, float))}, step=it)
        bar.set_postfix(success=f"{m['success']:.2f}", reward=f"{m['reward']:.2f}",
                        valid=f"{m['valid_ratio']:.2f}", eval=eval_success if eval_success is None
                        else f"{eval_success:.2f}", refresh=False)
        if it == 1 or it % cfg.eval_every == 0:
            tqdm.write(f"it {it}: {len(samples)} samples, {m['samples_per_s']:.0f} samples/s | time gen "
                       f"{timing['gen']:.2f}s env {timing['env']:.2f}s update {t_update:.2f}s "
                       f"other {timing['other']:.2f}s | success {m['success']:.2f} valid "
                       f"{m['valid_ratio']:.2f} eval {eval_success}")
    bar.close()
    log.close()
    envs.close()
    eval_envs.close()
    print(f"done in {time.perf_counter() - t_run:.0f}s; model saved to {cfg.out_dir}/model")
    print(f"held-out success {eval_success:.3f} ({cfg.eval_episodes} seeds, "
          f"{'greedy' if cfg.eval_temperature == 0 else f'T={cfg.eval_temperature}'}; "
          f"random policy {baseline:.3f})")
    return eval_success


if __name__ == "__main__":
    main()
