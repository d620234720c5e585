"""Behaviour cloning for ALFWorld: expert steps as chat data, then cross-entropy on the replies.

    python -m bench.bc --collect out/bc-{prompt}.jsonl --games 400 --prompt tagged choice      # CPU
    python -m bench.bc --train out/bc-choice.jsonl --model DIR --out OUT                      # GPU
    python -m bench.bc --train DATA --model DIR --out OUT --lora_rank 8    # a clone kept as OUT/adapter
    python -m bench.bc --merge OUT/adapter --model DIR --out OUT            # ... rebuilt elsewhere from it
    python train.py --env alfworld --model OUT --prompt choice ...                              # RL from it

Why: no model this trainer can get offline wins an ALFWorld game, so RL gets no signal (every
group all-lost). The games' expert (envs.alfworld, `expert=True`) gives a winning action in every
state; cloning it gives RL a start that wins some games.

Why this design: a separate script, not a train.py stage, because collection needs no model and
runs on CPU (the GPU host has no alfworld install to spare time on), and the dataset is a plain file
that outlives any run. Collection plays the expert through exactly what a rollout sees: the same
env, memory (train.PRESETS["alfworld"]: window, k = 2) and prompt module (prompts/alfworld.py, the
tagged <think>/<action> reply or `--prompt choice`'s number), so a line's messages are a prompt the
RL run would build in that state. Each target reply is checked to parse back to the expert action
with that module's own parser. One pass writes a file per prompt ("{prompt}" in the path): the
games are the slow part, not the prompts. The trainer scores the reply tokens (+ EOS, as rollouts
sample it) after the chat-template prompt that rollout.render_prompts makes, with ppo.make_batch and
ppo.response_logprobs, the update's own code path (packed rows and bf16 weights on GPU, fp32 on
CPU); AdamW, linear decay; every 20th game is held out for a validation loss. The output is an HF
folder train.py loads.
The expert plans on the full game state (it knows where hidden objects are), so a clone learns
likely places, not the truth: a start for RL, not a ceiling.
"""

import argparse
import json
import math
import os
import random
import time
from types import SimpleNamespace

import torch
from tqdm import tqdm

PROMPTS = {"tagged": "", "choice": "choice"}  # bc's name -> train.py --prompt


def target(variant, action, admissible):
    """The reply that plays `action`: the tagged format with a short think, or its number."""
    if variant == "choice":
        from prompts.alfworld import choices

        return str(choices(admissible).index(action) + 1)
    return f"<think>The next step towards the task is {action}.</think><action>{action}</action>"


def collect(path, games, variants, data_dir=None, split="train", first=0):
    """Play the expert on games first..first+games-1 of `split`; a line per step and prompt: messages,
    reply, action, admissible, game, step, gamefile. -> the number of steps."""
    from envs.alfworld import ALFWorld
    from memory import make_memory
    from prompts import prompt_module
    from train import PRESETS

    try:
        env = ALFWorld(split, data_dir=data_dir, expert=True)
    except FileNotFoundError as e:
        raise SystemExit(f"bench.bc: --data_dir: {e}")
    if not (0 < games and 0 <= first and first + games <= len(env.games)):
        raise SystemExit(
            f"bench.bc: --first {first} --games {games}: the {split} split has {len(env.games)} games"
        )
    prompts = {v: prompt_module("alfworld", chat=True, variant=PROMPTS[v]) for v in variants}
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    files = {v: open(path.replace("{prompt}", v), "w") for v in variants}
    preset, lines, t0 = PRESETS["alfworld"], 0, time.perf_counter()
    for game in tqdm(range(first, first + games), desc="collect", unit="game"):
        obs, info = env.reset(game)
        memory = make_memory(preset["memory"], preset["memory_k"])
        memory.reset(info["task"])
        done, step = False, 0
        while not done:
            action, adm = info["expert_action"], info["admissible_actions"]
            for v, prompt in prompts.items():
                reply = target(v, action, adm)
                assert prompt.parse(reply, adm) == (action, True), (v, reply, action)
                row = {
                    "messages": prompt.build(info["task"], memory.text(), obs, adm, step),
                    "reply": reply,
                    "action": action,
                    "admissible": adm,
                    "game": game,
                    "step": step,
                    "gamefile": "/".join(env.gamefile.split("/")[-4:-1]),
                }
                files[v].write(json.dumps(row) + "\n")
            new_obs, reward, won, truncated, info = env.step(action)
            memory.add(obs, action, reward)
            obs, done, step, lines = new_obs, won or truncated, step + 1, lines + 1
        assert won, f"the expert lost game {game} ({env.gamefile})"
    for f in files.values():
        f.close()
    print(
        f"bench.bc: {games} {split} games, {lines} expert steps, {time.perf_counter() - t0:.0f}s -> "
        f"{', '.join(f.name for f in files.values())}"
    )
    return lines


