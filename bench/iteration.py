"""Iterations of train.py, timed by phase, with a random-weight model of a Qwen2.5 shape.

    python -m bench.iteration --shape 1.5b --peak_tflops 790         # ALFWorld, the paper's settings, one GPU
    python -m bench.iteration --shape tiny --engine hf --n_groups 2 --group_size 2 --env_workers 0 \\
        --env_args max_steps=3 --max_response_tokens 16                # CPU smoke test

Every flag it does not know goes to train.py, after `--env alfworld` and its preset (train.PRESETS:
16 groups x 8 envs, up to 50 steps, 512 response tokens, window memory, KL and entropy terms, 8 env
workers; on a GPU compiled, --compile auto), so the iterations are those `python train.py --env
alfworld --model DIR` runs. Measured on an H200: bench/README.md, "ALFWorld iterations".

The model: bench.update's SHAPES[--shape] as a Qwen2 config, random init (no hub here), saved as an
HF folder under --out with a tokenizer trained here: byte-level BPE on the env's own text (its
prompts and actions from a few random episodes, tiny.corpus) with Qwen2.5's ChatML chat template
and EOS <|im_end|>. Random weights never write an EOS or a valid action, so every reply runs to
--max_response_tokens and every episode to the env's step limit: the longest iteration the settings
allow (a trained model replies shorter and wins some games early).

Left out of the timed iteration, as train.py does them only every --eval_every iterations (10 for
ALFWorld): the evaluation and the checkpoint (both patched out here: a 1.5B checkpoint with its
AdamW state is ~25 GB of disk). Runs --iterations (2): the first carries every first call's cost
(torch.compile of the trainer's layers, under --compile, for the no-grad and the training pass;
the allocator's growth), so the last is the iteration a long run repeats. Prints, per iteration,
the metrics line's time_* phases, samples, tokens, update tokens/s and MFU (with --peak_tflops),
and the update's log-prob passes apart from its step (time_logprobs); then the start-up before the
first; --json FILE appends them (the last iteration's at the top level, every one under "per_iteration").
--warmup_turns N: iteration 1's episodes stop after N steps, so the warm-up costs a fraction of an
iteration and --iterations 2 reports a whole steady-state iteration (short_first_iteration).
train.py runs with --metrics all (the sub-timers and throughput figures are not in its default line).
MFU of time_update: 2N FLOPs per token for the forward of the old log-probs and 6N for the update's
forward/backward, N parameters, over --peak_tflops x ranks (the KL reference's pass is not counted).
"""

import argparse
import functools
import json
import os
import time

import torch

import rollout
import train
from bench.update import SHAPES
from envs import GroupedEnvs, parse_env_args

