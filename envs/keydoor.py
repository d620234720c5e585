"""Key and door: a grid game built to need step-level credit (the credit-assignment example).

The agent must walk onto the key (it picks it up), then onto the door (it opens: reward 1, the
episode ends). Start, key, door and walls are drawn from the seed; a policy that wins must read
the coordinates, which change meaning halfway (first go to the key, then to the door).

    obs:    "at (1, 3) key (4, 0) door (2, 2)"   then, key in hand: "at (4, 0) door (2, 2) have key"
            (walls, if any, follow: "wall (0, 1) wall (3, 3)")
    action: up, down, left or right; a move into the border or a wall stays put, as does any other text
    reward: 1.0 when the door opens, else 0 (sparse: no progress term); truncated after max_steps

Why an episode's score is a weak teacher here, and GiGPO's step groups a strong one:
  * Long horizon, sparse reward. With 40 steps allowed on a 5x5 grid, a random walk wins about a
    quarter of its episodes (`python -m envs.keydoor`), almost always by a long detour. GRPO gives
    every one of those ~30 steps the same episode advantage: the step that walked into the border
    and the step that reached the key are credited alike, and the ranking of a group's episodes
    says only which walks happened to end well.
  * Length does not count. A win in 8 steps and a win in 39 score the same 1.0, so once most
    episodes of a group win, the episode scores tie and GRPO's advantage is 0 for every step,
    including the wasted ones; a policy that dithers (two cells back and forth) is never corrected
    while its sampled walks still win. GiGPO's step return is discounted (gamma^k for a door k
    steps ahead), so within one state the move that gets there sooner gets the larger return.
  * States recur. There is no step counter in the observation, and the 8 episodes of a group
    share start, key and door: the same (cell, key held or not) comes back within a walk (a bump
    into the border or a wall leaves it unchanged) and across the group's walks. Those repeats are
    GiGPO's anchor-state step groups, where A^S compares the actions taken in the same state by
    their discounted returns: a Monte-Carlo estimate of Q(s, a) - V(s) that the rest of the
    episode's luck does not drown.
  * A key before a door. Reaching the key is necessary and worth nothing by itself; in a group where
    some walks win, the steps towards the key of the winning walks and those away from it in the
    losing ones meet in the same states, and A^S separates them.

`key=0` drops the key (walk to the door: the sparse treasure hunt, long); `walls=N` adds N walls
(dead ends where a straight walk bumps); reset redraws until the key and the door can be reached.
`pool_bumps=1` gives the step after a move that changed nothing the anchor "Nothing happens." (what
ALFWorld answers an inert action, and so its anchor there), pooling all such steps of a group into
one step group whatever their state; the observation the policy sees is unchanged. It measures
what that pooling costs GiGPO (bench/README.md, "Key and door").
"""

import math
import random
import re
from collections import deque

import gymnasium

from envs import TextSpace

MOVES = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}
INERT = "Nothing happens."  # --env_args pool_bumps=1: the anchor after a move that changed nothing


