import random

import gymnasium
import pytest
from gymnasium.utils.env_checker import check_env

from envs import GroupedEnvs, make_env
from envs.sokoban import MOVES, Sokoban, generate
from memory import make_memory
from prompts import prompt_module


def test_generation_depends_on_the_seed_alone():
    a, b = Sokoban(), Sokoban()
    b.reset(99)  # another room and some moves in between change nothing
    b.step("up")
    generate.cache_clear()
    for seed in range(50):
        assert a.reset(seed) == b.reset(seed=seed)
    assert len({Sokoban().reset(s)[0] for s in range(50)}) > 40
    envs = GroupedEnvs("sokoban", 3, 4)  # the grouped env's identical-start check passes
    obs, infos = envs.reset([1, 2, 3])
    assert obs[0] == obs[3] != obs[4] and infos[0]["anchor"] == obs[0].split("\n# wall")[0]


@pytest.mark.parametrize("kw", [{}, {"rows": 5, "cols": 5}, {"rows": 7, "cols": 7, "boxes": 2}])
def test_every_room_is_solvable(kw):
    """Reverse play from the solved state: a BFS over pushes finds a solution on every seed."""
    env = Sokoban(**kw)
    lengths = []
    for seed in range(300 if kw else 1000):
        env.reset(seed)
        assert env.boxes != env.targets and len(env.boxes) == len(env.targets) == env.n_boxes
        best = env.shortest_solution()
        assert best is not None and best >= 1, seed
        lengths.append(best)
    if not kw:  # the default room: every one solvable within the 15 steps
        assert max(lengths) <= 15


def set_room(env, text):
    """Put a hand-made room (the env's symbols, no spaces) into a reset env."""
    cells = {(r, c): ch for r, line in enumerate(text.split()) for c, ch in enumerate(line)}
    env.floor = frozenset(rc for rc, ch in cells.items() if ch != "#")
    env.targets = frozenset(rc for rc, ch in cells.items() if ch in "O√S")
    env.boxes = frozenset(rc for rc, ch in cells.items() if ch in "X√")
    env.player = next(rc for rc, ch in cells.items() if ch in "PS")


def test_rewards_on_scripted_moves():
    env = Sokoban()
    env.reset(0)
    set_room(env, "###### #PX_O# #____# #_X_O# ######")
    assert env.grid().split("\n")[1] == "# P X _ O #"
    assert env.step("up")[1:4] == (-0.1, False, False) and env.player == (1, 1)  # into the wall: stays
    assert env.step("fly")[1] == -0.1  # invalid: a no-op step
    assert env.step("right")[1] == -0.1 and (1, 3) in env.boxes  # a push, not onto a target
    obs, r, term, trunc, info = env.step("right")  # box onto a target
    assert (r, term, info["won"]) == (0.9, False, False) and "√" in obs  # one box still off
    assert env.step("left")[1] == -0.1  # walking off: no box moves
    set_room(env, "###### #P√__# #____# ######")
    assert env.step("right")[1] == -1.1  # box off a target
    set_room(env, "###### #PX_O# #____# ######")
    env.step("right")
    obs, r, term, trunc, info = env.step("right")  # the last box on: solved
    assert (r, term, trunc, info["won"]) == (10.9, True, False, True)


def test_truncates_after_max_steps():
    env = Sokoban(max_steps=3)
    env.reset(4)
    outs = [env.step("fly") for _ in range(3)]
    assert [o[3] for o in outs] == [False, False, True] and not any(o[2] for o in outs)


def test_gymnasium_check_env_and_make():
    check_env(Sokoban(), skip_render_check=True)
    env = gymnasium.make("gigpo/Sokoban-v0", rows=5, cols=5)
    obs, info = env.reset(seed=3)
    assert env.observation_space.contains(obs) and info["anchor"] in obs
    assert env.action_space.sample() in MOVES


@pytest.mark.parametrize("chat", [False, True])
def test_parser_never_raises(chat):
    prompt, rng = prompt_module("sokoban", chat=chat), random.Random(0)
    alphabet = "updownleftright .!\"'*`\n\t#_√XOP\x00é"
    for _ in range(2000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        action, valid = prompt.parse(text, list(MOVES))
        assert valid == (action in MOVES) and isinstance(action, str)
        if not valid:
            assert action == text.strip().lower()[-30:] or chat
    assert prompt.parse(None, list(MOVES)) == ("", False)
    assert prompt.parse("down", list(MOVES)) == ("down", True)
    assert prompt_module("sokoban", chat=True).parse(' "Left."', list(MOVES)) == ("left", True)


def test_prompts_and_memory():
    env = Sokoban()
    obs, info = env.reset(5)
    tiny = prompt_module("sokoban").build(info["task"], "", obs, info["admissible_actions"], 0)[0]["content"]
    assert tiny.startswith("P ") and "wall" not in tiny and tiny.count("/") == env.rows - 3
    chat = prompt_module("sokoban", chat=True).build(info["task"], "", obs, info["admissible_actions"], 0)
    assert info["anchor"] in chat[0]["content"] and "one word" in chat[0]["content"]
    mem = make_memory("boxes", 2)
    mem.reset(info["task"])
    for a in ("down", "left", "up"):
        mem.add(obs, a, 0)
        obs = env.step(a)[0]
    assert mem.text().count("P ") == 2 and mem.text().endswith("up") and "O" not in mem.text()
    treasure = make_memory("boxes")  # another env's observations: just the moves, no crash
    treasure.reset("t")
    treasure.add("at (1, 3) treasure (4, 0)", "up", 0)
    assert treasure.text() == "up"


@pytest.mark.parametrize("env_args", ["boxes=0", "rows=4,cols=4", "rows=5,cols=5,boxes=8", "boxes=one"])
def test_bad_env_args_are_one_line(env_args, tmp_path):
    import train

    cfg = train.parse_args(["--env", "sokoban", "--env_args", env_args, "--out_dir", str(tmp_path / "out")])
    with pytest.raises(SystemExit) as e:
        train.check_config(cfg)
    msg = str(e.value.code)
    assert msg.startswith("error: --env_args") and "\n" not in msg, msg


def test_make_env_default():
    env = make_env("sokoban")
    assert (env.rows, env.cols, env.n_boxes, env.search_depth, env.max_steps) == (6, 6, 1, 30, 15)
