"""Prompt and parser for Sokoban.

`build` is terse, for the tiny model trained from scratch: where you, the boxes and the targets are
(row, column: the tiny model learned the treasure hunt from coordinates), then the room inside
its border walls, rows separated by `/`, e.g. `P 1 3 X 2 3 O 4 1 # # P _ / # # X _ / ...`.
`build_chat` is for pretrained chat models: the rules, the legend, the grid as the env shows it
and how to answer. Both parsers want one admissible word; the chat one forgives case, quotes and
a final full stop, as the treasure hunt's does.
"""

from prompts.treasure import parse, parse_chat  # noqa: F401  (the same one-word answers)

RULES = (
    "You are playing Sokoban. Push every box onto a target. You move one cell up, down, left or "
    "right; walking into a box pushes it one cell further, unless a wall or another box is behind "
    "it. Boxes cannot be pulled, so never push a box into a corner that is not a target. Each move "
    "costs a little; a box on a target earns a point, and the puzzle solved earns ten."
)


def grid_rows(obs):
    """The grid lines of an observation (the legend dropped), each a list of symbols."""
    return [line.split() for line in obs.splitlines() if line and not line.startswith("# wall")]


def positions(rows, targets=True):
    """-> 'P r c X r c O r c ...': you, then the boxes, then the targets, row by row."""
    where = {"P": [], "X": [], "O": []}
    for r, row in enumerate(rows):
        for c, s in enumerate(row):
            for key in {"P": "P", "S": "PO", "X": "X", "√": "XO", "O": "O"}.get(s, ""):
                where[key].append(f"{key} {r} {c}")
    return " ".join(where["P"] + where["X"] + (where["O"] if targets else []))


def build(task, history_text, obs, admissible, step):
    rows = grid_rows(obs)
    inner = " / ".join(" ".join(row[1:-1]) for row in rows[1:-1])
    history = f"{history_text} " if history_text else ""
    return [{"role": "user", "content": f"{history}{positions(rows)} {inner}"}]


def build_chat(task, history_text, obs, admissible, step):
    grid = "\n".join(" ".join(row) for row in grid_rows(obs))
    memory = f"\nMemory: {history_text}" if history_text else ""
    return [
        {
            "role": "user",
            "content": f"{RULES}\nSymbols: # wall, _ floor, O target, X box, √ box on a target, "
            f"P you, S you on a target. Row 0 is the top row.{memory}\n"
            f"The room now:\n{grid}\nAnswer with one word: up, down, left or right.",
        }
    ]
