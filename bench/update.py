"""Update throughput of train.py's own FSDP2 update on GPU: tokens/s, MFU, peak memory, weight gather.

    torchrun --nproc_per_node=1 -m bench.update --shape 1.5b --peak_tflops 790     # one H200
    ... --samples 64 --gather 0 --profile 1 [--attn sdpa [--cudnn_sdp 1]]        # where the time goes
    torchrun --nproc_per_node=1 -m bench.update --shape 7b --grad_ckpt 1 --samples 32  # 7B on one H200
    torchrun --nproc_per_node=8 -m bench.update --shape 7b --grad_ckpt 1             # one node
    python -m bench.update --shape tiny --samples 16 --prompt 64 --response 16       # CPU smoke test

A Qwen2.5-shaped model (random init from its config: no hub here) and step samples shaped like
the paper's ALFWorld batch (prompts up to --prompt tokens, responses up to --response) go through
ppo.logprobs (old log-probs, forward) and ppo.update (clipped-surrogate forward/backward + AdamW),
the functions train.py runs. Each rank gets --samples / world samples.

FLOPs counted (useful work only; padding is not counted): per token 2 x (non-embedding params) for
a forward, x3 for forward+backward; the LM head only on the response tokens whose logits are kept;
causal attention 2 * d * L * s^2 per sequence of length s for a forward (QK^T and AV, half masked).
MFU = FLOPs / time / (peak x ranks).

Peak memory is that of the old log-probs and the update. The bf16 engine copy the weight gather
loads into (--gather 1) is built after them, once the optimizer state is freed: train.py's GPU
engine, vLLM, sleeps through the update with its weights in CPU memory, so the update never shares
the GPU with a copy (it did here before: +14 GiB at 7B, 127 + 14 GiB being more than an H200 holds).
Out of memory: one line says in which pass and at what micro-batch size, and the exit status is 3,
so a script can retry smaller (--micro_batch_tokens) and report the largest that fits. --json FILE
appends the results as one JSON line.
"""

import argparse
import json
import random
import sys
import time

import torch

import fsdp
import ppo
import train
from engine import HFEngine
from rollout import Sample

SHAPES = {  # config fields of Qwen2.5-1.5B / 7B and SmolLM2-135M (a Llama), from their config.json
    "1.5b": dict(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "7b": dict(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        tie_word_embeddings=False,
    ),
    "smollm2": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        tie_word_embeddings=True,
        model_type="llama",
    ),
    "tiny": dict(
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=1000,
        tie_word_embeddings=True,
    ),
}