def load(path, tok):
    """A collected file -> samples (prompt ids as rollout.render_prompts makes them, reply ids + EOS)."""
    from rollout import render_prompts

    try:
        rows = [json.loads(line) for line in open(path)]
    except (OSError, ValueError) as e:
        raise SystemExit(f"bench.bc: --train {path}: {e}")
    if not rows or not {"messages", "reply", "game"} <= set(rows[0]):
        raise SystemExit(f"bench.bc: --train {path}: no lines of `--collect` (messages, reply, game)")
    prompts = render_prompts(tok, [r["messages"] for r in rows])
    return [
        SimpleNamespace(
            prompt_ids=p,
            response_ids=tok(r["reply"], add_special_tokens=False).input_ids + [tok.eos_token_id],
            game=r["game"],
        )
        for p, r in zip(prompts, rows)
    ]


def reply_logp(model, samples, idx, pad_id, device):
    """log p of every reply token of samples[idx] (ppo's batch and log-prob code: packed rows where the
    model's attention takes them, as train.py on GPU; left padding otherwise)."""
    from fsdp import PACKED_ATTN
    from ppo import make_batch, response_logprobs

    packed = getattr(model.config, "_attn_implementation", "") in PACKED_ATTN
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        return response_logprobs(model, make_batch(samples, idx, pad_id, packed), device, entropy=False)[0]


def train(args):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = torch.device(
        args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    )
    torch.manual_seed(args.seed)
    try:
        from fsdp import attn_implementation

        tok = AutoTokenizer.from_pretrained(args.model)
        # GPU: packed rows with varlen attention, as train.py (SDPA on left-padded bf16 rows gave NaN
        # losses); that kernel takes bf16 only, so on GPU the weights are bf16 throughout, fp32 on CPU
        model = AutoModelForCausalLM.from_pretrained(
            args.model,
            dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
            attn_implementation=attn_implementation(device),
        ).to(device)
    except (OSError, ValueError) as e:
        raise SystemExit(f"bench.bc: --model {args.model}: {str(e).splitlines()[0]}")
    try:
        os.makedirs(args.out, exist_ok=True)
    except OSError as e:
        raise SystemExit(f"bench.bc: --out {args.out}: {e}")
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    samples = load(args.train, tok)
    val = [i for i, s in enumerate(samples) if s.game % 20 == 19]
    fit = [i for i, s in enumerate(samples) if s.game % 20 != 19]
    steps = args.steps or args.epochs * math.ceil(len(fit) / args.batch)
    print(
        f"bench.bc: {args.model} on {args.train}: {len(fit)} train / {len(val)} held-out steps, batch "
        f"{args.batch}, {steps} updates, lr {args.lr:g}, {device}"
    )
    if args.lora_rank:  # adapters only; the clone written below is the base with them merged
        from fsdp import add_lora

        model = add_lora(model, args.lora_rank)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1 - k / steps)
    rng, order, losses = random.Random(args.seed), [], []
    model.train()
    for step in (bar := tqdm(range(steps), desc="bc", unit="step")):
        if len(order) < args.batch:  # epochs: each sample once before any repeats
            order += rng.sample(fit, len(fit))
        idx, order = order[: args.batch], order[args.batch :]
        loss = -reply_logp(model, samples, idx, pad_id, device).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.4f}", refresh=False)
    model.eval()
    with torch.no_grad():  # per reply token, over all held-out steps
        val_logp = [
            reply_logp(model, samples, val[i : i + args.batch], pad_id, device)
            for i in range(0, len(val), args.batch)
        ]
        val_loss = -torch.cat(val_logp).mean().item() if val else float("nan")
    if args.lora_rank:
        model.save_pretrained(os.path.join(args.out, "adapter"))
        merge(args.model, os.path.join(args.out, "adapter"), args.out)
    else:
        model.save_pretrained(args.out)
        tok.save_pretrained(args.out)
    with open(os.path.join(args.out, "bc.json"), "w") as f:
        json.dump({**vars(args), "losses": losses, "val_loss": val_loss}, f)
    print(
        f"bench.bc: loss {losses[0]:.4f} -> {sum(losses[-20:]) / len(losses[-20:]):.4f} (last 20), held-out "
        f"{val_loss:.4f}; wrote {args.out}"
    )
    return losses, val_loss


