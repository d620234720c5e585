"""What a trained model's greedy policy does in every state of the treasure hunt: the action table.

    python -m bench.treasure --model out/model                  # the tiny model's run: 1-token replies
    python -m bench.treasure --model DIR --max_tokens 4         # a chat model trained with 4-token replies

All 600 states of the 5x5 game (25 x 24 start/treasure pairs, no walls), greedy, grouped by where the
treasure lies: per relative position, the share of states where the action is a shortest-path move,
and the actions taken. It loads and runs a model, so it lives here, not in envs/treasure.py (no env
imports a model).
"""

import argparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine import HFEngine
from envs.treasure import MOVES, all_states, shortest_moves
from prompts import prompt_module
from rollout import render_prompts
from tiny import is_tiny


def action_table(model_dir, size=5, max_tokens=None):
    """Print the markdown table of model_dir's greedy policy on all start/treasure pairs of a size x
    size grid. max_tokens: the reply length the run trained with (default 4 for a chat model, 1 for the
    tiny one)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tok = AutoTokenizer.from_pretrained(model_dir)
    dtype = torch.bfloat16 if device == "cuda" else None
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    tiny = is_tiny(model_dir)
    prompt = prompt_module("treasure", chat=not tiny)
    states = all_states(size)
    ids = render_prompts(
        tok, [prompt.build("t", "", f"at {a} treasure {b}", list(MOVES), 0) for a, b in states]
    )
    outs = HFEngine(model.to(device).eval(), tok).generate(
        ids, temperature=0, max_tokens=max_tokens or (1 if tiny else 4)
    )
    table = {}
    for ((r, c), (tr, tc)), (out, _) in zip(states, outs):
        act, _ = prompt.parse(tok.decode(out, skip_special_tokens=True), list(MOVES))
        good = shortest_moves((r, c), (tr, tc))
        key = (
            ("above" if tr < r else "below" if tr > r else "same row")
            + ", "
            + ("left" if tc < c else "right" if tc > c else "same column")
        )
        row = table.setdefault(key, {"n": 0, "good": 0, "acts": {}})
        row["n"] += 1
        row["good"] += act in good
        act = act if act in MOVES else "invalid"
        row["acts"][act] = row["acts"].get(act, 0) + 1
    print(f"greedy policy of {model_dir} on all {len(states)} states (no walls), by where the treasure is")
    print("| treasure is | states | shortest-path move | actions taken |\n|---|---|---|---|")
    for key, row in sorted(table.items()):
        acts = " ".join(f"{a} {n}" for a, n in sorted(row["acts"].items(), key=lambda x: -x[1]))
        print(f"| {key} | {row['n']} | {row['good'] / row['n']:.2f} | {acts} |")
    print(f"overall shortest-path share {sum(r['good'] for r in table.values()) / len(states):.3f}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--model", required=True, help="a saved model folder (out/model) or an HF name")
    ap.add_argument(
        "--max_tokens",
        type=int,
        default=None,
        help="the reply length the run trained with (default: 1 for a tiny model, else 4)",
    )
    args = ap.parse_args()
    action_table(args.model, max_tokens=args.max_tokens)