class KeyDoor(gymnasium.Env):
    def __init__(self, size=5, max_steps=40, walls=0, key=1, pool_bumps=0):
        if not all(type(v) is int for v in (size, max_steps, walls, key, pool_bumps)):
            raise ValueError(
                f"keydoor: size, max_steps, walls, key and pool_bumps must be integers; got size={size!r} "
                f"max_steps={max_steps!r} walls={walls!r} key={key!r} pool_bumps={pool_bumps!r}"
            )
        if (
            size < 2
            or max_steps < 1
            or not 0 <= walls <= size * size // 3
            or key not in (0, 1)
            or pool_bumps not in (0, 1)
        ):
            raise ValueError(
                f"keydoor: need size >= 2, max_steps >= 1, 0 <= walls <= size^2 / 3, key and "
                f"pool_bumps 0 or 1; got size={size} max_steps={max_steps} walls={walls} key={key} "
                f"pool_bumps={pool_bumps}"
            )
        self.size, self.max_steps, self.n_walls, self.use_key = size, max_steps, walls, bool(key)
        self.pool_bumps = bool(pool_bumps)
        self.observation_space, self.action_space = TextSpace(), TextSpace(MOVES)

    def reset(self, seed=None, options=None):
        """The layout from the seed alone (python's Random); redrawn until start -> key -> door is
        walkable."""
        super().reset(seed=seed)
        rng = random.Random(seed if seed is not None else int(self.np_random.integers(2**62)))
        cells = [(r, c) for r in range(self.size) for c in range(self.size)]
        while True:
            picks = rng.sample(cells, 3 + self.n_walls)
            self.pos, self.door, self.key, self.walls = picks[0], picks[1], picks[2], set(picks[3:])
            if not self.use_key:
                self.key = None
            if all(self.distance(a, b) < math.inf for a, b in self._legs()):
                break
        self.has_key, self.steps = not self.use_key, 0
        return self._obs(), self._info(won=False)

    def step(self, action):
        self.steps += 1
        before = (self.pos, self.has_key)
        if action in MOVES:  # anything else (an invalid action) leaves the agent in place
            dr, dc = MOVES[action]
            nxt = (self.pos[0] + dr, self.pos[1] + dc)
            if self._free(nxt):
                self.pos = nxt
        if self.pos == self.key and not self.has_key:
            self.has_key = True
        won = self.has_key and self.pos == self.door
        truncated = not won and self.steps >= self.max_steps
        info = self._info(won)
        if self.pool_bumps and (self.pos, self.has_key) == before:
            info["anchor"] = INERT
        return self._obs(), float(won), won, truncated, info

    def _free(self, cell):
        return 0 <= cell[0] < self.size and 0 <= cell[1] < self.size and cell not in self.walls

    def _legs(self):
        return [(self.pos, self.key), (self.key, self.door)] if self.use_key else [(self.pos, self.door)]

    def distance(self, a, b):
        """Shortest walk from cell a to cell b around the walls (breadth-first); inf if none."""
        seen, todo = {a: 0}, deque([a])
        while todo:
            cell = todo.popleft()
            if cell == b:
                return seen[cell]
            for dr, dc in MOVES.values():
                nxt = (cell[0] + dr, cell[1] + dc)
                if nxt not in seen and self._free(nxt):
                    seen[nxt] = seen[cell] + 1
                    todo.append(nxt)
        return math.inf

    def optimal_action(self):
        """A move on a shortest walk to the current target (the key, then the door)."""
        target = self.door if self.has_key else self.key
        here = self.distance(self.pos, target)
        for move, (dr, dc) in MOVES.items():
            nxt = (self.pos[0] + dr, self.pos[1] + dc)
            if self._free(nxt) and self.distance(nxt, target) < here:
                return move
        return "up"

    def _obs(self):
        (r, c), (dr, dc) = self.pos, self.door
        key = (
            " have key"
            if self.use_key and self.has_key
            else f" key ({self.key[0]}, {self.key[1]})"
            if self.use_key
            else ""
        )
        walls = "".join(f" wall ({wr}, {wc})" for wr, wc in sorted(self.walls))
        if self.use_key and not self.has_key:
            return f"at ({r}, {c}){key} door ({dr}, {dc}){walls}"
        return f"at ({r}, {c}) door ({dr}, {dc}){key}{walls}"

    def _info(self, won):
        task = "pick up the key, then open the door" if self.use_key else "walk to the door"
        return {"task": task, "admissible_actions": list(MOVES), "won": won}


def good_moves(obs, size=5):
    """The moves that shorten the walk to the current target (the key, or the door once the key is held)
    in the state an observation shows: what bench/credit.py calls a step towards the goal."""
    cells = {k: (int(r), int(c)) for k, r, c in re.findall(r"(at|key|door) \((\d+), (\d+)\)", obs)}
    env = KeyDoor(size=size, walls=0, key=1)
    env.pos, env.door, env.key = cells["at"], cells["door"], cells.get("key")
    env.walls = {(int(r), int(c)) for r, c in re.findall(r"wall \((\d+), (\d+)\)", obs)}
    target = env.key or env.door
    here = env.distance(env.pos, target)
    return {
        m
        for m, (dr, dc) in MOVES.items()
        if env._free((env.pos[0] + dr, env.pos[1] + dc))
        and env.distance((env.pos[0] + dr, env.pos[1] + dc), target) < here
    }


def rates(n=20000, seed_base=10**9, **kw):
    """(random policy success, its mean winning length, optimal success, optimal mean length) over n seeds."""
    env, rng, out = KeyDoor(**kw), random.Random(0), []
    for policy in (lambda: rng.choice(list(MOVES)), env.optimal_action):
        wins, lengths = 0, []
        for s in range(n):
            env.reset(seed_base + s)
            done = False
            while not done:
                _, _, won, trunc, _ = env.step(policy())
                done = won or trunc
            wins += won
            lengths += [env.steps] if won else []
        out += [wins / n, sum(lengths) / max(len(lengths), 1)]
    return tuple(out)


if __name__ == "__main__":
    import sys

    from envs import script_args

    kw = script_args("keydoor", sys.argv[1:])  # e.g. python -m envs.keydoor size=6 walls=4
    rand, rand_len, opt, opt_len = rates(n=5000, **kw)
    print(
        f"keydoor {kw or 'defaults'}: random policy {rand:.3f} (wins take {rand_len:.1f} steps), "
        f"optimal {opt:.3f} ({opt_len:.1f} steps)"
    )