# Qwen2.5's template with its default system prompt (the tokens every step's prompt carries)
CHATML = (
    "{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nYou are Qwen, created by Alibaba "
    "Cloud. You are a helpful assistant.<|im_end|>\\n' }}{% endif %}{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
PHASES = (
    "time_gen",
    "time_env",
    "time_rollout_other",
    "time_update",
    "time_sync",
    "time_iteration",
)


def build_tokenizer(cfg, vocab_size, episodes=3):
    """Byte-level BPE trained on what the env and its prompt produce, ChatML template, EOS <|im_end|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from tiny import corpus

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        corpus(cfg.env, episodes, env_kwargs=parse_env_args(cfg.env, cfg.env_args)),
        trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=specials,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    hf.chat_template = CHATML
    return hf


def make_model_dir(shape, cfg, path):
    """A random-weight Qwen2 of SHAPES[shape] and the tokenizer above, saved (bf16) as an HF folder."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(SHAPES[shape])
    tok = build_tokenizer(cfg, min(8192, fields["vocab_size"]))
    mcfg = AutoConfig.for_model(
        fields.pop("model_type", "qwen2"),
        **fields,
        max_position_embeddings=32768,
        rope_theta=1e6,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # random init is faster there
        model = AutoModelForCausalLM.from_config(mcfg, dtype=torch.bfloat16)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    n = sum(p.numel() for p in model.parameters())
    del model
    if torch.cuda.is_available():  # give the cached blocks back before vLLM sizes its share of the GPU
        torch.cuda.empty_cache()
    return n


def count_parameters(path):
    """Parameters of the HF model folder at path, counted on the meta device (no weights loaded)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    return sum(p.numel() for p in model.parameters())


def short_first_iteration(turns):
    """--warmup_turns: iteration 1 plays each episode for at most `turns` env steps (rollout's
    max_turns), the later iterations whole. Compile's warm-up, most of the first iteration's extra
    cost, comes with any batch of the same micro-batch shapes, so a steady state is measured without
    paying for a whole first iteration (the 1.5B shape: 463 s whole, 76 s at 5 steps); a larger batch
    may still grow the allocator in iteration 2, so compare with a whole first iteration once."""
    whole, collect = train.rollout, train.collect

    def collect_short_first(cfg, envs, engine, tok, prompt, it, rank, saved):
        train.rollout = functools.partial(whole, max_turns=turns) if it == 1 else whole
        try:
            return collect(cfg, envs, engine, tok, prompt, it, rank, saved)
        finally:
            train.rollout = whole

    train.collect = collect_short_first


def report(lines, name, argv, start_up):
    """The table of every iteration's phases and the steady state (the last iteration) in words."""
    m = lines[-1]
    print("(no model was saved, whatever train.py's last lines say: the bench leaves the checkpoint out)")
    print(
        f"\n{len(lines)} iteration(s) of python train.py {' '.join(argv)} (model {name}); "
        f"train.py's set-up (and teardown) around them {start_up:.0f} s"
    )
    print(
        "| iteration | "
        + " | ".join(k[5:] for k in PHASES)
        + " | samples | prompt / response tokens per sample | "
        "update tokens/s | MFU | of the update: old log-probs / reference / step |"
    )
    print("|---" * (len(PHASES) + 6) + "|")
    for x in lines:
        mfu = f"{x['mfu']:.1%}" if x.get("mfu") is not None else "-"
        ref, step = x.get("time_ref_logprobs") or 0.0, x["time_update"] - x["time_logprobs"]
        print(
            f"| {x['iteration']} | " + " | ".join(f"{x[k]:.1f}" for k in PHASES) + f" | {x['samples']:.0f} | "
            f"{x['prompt_tokens']:.0f} / {x['response_tokens']:.0f} | {x['update_tokens_per_s']:,.0f} | "
            f"{mfu} | {x['time_logprobs'] - ref:.1f} / {ref:.1f} / {step:.1f} |"
        )
    phases = {k[5:]: m[k] for k in PHASES[:-1]}
    top = max(phases, key=phases.get)
    share = {k: v / m["time_iteration"] for k, v in phases.items()}
    print(
        f"steady state (iteration {m['iteration']}): {m['time_iteration']:.1f} s; largest phase: {top}, "
        f"{share[top]:.0%} of it; the env wait: {share['env']:.0%}"
    )
    if len(lines) > 1:
        first = lines[0]
        print(
            f"iteration 1 took {first['time_iteration'] - m['time_iteration']:+.1f} s more "
            f"({first['time_update'] - m['time_update']:+.1f} s in the update, "
            f"{first['time_gen'] - m['time_gen']:+.1f} s in generation): its first calls (under --compile, "
            f"torch.compile's warm-up)"
        )


def main():
    t_start = time.perf_counter()
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    add = ap.add_argument
    add("--shape", choices=sorted(SHAPES), default="1.5b", help="bench.update's model shapes")
    add("--env", default="alfworld", help="train.py --env (its preset applies)")
    add("--out", default="/tmp/bench-iteration", help="the model folder and train.py's out_dir go here")
    add("--model_dir", default="", help="time this HF model folder (e.g. a clone, bench.bc), not a --shape")
    add("--json", default="", help="append the results as one JSON line to this file")
    add("--peak_tflops", type=float, default=0.0, help="the GPU's peak bf16 TFLOP/s (H200: ~790); 0 = no MFU")
    add("--iterations", type=int, default=2, help="the first carries compile's warm-up, the last is reported")
    add("--wave", type=float, default=rollout.WAVE, help="--overlap's share of envs asked together")
    add(
        "--prefetch", type=int, default=1, help="0: games reset at their iteration's start, not in the update"
    )
    add("--warmup_turns", type=int, default=0, help="iteration 1's episodes end after N steps (0: whole)")
    args, rest = ap.parse_known_args()
    rollout.WAVE = args.wave
    if not args.prefetch:
        GroupedEnvs.prefetch = lambda self, group_seeds: None
    model_dir, out_dir = (
        args.model_dir or os.path.join(args.out, f"model-{args.shape}"),
        os.path.join(args.out, "run"),
    )
    # --eval_episodes 1: the random-policy baseline train.py plays at start-up is then one game
    if args.iterations < 1:
        raise SystemExit(f"error: --iterations {args.iterations}: run at least 1")
    if args.warmup_turns < 0:
        raise SystemExit(f"error: --warmup_turns {args.warmup_turns}: give 0 (off) or a number of steps")
    if args.warmup_turns:
        short_first_iteration(args.warmup_turns)
    argv = ["--env", args.env, "--model", model_dir, "--iterations", str(args.iterations),
            "--out_dir", out_dir, "--eval_episodes", "1", "--metrics", "all",
            *(["--eval_sets", "valid_seen"] if args.env == "alfworld" else []), *rest]  # fmt: skip
    cfg = train.parse_args(argv)  # a bad flag stops here, in one line that names it
    t0 = time.perf_counter()
    # the model's name in the report: the folder's for --model_dir, else the shape
    name = os.path.basename(os.path.normpath(model_dir)) if args.model_dir else args.shape
    if args.model_dir:
        n_params = count_parameters(model_dir)
    else:
        n_params = make_model_dir(args.shape, cfg, model_dir)
        print(
            f"model {args.shape}: {n_params / 1e9:.2f}B parameters, random init, saved to {model_dir} in "
            f"{time.perf_counter() - t0:.0f} s",
            flush=True,
        )
    if os.path.exists(os.path.join(out_dir, "metrics.jsonl")):
        os.remove(os.path.join(out_dir, "metrics.jsonl"))  # a previous run's line is not this one
    train.evaluate = lambda *a, **k: {"not run": float("nan")}  # see the module docstring
    train.save = lambda *a, **k: None
    t_main = time.perf_counter()
    train.main(argv)
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f]
    world = int(os.environ.get("WORLD_SIZE", 1))
    for x in lines:  # MFU of time_update (see the module docstring)
        x["mfu"] = (
            8 * n_params * x["tokens"] / x["time_update"] / (args.peak_tflops * 1e12 * world)
            if args.peak_tflops
            else None
        )
    m = lines[-1]  # the steady state: the last iteration
    start_up = time.perf_counter() - t_main - m["wall"]  # load, engine, env workers; and their teardown
    keys = (
        *PHASES,
        "samples",
        "episode_length",
        "prompt_tokens",
        "response_tokens",
        "update_tokens_per_s",
        "mfu",
        "logp_gap",
        "time_logprobs",
        "time_ref_logprobs",
    )
    res = {
        "shape": name,
        "params": n_params,
        "argv": argv,
        "wave": args.wave,
        "prefetch": args.prefetch,
        "start_up_s": start_up,
        **{k: m.get(k) for k in keys},
        "per_iteration": [{k: x.get(k) for k in keys} for x in lines],
    }
    report(lines, name, argv, start_up)
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(res) + "\n")
    print(
        f"bench total {time.perf_counter() - t_start:.0f} s (model folder, train.py's set-up, the iterations)"
    )


if __name__ == "__main__":
    main()
