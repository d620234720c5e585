"""Supervised ceiling check: can a chat model learn the treasure hunt's state -> move map at all?

    python -m bench.sft --model DIR --lr 1e-6 1e-5 1e-4 --steps 300        # GPU: about a minute

Before spending RL time on a model, give it the answers: fine-tune on the 600 states of the 5x5
game (25 x 24 start/treasure pairs, no walls), 2/3 for training and 1/3 held out, with the chat
prompt train.py uses (prompts/treasure.build_chat). The loss is -log p(any shortest-path move):
the probability of the first tokens of the one or two moves that shorten the distance, summed, at
the reply's first position. Reported every --eval_every steps, for a fresh copy of the model per lr:
  held_out   share of held-out states whose greedy first token is a shortest-path move
  policy     success, from all 600 start/treasure pairs in 10 moves, of the greedy first-token policy
             (the train states are part of it: it is what a greedy episode would meet)
  invalid    share of all states whose greedy first token is none of the four moves
If the held-out share stays low even here, RL (a noisier signal about the same map) will not get
there either with this prompt and model.
"""

import argparse
import copy
import random
from types import SimpleNamespace

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from envs.treasure import MOVES, TreasureHunt, all_states, shortest_moves
from ppo import make_batch
from prompts import prompt_module
from rollout import render_prompts


def first_tokens(tok):
    """Each move's first token id as the model would start its reply (the four must differ)."""
    ids = {m: tok(m, add_special_tokens=False).input_ids[0] for m in MOVES}
    if len(set(ids.values())) != len(ids):
        raise SystemExit(f"bench.sft: the moves share a first token under this tokenizer: {ids}")
    return ids


def last_logits(model, rows, pad_id, device):
    """Prompts -> the logits at each prompt's last position, (B, V): ppo.make_batch's left-padded
    rows, with no response tokens."""
    batch = make_batch(
        [SimpleNamespace(prompt_ids=r, response_ids=[]) for r in rows], range(len(rows)), pad_id, False
    )
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        out = model(
            **{k: v.to(device) for k, v in batch["inputs"].items() if torch.is_tensor(v)},
            logits_to_keep=1,
            use_cache=False,
        )
    return out.logits[:, -1].float()


@torch.no_grad()
def greedy_policy(model, prompts, pad_id, device, move_of, batch=128):
    acts = []
    for i in range(0, len(prompts), batch):
        acts += [
            move_of.get(t, "invalid")
            for t in last_logits(model, prompts[i : i + batch], pad_id, device).argmax(-1).tolist()
        ]
    return acts


def policy_success(policy, states, max_steps=10):
    """Greedy episodes of the 5x5 game from every start/treasure pair, moving by the state -> move
    table (an invalid entry is a no-op, as in the env)."""
    env, wins = TreasureHunt(size=5, max_steps=max_steps), 0
    for a, b in states:
        env.reset(seed=0, options={"start": a, "treasure": b})
        done = won = False
        while not done:
            _, _, won, trunc, _ = env.step(policy[(env.pos, b)])
            done = won or trunc
        wins += won
    return wins / len(states)


def main(argv=None):
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument(
        "--model", required=True, help="a chat model directory (python smollm2.py DIR writes one)"
    )
    ap.add_argument("--lr", type=float, nargs="+", default=[1e-6, 1e-5, 1e-4])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--eval_every", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tok = AutoTokenizer.from_pretrained(args.model)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    base = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    prompt = prompt_module("treasure", chat=True)
    states = all_states()
    prompts = render_prompts(
        tok, [prompt.build("t", "", f"at {a} treasure {b}", list(MOVES), 0) for a, b in states]
    )
    tid = first_tokens(tok)
    move_of = {v: k for k, v in tid.items()}
    order = list(range(len(states)))
    random.Random(args.seed).shuffle(order)
    train_idx, test_idx = order[: 2 * len(order) // 3], order[2 * len(order) // 3 :]
    targets = [torch.tensor([tid[m] for m in shortest_moves(*s)]) for s in states]
    print(
        f"bench.sft: {args.model}, {len(train_idx)} train / {len(test_idx)} held-out states, "
        f"batch {args.batch}, {args.steps} steps, AdamW, {device}"
    )
    print("| lr | step | train loss | held_out | policy | invalid |\n|---|---|---|---|---|---|")
    for lr in args.lr:
        torch.manual_seed(args.seed)
        model = copy.deepcopy(base).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        rng, losses = random.Random(args.seed), []
        for step in range(args.steps + 1):
            if step % args.eval_every == 0:
                model.eval()
                acts = greedy_policy(model, prompts, pad_id, device, move_of)
                held = sum(acts[i] in shortest_moves(*states[i]) for i in test_idx) / len(test_idx)
                pol = policy_success(dict(zip(states, acts)), states)
                loss = f"{sum(losses) / len(losses):.3f}" if losses else "-"
                print(
                    f"| {lr:g} | {step} | {loss} | {held:.3f} | {pol:.3f} | "
                    f"{acts.count('invalid') / len(acts):.3f} |",
                    flush=True,
                )
                losses = []
                model.train()
            if step == args.steps:
                break
            batch = rng.sample(train_idx, args.batch)
            logp = torch.log_softmax(last_logits(model, [prompts[i] for i in batch], pad_id, device), -1)
            loss = -torch.stack(
                [logp[j, targets[i].to(device)].logsumexp(0) for j, i in enumerate(batch)]
            ).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        del model, opt


if __name__ == "__main__":
    main()
