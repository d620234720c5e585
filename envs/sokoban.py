"""Sokoban: push every box onto a target, a gymnasium env written here (the PyPI gym-sokoban needs
the old gym and draws rooms from the global RNG, so a group could not share a start).

Rooms are generated as gym-sokoban does, from the reset seed alone: a random walk of 3x3 masks
carves the floor, targets and player are placed on it, then the boxes start on their targets and
are *pulled* backwards by a depth-first search of reverse moves (`search_depth` deep); the state
scoring highest (box swaps x box displacement) is the start. Every pull is the reverse of a push,
so every room is solvable (the tests check it with `solve` on many seeds), though not always
within `max_steps`. verl-agent's defaults: 6x6 room (the border walls included), 1 box, search
depth 30, 15 steps. Rewards as gym-sokoban: -0.1 per step, +1 for a box onto a target, -1 for a
box off one, +10 when every box is on a target (the episode ends; truncated after max_steps).

    obs:    the grid, one row per line, cells separated by spaces, then the legend:
            # # # # # #
            # _ _ P _ #
            # _ X _ _ #
            ...
            # wall, _ floor, O target, X box, √ box on target, P you, S you on a target
    action: up, down, left or right (anything else is a no-op step); anchor: the grid text

`python -m envs.sokoban` prints the random policy's success and the share of rooms solvable
within max_steps (BFS), on held-out seeds.
"""

import random
from collections import deque
from functools import lru_cache

import gymnasium

from envs import TextSpace

MOVES = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}
LEGEND = "# wall, _ floor, O target, X box, √ box on target, P you, S you on a target"
MASKS = [
    [(1, 0), (1, 1), (1, 2)],
    [(0, 1), (1, 1), (2, 1)],
    [(1, 0), (1, 1), (2, 1)],
    [(1, 0), (1, 1), (2, 0), (2, 1)],
    [(1, 1), (1, 2), (2, 1)],
]  # gym-sokoban's carving masks


def _topology(rng, rows, cols, walk_steps):
    """gym-sokoban's room_topology_generation: a random walk stamping masks; border stays wall."""
    floor, dirs = set(), list(MOVES.values())
    d = rng.choice(dirs)
    r, c = rng.randint(1, rows - 1), rng.randint(1, cols - 1)
    for _ in range(walk_steps):
        if rng.random() < 0.35:
            d = rng.choice(dirs)
        r, c = max(min(r + d[0], rows - 2), 1), max(min(c + d[1], cols - 2), 1)
        floor |= {(r - 1 + dr, c - 1 + dc) for dr, dc in rng.choice(MASKS)}
    return {(r, c) for r, c in floor if 0 < r < rows - 1 and 0 < c < cols - 1}


def _reverse_play(floor, targets, player, depth, ttl=300):
    """Depth-first search of reverse moves from the solved state (each move may pull the box behind
    the player); -> the best (score, player, boxes) seen, score = box swaps x total displacement."""
    best = (0, player, targets)
    seen, budget = set(), [ttl]

    def dfs(player, boxes, origin, swaps, last, left):
        nonlocal best
        if (player, boxes) in seen or budget[0] <= 0:
            return
        seen.add((player, boxes))
        budget[0] -= 1
        score = swaps * sum(abs(b[0] - t[0]) + abs(b[1] - t[1]) for b, t in origin.items())
        if score > best[0] and boxes != targets:
            best = (score, player, boxes)
        if left == 0:
            return
        for dr, dc in MOVES.values():
            nxt = (player[0] + dr, player[1] + dc)
            if nxt not in floor or nxt in boxes:
                continue
            dfs(nxt, boxes, origin, swaps, last, left - 1)  # a plain move
            behind = (player[0] - dr, player[1] - dc)
            if behind in boxes:  # a pull: the box follows the player
                moved = dict(origin)
                moved[player] = moved.pop(behind)
                dfs(nxt, boxes - {behind} | {player}, moved, swaps + (last != behind), player, left - 1)

    dfs(player, targets, {t: t for t in targets}, 0, None, depth)
    return best


@lru_cache(maxsize=4096)
def generate(seed, rows=6, cols=6, boxes=1, search_depth=30, tries=1000):
    """-> (floor, targets, boxes, player), frozensets of (row, col), from the seed alone."""
    rng = random.Random(seed)
    for _ in range(tries):
        floor = _topology(rng, rows, cols, int(1.7 * (rows + cols)))
        if len(floor) < boxes + 2:
            continue
        cells = rng.sample(sorted(floor), boxes + 1)
        targets, player = frozenset(cells[:boxes]), cells[boxes]
        score, start, box_cells = _reverse_play(frozenset(floor), targets, player, search_depth)
        if score > 0:
            return frozenset(floor), targets, box_cells, start
    raise ValueError(
        f"sokoban: no solvable room of {rows}x{cols} with {boxes} box(es) found in {tries} "
        f"tries; use fewer boxes or a larger room"
    )