def make_samples(n, prompt, response, vocab, seed):
    """Step samples shaped like an ALFWorld batch: prompt lengths uniform in [prompt/2, prompt],
    responses in [response/4, response]."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        p, r = rng.randint(prompt // 2, prompt), rng.randint(response // 4, response)
        out.append(
            Sample(
                [rng.randrange(vocab) for _ in range(p)],
                [rng.randrange(vocab) for _ in range(r)],
                [-1.0] * r,
                0.0,
                False,
                True,
                i // 8,
                i,
                "",
                0,
            )
        )
    return out


def flops(model_cfg, samples, backward):
    """Useful FLOPs of one pass over the samples (see the module docstring)."""
    d, L, V = model_cfg.hidden_size, model_cfg.num_hidden_layers, model_cfg.vocab_size
    kv = d // model_cfg.num_attention_heads * model_cfg.num_key_value_heads
    per_layer = 2 * d * d + 2 * d * kv + 3 * d * model_cfg.intermediate_size  # q,o + k,v + MLP weights
    tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    resp = sum(len(s.response_ids) for s in samples)
    f = (
        2 * L * per_layer * tokens
        + 2 * d * V * resp
        + 2 * d * L * sum((len(s.prompt_ids) + len(s.response_ids)) ** 2 for s in samples)
    )
    return f * (3 if backward else 1), tokens


def run(args, rank, world, device, log):
    from transformers import AutoConfig, AutoModelForCausalLM

    attn = fsdp.attn_implementation(device) if args.attn == "auto" else args.attn  # as train.py
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(bool(args.cudnn_sdp))  # train.py: off (fsdp.py says why)
    packed = attn in fsdp.PACKED_ATTN
    shape = dict(SHAPES[args.shape])
    mcfg = AutoConfig.for_model(
        shape.pop("model_type", "qwen2"), **shape, max_position_embeddings=32768, rope_theta=1e6
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(mcfg, attn_implementation=attn)
    n_params = sum(p.numel() for p in model.parameters())
    log(
        f"model {args.shape}: {n_params / 1e9:.2f}B parameters, world {world}, device {device}, "
        f"attention {attn}, compile {args.compile}"
    )
    cfg = train.Config(
        micro_batch_tokens=args.micro_batch_tokens, mini_batch=args.samples, grad_ckpt=args.grad_ckpt, lr=1e-6
    )
    model = fsdp.shard(
        model,
        device,
        cfg.grad_ckpt,
        reshard_after_forward=None if args.reshard_after_forward < 0 else bool(args.reshard_after_forward),
        compile_layers=bool(args.compile),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, fused=device.type == "cuda")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda it: 1.0)
    samples = make_samples(args.samples // world, args.prompt, args.response, mcfg.vocab_size, seed=rank)
    adv = [random.Random(i).uniform(-1, 1) for i in range(len(samples))]
    sync = (lambda: torch.cuda.synchronize()) if device.type == "cuda" else (lambda: None)

    # warm-up on a few samples (kernels, allocator), then one measured score + update on all of them;
    # --compile warms up on all of them: torch.compile specialises on size ranges (a micro-batch of
    # more than ~9k tokens compiled anew on an H200), and a run compiles only in its first iterations
    few = samples if args.compile else samples[: max(2, len(samples) // 16)]
    args.phase = "warm-up"  # where an out-of-memory error struck (main reports it)
    kw = dict(cfg=cfg, device=device, pad_id=0, packed=packed)  # what train.py passes, bar a reference
    ppo.update(model, opt, sched, few, old=ppo.logprobs(model, few, **kw), ref=None, adv=adv, **kw)
    if args.profile:
        profile(model, opt, sched, samples, cfg, device, log, packed)
    # after the warm-up's step: weights, gradients and AdamW state, what the passes' activations add to
    static = torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    sync()
    args.phase = "old log-probs"
    t0 = time.perf_counter()
    old = ppo.logprobs(model, samples, **kw)
    sync()
    t1 = time.perf_counter()
    args.phase = "update"
    stats = ppo.update(model, opt, sched, samples, old=old, ref=None, adv=adv, **kw)
    sync()
    t2 = time.perf_counter()
    f_fwd, tokens = flops(mcfg, samples, backward=False)
    f_upd, _ = flops(mcfg, samples, backward=True)
    f_fwd, f_upd, tokens = (fsdp.all_reduce(x) for x in (f_fwd, f_upd, tokens))
    peak = args.peak_tflops * 1e12 * world
    mem = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    rows = [("old log-probs (forward)", t1 - t0, f_fwd), ("update (fwd+bwd+AdamW)", t2 - t1, f_upd)]
    log(
        f"\n{args.samples} samples, {int(tokens)} tokens "
        f"(prompt <= {args.prompt}, response <= {args.response}), "
        f"micro-batches <= {args.micro_batch_tokens} tokens, grad_ckpt {args.grad_ckpt}, "
        f"{stats['optimizer_steps']} optimizer step(s), loss {stats['loss']:.4f}; "
        f"weights + gradients + AdamW state {static:.1f} GiB (rank 0)\n"
    )
    log("| pass | seconds | tokens/s (all ranks) | TFLOP/s per GPU | MFU | peak memory GiB (rank 0) |")
    log("|---|---|---|---|---|---|")
    for name, dt, f in rows:
        log(
            f"| {name} | {dt:.2f} | {tokens / dt:,.0f} | {f / dt / world / 1e12:.1f} | "
            f"{f / dt / peak:.1%} | {mem:.1f} |"
            if args.peak_tflops
            else f"| {name} | {dt:.2f} | {tokens / dt:,.0f} | {f / dt / world / 1e12:.3f} | - | {mem:.1f} |"
        )
    result = dict(
        vars(args), params=n_params, world=world, tokens=int(tokens), peak_memory_gib=mem, static_gib=static
    )
    for key, (_, dt, f) in zip(("logprobs", "update"), rows):
        result |= {f"{key}_s": dt, f"{key}_tokens_per_s": tokens / dt}
        result[f"{key}_mfu"] = f / dt / peak if args.peak_tflops else None
    if args.gather:  # the optimizer state and gradients go first (see the module docstring)
        args.phase = "weight gather"
        opt.state.clear()
        model.zero_grad(set_to_none=True)
        with torch.device(device):
            engine = HFEngine(AutoModelForCausalLM.from_config(mcfg, dtype=torch.bfloat16), None)
        engine.own_model = engine.model  # push_weights copies into it, as into train.py's bf16 HF engine copy
        sync()
        t0 = time.perf_counter()
        engine.push_weights(fsdp.full_parameters(model))
        sync()
        result["gather_s"] = time.perf_counter() - t0
        log(
            f"\nweight gather (FSDP2 full tensor per parameter) + load into a bf16 HF engine copy: "
            f"{result['gather_s']:.2f} s"
        )
    return result


def profile(model, opt, sched, samples, cfg, device, log, packed):
    """Where the time of one update goes: torch.profiler over the update of the first micro-batch's
    worth of samples, the top kernels/ops by device (or CPU) self time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    mb = ppo.micro_batches(samples, range(len(samples)), cfg.micro_batch_tokens, packed)[0]
    few = [samples[i] for i in mb]
    old = ppo.logprobs(model, few, cfg=cfg, device=device, pad_id=0, packed=packed)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with prof(activities=acts) as p:
        ppo.update(
            model,
            opt,
            sched,
            few,
            old=old,
            ref=None,
            adv=[0.5] * len(few),
            cfg=cfg,
            device=device,
            pad_id=0,
            packed=packed,
        )
        if device.type == "cuda":
            torch.cuda.synchronize()
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    log(
        f"profile: update of one micro-batch ({len(few)} samples, "
        f"{sum(len(s.prompt_ids) + len(s.response_ids) for s in few)} tokens)"
    )
    log(p.key_averages().table(sort_by=key, row_limit=15, max_name_column_width=60))


