"""Memories: what an episode's past looks like in the next step's prompt (`--memory NAME`).

One instance per env. The rollout calls reset(task) at the start of an episode, add(obs, action,
reward) after every step (obs = the observation the action was taken in), and text() to build the
next prompt. The prompt never carries more than text(): that is what keeps step-independent
prompts flat while episodes grow ("full" is the concatenation baseline that does grow).
"""

import re


class NoMemory:
    """Nothing: the prompt is the current observation only (enough when the game is Markov)."""

    def __init__(self, k=2):
        self.steps = []

    def reset(self, task):
        self.task, self.steps = task, []

    def add(self, obs, action, reward):
        self.steps.append((obs, action, reward))

    def text(self):
        return ""


class WindowMemory(NoMemory):
    """The last k (observation, action) pairs; the reference's default with k = 2."""

    def __init__(self, k=2):
        super().__init__()
        self.k = k

    def text(self):
        recent = self.steps[-self.k :] if self.k > 0 else []
        return " ".join(f"[{obs} -> {action}]" for obs, action, _ in recent)


class FullHistory(WindowMemory):
    """Every (observation, action) pair since the start: the prompt grows with the episode."""

    def text(self):
        return " ".join(f"[{obs} -> {action}]" for obs, action, _ in self.steps)


class VisitedMemory(NoMemory):
    """Structured memory, the teaching example: the
    distinct positions visited so far, in the order of their last visit, at most the k most recent,
    plus the last action. It parses "at (r, c)" out of the observation, so it is specific to grid games."""

    POS = re.compile(r"at \((\d+), (\d+)\)")

    def __init__(self, k=5):
        super().__init__()
        self.k = k

    def text(self):
        visited = []
        for obs, _, _ in self.steps:
            m = self.POS.search(obs)
            if m:  # a revisited cell moves to the end: the cut below keeps the k most recent
                visited = [v for v in visited if v != m.groups()] + [m.groups()]
        if not self.steps:
            return ""
        cells = " ".join(f"({r}, {c})" for r, c in visited[-self.k :])
        return f"visited {cells} last {self.steps[-1][1]}"


class BoxesMemory(WindowMemory):
    """Sokoban: the last k moves, each with where you and the boxes stood before it (`P 1 3 X 2 3
    down`), not the whole grids that `window` repeats: the walls and targets never move, and a
    pushed or stuck box shows in the positions. Other envs' observations give just the moves."""

    def __init__(self, k=3):
        super().__init__(k)

    def text(self):
        from prompts.sokoban import grid_rows, positions

        recent = self.steps[-self.k :] if self.k > 0 else []
        return " ".join(
            f"{positions(grid_rows(obs), targets=False)} {action}".strip() for obs, action, _ in recent
        )


MEMORIES = {
    "none": NoMemory,
    "window": WindowMemory,
    "full": FullHistory,
    "visited": VisitedMemory,
    "boxes": BoxesMemory,
}


def make_memory(name, k=None):
    """k: window length / positions shown; None keeps the memory's own default."""
    if name not in MEMORIES:
        raise ValueError(f"unknown memory {name!r}: use --memory with one of {sorted(MEMORIES)}")
    return MEMORIES[name]() if k is None else MEMORIES[name](k)
