"""Treasure hunt: a grid game in text, built in, no data needed (the repo's "shakespeare_char").

The agent stands on a size x size grid and must walk onto the treasure. Start and treasure are drawn
from the reset seed, so a policy that wins must read the coordinates in the observation. The
observation has no step counter, so the same state recurs across the trajectories of a group: the
anchor states GiGPO groups on.

    obs:    "at (1, 3) treasure (4, 0)"        (row, column); row 0 is the top row
    action: one of "up", "down", "left", "right"; a move into the border (or a wall) stays put
    reward: 1.0 on reaching the treasure (episode ends; truncated after max_steps), plus a progress
            term each step: progress x (distance before - distance after), Manhattan distance, so
            +0.1 for a step towards the treasure, -0.1 for one away, 0 for bumping into the border.
            It is potential-based shaping (Ng et al. 1999): it rewards the same policies as the sparse
            game (exactly so at gamma 1), but a step's credit arrives at once, and a group whose
            episodes all fail still ranks them by how close they got. `progress=0` is the sparse game.

Success rates on 5x5, max 10 steps, no walls (measured by `python -m envs.treasure`, 20k seeds):
a uniformly random policy wins ~0.21; the optimal policy (greedy Manhattan walk) wins 1.0, since
the largest distance is 8 < 10 steps. With walls the optimal rate can be lower (walls may box in).
"""

import math
import random

import gymnasium

from envs import TextSpace

MOVES = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}


class TreasureHunt(gymnasium.Env):
    def __init__(self, size=5, max_steps=10, walls=0, progress=0.1):
        # the values come from --env_args as literals or plain strings: "progress=abc" must fail here
        if (
            not all(type(v) is int for v in (size, max_steps, walls))
            or type(progress) not in (int, float)
            or not math.isfinite(progress)
        ):
            raise ValueError(
                f"treasure: size, max_steps and walls must be integers and progress a finite "
                f"number; got size={size!r} max_steps={max_steps!r} walls={walls!r} progress={progress!r}"
            )
        if size < 2 or max_steps < 1 or walls < 0 or walls > size * size - 2:
            raise ValueError(
                f"treasure: need size >= 2, max_steps >= 1, 0 <= walls <= size^2 - 2; "
                f"got size={size} max_steps={max_steps} walls={walls}"
            )
        self.size, self.max_steps, self.n_walls, self.progress = size, max_steps, walls, progress
        self.observation_space, self.action_space = TextSpace(), TextSpace(MOVES)

    def reset(self, seed=None, options=None):
        """reset(seed) or reset(seed=...): the grid depends on the seed alone (python's Random, as
        always); without one, a seed drawn from the env's np_random (gymnasium's convention).
        options={"start": (r, c), "treasure": (r, c)} starts from that state instead, with no walls
        (bench/sft.py plays every start/treasure pair this way)."""
        super().reset(seed=seed)
        rng = random.Random(seed if seed is not None else int(self.np_random.integers(2**62)))
        cells = [(r, c) for r in range(self.size) for c in range(self.size)]
        picks = rng.sample(cells, 2 + self.n_walls)
        self.pos, self.treasure, self.walls = picks[0], picks[1], set(picks[2:])
        if options and {"start", "treasure"} <= set(options):
            self.pos, self.treasure, self.walls = tuple(options["start"]), tuple(options["treasure"]), set()
            if not all(0 <= x < self.size for x in (*self.pos, *self.treasure)) or self.pos == self.treasure:
                raise ValueError(
                    f"treasure: start {self.pos} and treasure {self.treasure} must be two different "
                    f"cells of the {self.size}x{self.size} grid"
                )
        self.steps = 0
        return self._obs(), self._info(won=False)

    def step(self, action):
        self.steps += 1
        before = self._distance()
        if action in MOVES:  # anything else (an invalid action) leaves the agent in place
            dr, dc = MOVES[action]
            r, c = self.pos[0] + dr, self.pos[1] + dc
            if 0 <= r < self.size and 0 <= c < self.size and (r, c) not in self.walls:
                self.pos = (r, c)
        won = self.pos == self.treasure
        truncated = not won and self.steps >= self.max_steps
        reward = float(won) + self.progress * (before - self._distance())
        return self._obs(), reward, won, truncated, self._info(won)

    def _distance(self):
        return abs(self.pos[0] - self.treasure[0]) + abs(self.pos[1] - self.treasure[1])

    def _obs(self):
        (r, c), (tr, tc) = self.pos, self.treasure
        walls = "".join(f" wall ({wr}, {wc})" for wr, wc in sorted(self.walls))
        return f"at ({r}, {c}) treasure ({tr}, {tc}){walls}"

    def _info(self, won):
        return {"task": "find the treasure", "admissible_actions": list(MOVES), "won": won}

    def optimal_action(self):
        """The greedy Manhattan move (optimal without walls); used for baselines and tests."""
        (r, c), (tr, tc) = self.pos, self.treasure
        if r != tr:
            return "down" if tr > r else "up"
        return "right" if tc > c else "left"


def success_rate(policy, n=20000, seed_base=10**9, **kw):
    """Share of episodes won by policy(env, rng) -> action over n seeds."""
    env, rng, wins = TreasureHunt(**kw), random.Random(0), 0
    for s in range(n):
        env.reset(seed_base + s)
        done = False
        while not done:
            _, _, won, trunc, _ = env.step(policy(env, rng))
            done = won or trunc
        wins += won
    return wins / n


def all_states(size=5):
    """Every (start, treasure) pair of a size x size grid without walls: 600 for 5x5."""
    cells = [(r, c) for r in range(size) for c in range(size)]
    return [(a, b) for a in cells for b in cells if a != b]


def shortest_moves(pos, treasure):
    """The one or two moves that bring pos closer to the treasure (no walls)."""
    (r, c), (tr, tc) = pos, treasure
    return ({"down" if tr > r else "up"} if tr != r else set()) | (
        {"right" if tc > c else "left"} if tc != c else set()
    )


if __name__ == "__main__":
    rand = success_rate(lambda env, rng: rng.choice(list(MOVES)))
    opt = success_rate(lambda env, rng: env.optimal_action())
    print(f"treasure 5x5, 10 steps: random policy {rand:.3f}, optimal policy {opt:.3f}")