def solve(floor, targets, boxes, player, limit=10**6):
    """Breadth-first search -> the fewest moves that put every box on a target, or None."""
    start = (player, frozenset(boxes))
    dist, queue = {start: 0}, deque([start])
    while queue and len(dist) < limit:
        state = queue.popleft()
        p, bs = state
        if bs == targets:
            return dist[state]
        for dr, dc in MOVES.values():
            nxt = (p[0] + dr, p[1] + dc)
            if nxt not in floor:
                continue
            if nxt in bs:
                ahead = (nxt[0] + dr, nxt[1] + dc)
                if ahead not in floor or ahead in bs:
                    continue
                new = (nxt, bs - {nxt} | {ahead})
            else:
                new = (nxt, bs)
            if new not in dist:
                dist[new] = dist[state] + 1
                queue.append(new)
    return None


class Sokoban(gymnasium.Env):
    def __init__(self, rows=6, cols=6, boxes=1, search_depth=30, max_steps=15):
        # the values come from --env_args as literals or plain strings: "boxes=abc" must fail here
        if not all(type(v) is int for v in (rows, cols, boxes, search_depth, max_steps)):
            raise ValueError(
                f"sokoban: rows, cols, boxes, search_depth and max_steps must be integers; got "
                f"rows={rows!r} cols={cols!r} boxes={boxes!r} search_depth={search_depth!r} "
                f"max_steps={max_steps!r}"
            )
        # a push needs three cells in a line inside the border walls
        if (
            boxes < 1
            or min(rows, cols) < 3
            or max(rows, cols) < 5
            or (rows - 2) * (cols - 2) < boxes + 2
            or search_depth < 1
            or max_steps < 1
        ):
            raise ValueError(
                f"sokoban: need boxes >= 1, a room of at least 3x5 (border walls included) with "
                f"(rows-2)*(cols-2) >= boxes + 2, search_depth >= 1 and max_steps >= 1; got rows={rows} "
                f"cols={cols} boxes={boxes} search_depth={search_depth} max_steps={max_steps}"
            )
        self.rows, self.cols, self.n_boxes = rows, cols, boxes
        self.search_depth, self.max_steps = search_depth, max_steps
        self.observation_space = TextSpace()
        self.action_space = TextSpace(MOVES)

    def reset(self, seed=None, options=None):
        """reset(seed) or reset(seed=...): the room depends on the seed alone; without one, a room
        drawn from the env's np_random (gymnasium's convention)."""
        super().reset(seed=seed)
        room = seed if seed is not None else int(self.np_random.integers(2**62))
        self.floor, self.targets, self.boxes, self.player = generate(
            room, self.rows, self.cols, self.n_boxes, self.search_depth
        )
        self.steps = 0
        return self._obs(), self._info(False)

    def step(self, action):
        self.steps += 1
        reward = -0.1
        if action in MOVES:  # anything else (an invalid action) leaves everything in place
            dr, dc = MOVES[action]
            nxt = (self.player[0] + dr, self.player[1] + dc)
            ahead = (nxt[0] + dr, nxt[1] + dc)
            if nxt in self.boxes and ahead in self.floor and ahead not in self.boxes:
                self.boxes = self.boxes - {nxt} | {ahead}
                reward += (ahead in self.targets) - (nxt in self.targets)
                self.player = nxt
            elif nxt in self.floor and nxt not in self.boxes:
                self.player = nxt
        won = self.boxes == self.targets
        reward += 10.0 * won
        return self._obs(), round(reward, 6), won, not won and self.steps >= self.max_steps, self._info(won)

    def grid(self):
        def cell(rc):
            if rc == self.player:
                return "S" if rc in self.targets else "P"
            if rc in self.boxes:
                return "√" if rc in self.targets else "X"
            return "O" if rc in self.targets else "_" if rc in self.floor else "#"

        return "\n".join(" ".join(cell((r, c)) for c in range(self.cols)) for r in range(self.rows))

    def _obs(self):
        return f"{self.grid()}\n{LEGEND}"

    def _info(self, won):
        return {
            "task": "push every box onto a target",
            "admissible_actions": list(MOVES),
            "won": won,
            "anchor": self.grid(),
        }

    def shortest_solution(self):
        """Fewest moves from the current state to solved (BFS), or None; for baselines and tests."""
        return solve(self.floor, self.targets, self.boxes, self.player)


def baselines(n=2000, seed_base=10**9, **kw):
    """-> (random policy success, share of rooms solvable within max_steps) over n held-out seeds."""
    env, rng, wins, fits = Sokoban(**kw), random.Random(0), 0, 0
    for s in range(n):
        env.reset(seed_base + s)
        best = env.shortest_solution()
        fits += best is not None and best <= env.max_steps
        done = False
        while not done:
            _, _, won, trunc, _ = env.step(rng.choice(list(MOVES)))
            done = won or trunc
        wins += won
    return wins / n, fits / n


if __name__ == "__main__":
    import sys

    from envs import script_args

    kw = script_args("sokoban", sys.argv[1:])  # e.g. python -m envs.sokoban rows=5 cols=5
    rand, fits = baselines(**kw)
    env = Sokoban(**kw)
    print(
        f"sokoban {env.rows}x{env.cols}, {env.n_boxes} box(es), {env.max_steps} steps, 2000 held-out seeds: "
        f"random policy {rand:.3f}, solvable within max_steps (optimal policy) {fits:.3f}"
    )
