"""What a run trains: the model (LoRA adapters, sharded, compiled), its tokenizer, the frozen KL
reference, the generation engine built beside it, the optimizer and its cosine lr schedule, and
--algo ppo's critic. train.main builds them once at start (build_policy, make_optimizer, make_critic).
"""

import copy
import math
import warnings

import torch

from checks import fail, first_line
from engine import LOGP_EVERY, make_engine
from envs import parse_env_args
from fsdp import PACKED_ATTN, add_lora, attn_implementation, dist_on, shard
from ppo import Critic


def load_model(cfg, device):
    """--model: "tiny" (built here, tiny.py) or an HF name or path, float32, on `device` -> (model, tok)."""
    if cfg.model == "tiny":
        from tiny import build_tiny

        model, tok = build_tiny(cfg.env, seed=cfg.seed, env_kwargs=parse_env_args(cfg.env, cfg.env_args))
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        # fp32 master weights (FSDP2 computes in bf16 on GPU); packed varlen attention on GPU (fsdp.py)
        try:
            tok = AutoTokenizer.from_pretrained(cfg.model)
            model = AutoModelForCausalLM.from_pretrained(
                cfg.model, dtype=torch.float32, attn_implementation=attn_implementation(device)
            )
        except (OSError, ValueError) as e:  # e.g. a folder with a config but no weights or tokenizer
            fail(f"--model {cfg.model}: {first_line(e)}")
        if tok.pad_token_id is None:
            tok.pad_token = tok.eos_token
    return model.to(device), tok


def build_policy(cfg, device, world, print0):
    """-> the model to train (with LoRA adapters under --lora_rank; sharded), its tokenizer, the frozen
    KL reference, compiled alike (None without --kl_coef, or with LoRA: then the adapters are off),
    the generation engine, the engine's own model copy where it has one (saved as model/), and
    whether micro-batches are packed rows (varlen attention) rather than padded ones."""
    model, tok = load_model(cfg, device)
    packed = getattr(model.config, "_attn_implementation", "") in PACKED_ATTN
    distributed = dist_on()
    # sharded training weights: a transformers engine gets its own full copy (FSDP2 all-gathers on
    # every forward, so generating from the sharded module would hang as soon as ranks play
    # different numbers of steps)
    copy_dtype = (torch.bfloat16 if device.type == "cuda" else torch.float32) if distributed else None
    engine = build_engine(cfg, model, tok, device, copy_dtype)
    gen_model = engine.own_model
    if cfg.lora_rank:  # after the engine is built from the plain model; the KL reference = adapters off
        model = add_lora(model, cfg.lora_rank)
    ref = copy.deepcopy(model).eval().requires_grad_(False) if cfg.kl_coef > 0 and not cfg.lora_rank else None
    lora = (
        f" ({sum(p.numel() for p in model.parameters() if p.requires_grad) / 1e6:.3f}M in LoRA adapters)"
        if cfg.lora_rank
        else ""
    )
    print0(
        f"model: {cfg.model}, {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters{lora}, "
        f"vocab {len(tok)}, device {device}{f', FSDP2 over {world} rank(s)' if distributed else ''}, "
        f"engine {engine.name}"
    )
    compile_layers = compiled(cfg, device, engine)  # the policy's and the reference's alike
    model = shard(model, device, cfg.grad_ckpt, compile_layers=compile_layers)
    ref = shard(ref, device, compile_layers=compile_layers) if ref is not None else None
    return model, tok, ref, engine, gen_model, packed


def build_engine(cfg, model, tok, device, copy_dtype=None):
    """The generation engine for this model (--engine, engine.make_engine): rollout log-probs for one
    sample in LOGP_EVERY, or all of them under --tis_cap (an evaluation reads none)."""
    kw = dict(kv_cache_mb=cfg.kv_cache_mb, gpu_memory_utilization=cfg.gpu_memory_utilization)
    logp_every = 1 if cfg.tis_cap > 0 else LOGP_EVERY
    return make_engine(cfg.engine, model, tok, **kw, copy_dtype=copy_dtype, compile=compiled(cfg, device),
                       logp_every=logp_every)  # fmt: skip


def compiled(cfg, device, engine=None):
    """--compile 1 | 0 | auto -> whether to compile. auto: where vLLM generates on a GPU (given the
    engine: the one built; before it: where one would be), and not with LoRA adapters. Compile won
    every GPU measurement of the vLLM engine and the FSDP update; it was never measured with LoRA
    (`--compile 1` with LoRA computes what the plain layers do, adapters off for the KL reference
    too: tests/test_dist.py) or with `--engine hf` on a GPU, whose generate runs on the trainer's
    own layers."""
    if cfg.compile != "auto":
        return cfg.compile == "1"
    vllm = cfg.engine != "hf" if engine is None else not engine.shares_layers
    return device.type == "cuda" and vllm and not cfg.lora_rank


def make_optimizer(cfg, model, device):
    """AdamW on the trainable weights; the lr follows a cosine from --lr to --lr x --lr_min over the run."""
    opt = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        fused=device.type == "cuda",
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda it: lr_scale(it, cfg.iterations, cfg.lr_min))
    return opt, sched


def lr_scale(it, iterations, lr_min):
    """The lr after `it` steps, as a share of --lr: a cosine from 1 to lr_min over `iterations`."""
    return lr_min + (1 - lr_min) * 0.5 * (1 + math.cos(math.pi * min(it, iterations) / iterations))


def schedule_at(sched, it):
    """Set the optimizer's lr to the schedule's after `it` steps, over this run's --iterations: a
    checkpoint brings back the lr it was saved with, which under another --iterations is the old
    schedule's (iteration 21 of a 20 -> 40 resume trained at 0.1x, then 0.51x: 0.55x skipped)."""
    sched.last_epoch = it - 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "step() before optimizer.step()": no step is skipped here
        sched.step()


def stretch_note(cfg, before, start):
    """--resume 1 with another --iterations: the cosine is over the new count from here on, so the
    lr jumps (up when the run grows). Accepted on purpose (it is how a finished run trains on), and
    said here, in one line."""
    old, new = (cfg.lr * lr_scale(start, n, cfg.lr_min) for n in (before, cfg.iterations))
    return (
        f"note: --iterations {before} -> {cfg.iterations} stretches the cosine lr schedule over "
        f"{cfg.iterations} iterations: iteration {start + 1} trains at lr {new:.3g}, {new / old:.2f}x the "
        f'{old:.3g} of --iterations {before} (docs/training.md, "Checkpoints and crashes")'
    )


def make_critic(cfg, model, device):
    """--algo ppo: a value head, outside the sharded model (ppo.py), saved and resumed with the
    checkpoint; None for every other estimator."""
    if cfg.algo != "ppo":
        return None
    return Critic(model.config.hidden_size, device, lambda head: make_optimizer(cfg, head, device))
