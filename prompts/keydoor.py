"""Prompt and parser for the key-and-door game (envs/keydoor.py).

`build` is the terse one the tiny model is trained on: the observation itself (plus any memory).
`build_chat` is for a pretrained chat model: the rules (the key's part only where the game has a
key), the state in words with the offset to the current target (the key, then the door), and the
four answers in an order drawn from the state (a chat model tends to copy the first option listed:
prompts/treasure.py). `--prompt coords` (`build_coords`) is the same without the offset: the model
must compare the coordinates itself (the harder task; on the treasure hunt the offset was what
made SmolLM2 learn, LOG.md). The parsers are the treasure hunt's: one admissible word, the chat one
forgiving case, quotes and a final full stop.
"""

import random
import re

from prompts.treasure import offsets, parse, parse_chat  # noqa: F401  (this env's parsers)

RULES = (
    "You are in a grid of rooms. Positions are (row, column): row 0 is the top row and rows count "
    "downwards; column 0 is the left column. Moves: up (row - 1), down (row + 1), left (column - 1), "
    "right (column + 1). A move into the edge of the grid or a wall leaves you where you are. {goal}, in as "
    "few moves as you can."
)
GOALS = {
    True: "First walk onto the key to pick it up, then walk onto the door to open it",
    False: "Walk onto the door to open it",
}  # key=0 (walk to the door): no key to speak of


def build(task, history_text, obs, admissible, step):
    history = f"{history_text} " if history_text else ""
    return [{"role": "user", "content": f"{history}{obs}"}]


def build_chat(task, history_text, obs, admissible, step, offset=True):
    cells = re.findall(r"(at|key|door|wall) \((\d+), (\d+)\)", obs)
    pos = {k: (r, c) for k, r, c in cells if k != "wall"}
    target = "key" if "key" in pos else "door"
    walls = [f"({r}, {c})" for k, r, c in cells if k == "wall"]
    here = f"row {pos['at'][0]}, column {pos['at'][1]}" if "at" in pos else "?"
    where = f"row {pos[target][0]}, column {pos[target][1]}" if target in pos else "?"
    rel = (
        offsets([("at", *pos["at"]), ("treasure", *pos[target])])
        if offset and "at" in pos and target in pos
        else ""
    )
    held = "You have the key. " if "have key" in obs else ""
    state = f"You are at {here}. {held}The {target} is at {where}{rel}." + (
        f" Walls: {', '.join(walls)}." if walls else ""
    )
    memory = f"\nMemory: {history_text}" if history_text else ""
    a, b, c, d = random.Random(obs).sample(["up", "down", "left", "right"], 4)  # same state, same order
    rules = RULES.format(goal=GOALS["key" in obs])  # "key (r, c)" or "have key": the game has a key
    return [
        {"role": "user", "content": f"{rules}{memory}\n{state}\nAnswer with one word: {a}, {b}, {c} or {d}."}
    ]


def build_coords(task, history_text, obs, admissible, step):
    """The chat prompt without the offset line: positions only (`--prompt coords`)."""
    return build_chat(task, history_text, obs, admissible, step, offset=False)


parse_coords = parse_chat