def merge(base, adapter, out):
    """The base model with a LoRA clone's adapter merged in -> an HF folder at out (fp32, on CPU: the
    same arithmetic on every machine, so a clone moved as its adapter, a few MB, is rebuilt to the
    weights a LoRA run on it checks on --resume)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    except (OSError, ValueError) as e:
        raise SystemExit(f"bench.bc: --merge {adapter} onto --model {base}: {str(e).splitlines()[0]}")
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(base).save_pretrained(out)
    print(f"bench.bc: {adapter} merged onto {base} -> {out}")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument(
        "--collect", metavar="OUT.jsonl", help="write expert steps here ({prompt} = the prompt's name)"
    )
    ap.add_argument("--games", type=int, default=400, help="--collect: train-split games FIRST..FIRST+N-1")
    ap.add_argument(
        "--first",
        type=int,
        default=0,
        help="--collect: the first game (split a collection over processes, then concatenate the files)",
    )
    ap.add_argument("--prompt", nargs="+", default=["tagged"], help="--collect: tagged and/or choice")
    ap.add_argument("--data_dir", default=None, help="--collect: the games' $ALFWORLD_DATA")
    ap.add_argument("--train", metavar="DATA.jsonl", help="a --collect file to clone")
    ap.add_argument("--model", help="--train: the HF model folder to start from (python smollm2.py DIR)")
    ap.add_argument("--out", help="--train: the HF folder to write")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=0, help="updates; 0 = --epochs over the data")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--lora_rank", type=int, default=0, help="--train: LoRA adapters of this rank; OUT/adapter keeps them"
    )
    ap.add_argument(
        "--merge", metavar="ADAPTER", help="rebuild a LoRA clone: --model BASE + ADAPTER -> --out"
    )
    args = ap.parse_args(argv)
    if args.merge:
        if not args.model or not args.out:
            raise SystemExit("bench.bc: --merge needs --model BASE and --out DIR")
        return merge(args.model, args.merge, args.out)
    if bool(args.collect) == bool(args.train):
        raise SystemExit("bench.bc: give one of --collect OUT.jsonl or --train DATA.jsonl")
    if args.collect:
        bad = [p for p in args.prompt if p not in PROMPTS]
        if bad or len(args.prompt) > 1 and "{prompt}" not in args.collect:
            raise SystemExit(
                f"bench.bc: --prompt {' '.join(args.prompt)}: names from {', '.join(PROMPTS)}; "
                f"several need {{prompt}} in --collect's path"
            )
        return collect(args.collect, args.games, args.prompt, args.data_dir, first=args.first)
    if not args.model or not args.out:
        raise SystemExit("bench.bc: --train needs --model DIR (start) and --out DIR (result)")
    if args.batch < 1 or args.lr <= 0 or args.epochs < 1 or args.steps < 0 or args.lora_rank < 0:
        raise SystemExit("bench.bc: --batch, --epochs and --lr must be > 0, --steps and --lora_rank >= 0")
    return train(args)


if __name__ == "__main__":
    main()
