"""Prompt and parser for the treasure hunt.

Two prompts. `build` is deliberately terse (about 14 tokens without memory): the default policy is
a tiny model trained from scratch on a word-level vocabulary, and every prompt token costs it time.
`build_chat` is for pretrained chat models (--model NAME): it says what the game is, what the
coordinates mean, what each move does and how to answer, in words such a model can follow
(prompt_module picks it for any model but the tiny one). Both parsers want one admissible word;
the chat one forgives case, surrounding spaces, quotes and a final full stop ("Down." is "down").

The chat prompt lists the four answers in an order drawn from the state. Measured on
SmolLM2-135M-Instruct (48 states x 8 samples, T=1, 4 tokens) with the fixed order "up, down, left or
right": 17% of replies were one valid word, and of the replies that named a move 75% named "up" (the
model copies the first option). Trained from there, the policy said "up" in every state within 10
iterations, before it had learned to read the coordinates (LOG.md). A state-dependent order takes the
bias off any one move.
"""

import random
import re

RULES = (
    "You are playing a treasure hunt on a grid. Positions are (row, column): row 0 is the top "
    "row and rows count downwards; column 0 is the left column and columns count to the right. "
    "Moves: up (row - 1), down (row + 1), left (column - 1), right (column + 1). A move into the "
    "edge of the grid{walls} leaves you where you are. Reach the treasure in as few moves as you can."
)


def build(task, history_text, obs, admissible, step):
    history = f"{history_text} " if history_text else ""
    return [{"role": "user", "content": f"{history}{obs}"}]


def offsets(cells):
    """', that is 3 rows below you and 1 column to your left': the treasure relative to you, in words."""
    pos = {k: (int(r), int(c)) for k, r, c in cells if k != "wall"}
    if "at" not in pos or "treasure" not in pos:
        return ""
    (r, c), (tr, tc) = pos["at"], pos["treasure"]
    n = lambda k, unit: f"{abs(k)} {unit}{'s' if abs(k) > 1 else ''}"  # noqa: E731
    rows = "in your row" if tr == r else f"{n(tr - r, 'row')} {'below' if tr > r else 'above'} you"
    cols = "in your column" if tc == c else f"{n(tc - c, 'column')} to your {'right' if tc > c else 'left'}"
    return f", that is {rows} and {cols}"


def build_chat(task, history_text, obs, admissible, step):
    cells = re.findall(r"(at|treasure|wall) \((\d+), (\d+)\)", obs)
    where = {k: f"row {r}, column {c}" for k, r, c in cells if k != "wall"}
    walls = [f"({r}, {c})" for k, r, c in cells if k == "wall"]
    state = (
        f"You are at {where.get('at', '?')}. The treasure is at {where.get('treasure', '?')}"
        f"{offsets(cells)}." + (f" Walls: {', '.join(walls)}." if walls else "")
    )
    memory = f"\nMemory: {history_text}" if history_text else ""
    a, b, c, d = random.Random(obs).sample(["up", "down", "left", "right"], 4)  # same state, same order
    return [
        {
            "role": "user",
            "content": f"{RULES.format(walls=' or a wall' if walls else '')}{memory}\n"
            f"{state}\nAnswer with one word: {a}, {b}, {c} or {d}.",
        }
    ]


def parse(response_text, admissible):
    """The whole response, stripped and lowercased, must be one admissible action."""
    text = (response_text or "").strip().lower()
    if text in admissible:
        return text, True
    return text[-30:], False  # like the reference: the env still gets the text, a no-op here


def parse_chat(response_text, admissible):
    """As parse, after dropping surrounding quotes, asterisks and a final '.' or '!'."""
    return parse((response_text or "").strip().strip("\"'*`").rstrip(".!").strip("\"'*` "), admissible)