def main():
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1.5b")
    ap.add_argument("--samples", type=int, default=256, help="step samples in the batch (all ranks)")
    ap.add_argument("--prompt", type=int, default=2048, help="max prompt tokens")
    ap.add_argument("--response", type=int, default=512, help="max response tokens")
    ap.add_argument("--micro_batch_tokens", type=int, default=16384)
    ap.add_argument("--grad_ckpt", type=int, default=0)
    ap.add_argument("--gather", type=int, default=1, help="also time the weight gather into an engine copy")
    ap.add_argument(
        "--attn", default="auto", help="auto (as train.py: fsdp.attn_implementation) | sdpa | eager | ..."
    )
    ap.add_argument("--cudnn_sdp", type=int, default=0, help="1 = let SDPA use cuDNN (slow with masks here)")
    ap.add_argument(
        "--reshard_after_forward",
        type=int,
        default=-1,
        help="FSDP2: free the gathered layer after its forward (1) or keep it for the backward (0); "
        "-1 = as train.py: 1 only with several ranks",
    )
    ap.add_argument(
        "--compile",
        type=int,
        default=-1,
        help="1 = torch.compile each decoder layer; -1 = as train.py's "
        "--compile auto in a GPU run: 1 on CUDA, 0 on CPU",
    )
    ap.add_argument(
        "--profile", type=int, default=0, help="also print torch.profiler's top kernels of one micro-batch"
    )
    ap.add_argument("--peak_tflops", type=float, default=0.0, help="bf16 peak per GPU (H200 measured: ~790)")
    ap.add_argument("--json", default="", help="append the results as one JSON line to this file (rank 0)")
    args = ap.parse_args()
    for name in ("samples", "prompt", "response", "micro_batch_tokens"):
        if getattr(args, name) < 1:
            sys.exit(f"error: --{name} {getattr(args, name)}: must be >= 1")
    rank, world, device = fsdp.setup_dist(train.Config())
    if args.compile < 0:
        args.compile = int(device.type == "cuda")
    log = print if rank == 0 else (lambda *a, **k: None)
    args.phase = "model set-up"
    try:
        result = run(args, rank, world, device, log)
    except torch.OutOfMemoryError as e:
        gib = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
        log(
            f"out of GPU memory in the {args.phase} (shape {args.shape}, "
            f"micro-batches <= {args.micro_batch_tokens} tokens, compile {args.compile}, "
            f"grad_ckpt {args.grad_ckpt}; peak {gib:.1f} GiB allocated): "
            f"{str(e).splitlines()[0][:160]}"
        )
        result = dict(vars(args), oom=True, peak_memory_gib=gib)
    if args.json and rank == 0:
        with open(args.json, "a") as f:
            f.write(json.dumps(result) + "\n")
    if fsdp.dist_on():
        fsdp.dist.destroy_process_group()
    sys.exit(3 if result.get("oom") else 0)


if __name__ == "__main__":
    main()
