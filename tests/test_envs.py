import contextlib

import pytest

from envs import ENVS, GroupedEnvs, make_env
from envs.treasure import MOVES, TreasureHunt, success_rate
from memory import MEMORIES, make_memory
from prompts import prompt_module
from prompts.treasure import parse


def test_treasure_moves_and_borders():
    env = TreasureHunt(size=5, max_steps=10, progress=0.0)  # the sparse game
    env.reset(seed=1, options={"start": (0, 0), "treasure": (2, 1)})
    assert env.step("up")[0].startswith("at (0, 0)")  # border: stays
    assert env.step("left")[0].startswith("at (0, 0)")
    assert env.step("down")[0].startswith("at (1, 0)")
    assert env.step("dance")[0].startswith("at (1, 0)")  # invalid: a no-op, not a crash
    obs, r, term, trunc, info = env.step("right")  # (1, 1)
    assert (r, term) == (0.0, False)
    obs, r, term, trunc, info = env.step("down")  # (2, 1) = treasure
    assert (r, term, trunc, info["won"]) == (1.0, True, False, True)


def test_treasure_progress_reward():
    """+progress per step towards the treasure, -progress away, 0 for a bump; 1 more on the win."""
    env = TreasureHunt(size=5, max_steps=10, progress=0.1)
    env.reset(seed=1, options={"start": (0, 0), "treasure": (1, 1)})
    rewards = [env.step(a)[1] for a in ("up", "right", "left", "dance", "right", "down")]
    assert rewards == pytest.approx([0.0, 0.1, -0.1, 0.0, 0.1, 1.1])
    # a whole episode's progress sums to progress x (start distance - end distance): potential-based
    env.reset(seed=2, options={"start": (4, 4), "treasure": (0, 0)})
    total = sum(env.step(a)[1] for a in ("up", "left", "down", "up", "up"))
    assert total == pytest.approx(0.1 * (8 - 5))


def test_treasure_truncates_and_has_no_step_counter():
    env = TreasureHunt(size=5, max_steps=3)
    env.reset(seed=7, options={"start": (0, 0), "treasure": (4, 4)})
    seen = [env.step(a)[0] for a in ("up", "up")]
    assert seen[0] == seen[1]  # same state, same text: anchors recur
    assert env.step("up")[3] is True  # truncated at max_steps


def test_reset_depends_on_seed_only():
    a, b = TreasureHunt(), TreasureHunt()
    assert a.reset(5)[0] == b.reset(5)[0]
    assert len({TreasureHunt().reset(s)[0] for s in range(50)}) > 30


def test_reset_from_a_given_state():
    env = TreasureHunt(walls=3)
    obs, _ = env.reset(seed=3, options={"start": (1, 2), "treasure": (4, 0)})
    assert obs.startswith("at (1, 2) treasure (4, 0)") and "wall" not in obs
    for bad in ({"start": (1, 2), "treasure": (1, 2)}, {"start": (5, 0), "treasure": (0, 0)}):
        with pytest.raises(ValueError, match="two different cells"):
            env.reset(seed=3, options=bad)


def test_random_and_optimal_baselines():
    rand = success_rate(lambda env, rng: rng.choice(list(MOVES)), n=3000)
    opt = success_rate(lambda env, rng: env.optimal_action(), n=3000)
    assert 0.15 < rand < 0.3 and opt == 1.0


def test_walls_block():
    env = TreasureHunt(walls=3)
    obs, _ = env.reset(seed=3)
    assert obs.count("wall") == 3
    wall = next(iter(env.walls))
    env.pos = (wall[0] - 1, wall[1]) if wall[0] > 0 else (wall[0] + 1, wall[1])
    before = env.pos
    env.step("down" if wall[0] > before[0] else "up")
    assert env.pos == before


@pytest.mark.parametrize("workers", [0, 2])
def test_grouped_envs_identical_starts(workers):
    envs = GroupedEnvs("treasure", n_groups=3, group_size=4, workers=workers)
    try:
        obs, infos = envs.reset([11, 12, 13])
        assert len(obs) == 12
        for g in range(3):
            assert len(set(obs[g * 4 : (g + 1) * 4])) == 1
        assert len({obs[0], obs[4], obs[8]}) == 3
        res = envs.step({0: "up", 5: "nonsense"})
        assert sorted(res) == [0, 5] and res[5][0] == obs[5]
    finally:
        envs.close()


def test_a_prefetched_reset_is_the_reset_and_runs_before_it_is_asked():
    """prefetch (train.py: the next iteration's games load during the update): the workers answer
    before reset() is called, and reset() returns what a plain reset of those seeds does; a prefetch
    of other seeds is read away, so the pipes stay in step for the reset and steps after it."""
    envs, plain = (GroupedEnvs("treasure", n_groups=3, group_size=2, workers=2) for _ in range(2))
    try:
        envs.prefetch([5, 6, 7])
        assert all(conn.poll(30) for conn in envs.conns)  # both workers have answered already
        assert envs.reset([5, 6, 7]) == plain.reset([5, 6, 7])
        envs.prefetch([8, 9, 10])
        assert envs.reset([1, 2, 3]) == plain.reset([1, 2, 3])
        assert envs.step({0: "up", 5: "left"}) == plain.step({0: "up", 5: "left"})
        envs.prefetch([4, 4, 4])  # left pending: close() still ends the workers
    finally:
        envs.close(), plain.close()
    assert not any(p.is_alive() for p in envs.procs)


class Closing(TreasureHunt):
    closed = 0

    def close(self):
        self.closed += 1


def test_grouped_envs_close_their_in_process_envs(monkeypatch):
    """workers=0: close() reaches every env (an ALFWorld game frees its planner library there)."""
    import envs as registry

    monkeypatch.setitem(registry.ENVS, "closing", ("tests.test_envs", "Closing", {}))
    envs = GroupedEnvs("closing", n_groups=2, group_size=3)
    envs.close()
    assert [e.closed for e in envs.envs] == [1] * 6


class Unseeded(TreasureHunt):
    count = 0

    def reset(self, seed):
        Unseeded.count += 1
        return super().reset(seed + Unseeded.count)  # depends on more than the seed


def test_group_mismatch_fails_loudly(monkeypatch):
    import envs as registry

    monkeypatch.setitem(registry.ENVS, "unseeded", ("tests.test_envs", "Unseeded", {}))
    envs = GroupedEnvs("unseeded", n_groups=1, group_size=2)
    with pytest.raises(RuntimeError, match="group 0"):
        envs.reset([0])


class FreeText(TreasureHunt):
    """An env that lists no admissible actions (free-text answers; the README allows it)."""

    def _info(self, won):
        return {**super()._info(won), "admissible_actions": []}


def test_an_env_without_admissible_actions_builds_the_tiny_corpus_and_a_random_baseline(monkeypatch):
    """The tiny model's corpus and the random baseline play a random admissible action; with none
    listed they play the empty action (a no-op step) instead of crashing."""
    import sys

    import envs as registry
    import evaluate
    import prompts.treasure
    import tiny
    import train

    monkeypatch.setitem(registry.ENVS, "freetext", ("tests.test_envs", "FreeText", {}))
    monkeypatch.setitem(sys.modules, "prompts.freetext", prompts.treasure)
    text = list(tiny.corpus("freetext", episodes=2))
    assert any(t.startswith("at (") for t in text)
    cfg = train.Config(env="freetext", eval_episodes=3)
    rates = evaluate.random_policy_success(cfg, GroupedEnvs("freetext", 3, 1))
    assert rates == {"held-out": 0.0}  # the no-op never walks onto the treasure


# the model side of the project (and the libraries only it needs), which no env or prompt imports
MODEL_SIDE = set(
    "tiny rollout train ppo fsdp evaluate records checks gigpo memory smollm2 bench torch transformers vllm "
    "peft".split()
)


@pytest.mark.parametrize("package, banned", [("envs", MODEL_SIDE | {"prompts"}), ("prompts", MODEL_SIDE)])
def test_imports_run_one_way(package, banned):
    """No env imports a prompt module or anything of a model (envs/__init__.py): prompts may import
    from envs, never the reverse, and neither imports a model; every import statement counts, also
    one inside a function."""
    import ast
    import glob
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for path in sorted(glob.glob(os.path.join(root, package, "*.py"))):
        for node in ast.walk(ast.parse(open(path).read())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and not node.level
                else []
            )
            for name in names:
                assert name.split(".")[0] not in banned, f"{os.path.relpath(path, root)} imports {name}"


def test_unknown_names():
    with pytest.raises(ValueError, match="--env"):
        make_env("nope")
    with pytest.raises(ValueError, match="--memory"):
        make_memory("nope")
    with pytest.raises(ValueError, match="prompts/nope.py"):
        prompt_module("nope")


def test_parser_never_raises():
    adm = list(MOVES)
    assert parse("up", adm) == ("up", True)
    assert parse("  LEFT \n", adm) == ("left", True)
    for junk in ["", None, "up left", "upward", "<eos>", "x" * 100, "\x00\n"]:
        action, valid = parse(junk, adm)
        assert valid is False and isinstance(action, str) and len(action) <= 30


def test_prompt_build_contains_obs_and_history():
    p = prompt_module("treasure")
    msgs = p.build("find the treasure", "visited (0, 0)", "at (1, 1) treasure (2, 2)", list(MOVES), 3)
    assert msgs[-1]["role"] == "user"
    assert msgs[-1]["content"] == "visited (0, 0) at (1, 1) treasure (2, 2)"


def test_chat_prompt_explains_the_game_and_parses_chat_replies():
    p = prompt_module("treasure", chat=True)
    text = p.build("t", "visited (0, 0)", "at (1, 3) treasure (4, 0) wall (2, 2)", list(MOVES), 0)[0][
        "content"
    ]
    for part in (
        "You are at row 1, column 3.",
        "The treasure is at row 4, column 0, that is 3 rows below you and 3 columns to your left.",
        "Walls: (2, 2).",
        "down (row + 1)",
        "Memory: visited (0, 0)",
        "Answer with one word",
    ):
        assert part in text
    adm = list(MOVES)
    for reply, action in [("Down.", "down"), (" up\n", "up"), ("**Left**", "left"), ("'right'!", "right")]:
        assert p.parse(reply, adm) == (action, True)
    for junk in ["", None, "go down", "down, then left", "...", "x" * 100]:
        action, valid = p.parse(junk, adm)
        assert valid is False and isinstance(action, str) and len(action) <= 30
    assert prompt_module("alfworld", chat=True).build is prompt_module("alfworld").build  # no chat variant
    for obs, where in [
        ("at (2, 2) treasure (2, 3)", "in your row and 1 column to your right"),
        ("at (4, 1) treasure (3, 1)", "1 row above you and in your column"),
    ]:
        assert f"that is {where}." in p.build("t", "", obs, adm, 0)[0]["content"]


def test_memories():
    steps = [
        ("at (0, 0) treasure (2, 2)", "down"),
        ("at (1, 0) treasure (2, 2)", "up"),
        ("at (0, 0) treasure (2, 2)", "right"),
    ]
    mems = {name: make_memory(name) for name in MEMORIES}
    for m in mems.values():
        m.reset("find the treasure")
        assert m.text() == ""
        for obs, a in steps:
            m.add(obs, a, 0.0)
    assert mems["none"].text() == ""
    assert mems["window"].text() == "[at (1, 0) treasure (2, 2) -> up] [at (0, 0) treasure (2, 2) -> right]"
    assert mems["full"].text().count("->") == 3
    assert mems["visited"].text() == "visited (1, 0) (0, 0) last right"  # by last visit
    short = make_memory("visited", 1)
    short.reset("t")
    for obs, a in steps:
        short.add(obs, a, 0.0)
    assert short.text() == "visited (0, 0) last right"  # the cell visited last, though first seen first
    assert make_memory("window", 1).text() == ""
    w = make_memory("window", 1)
    w.reset("t")
    w.add("a", "up", 0)
    w.add("b", "down", 0)
    assert w.text() == "[b -> down]"
    mems["window"].reset("again")
    assert mems["window"].text() == ""


@pytest.mark.parametrize("name", sorted(ENVS))
def test_every_env_is_a_checked_gymnasium_env(name, tmp_path):
    """gymnasium.make works for every registered env and gymnasium's env checker passes; reset(seed)
    (how GroupedEnvs calls it) equals reset(seed=...). ALFWorld on the games test_alfworld.py finds
    or unpacks ($ALFWORLD_DATA, else the archive in ../shared: skipped only without either);
    WebShop and Search on their generated demo sets; AppWorld against test_appworld.py's stand-in server."""
    module, cls, kwargs = ENVS[name]
    if name == "alfworld":
        from test_alfworld import games_dir  # before alfworld is imported: it sets $ALFWORLD_DATA

        kwargs = {"split": "valid_unseen", "data_dir": games_dir()}
    if name in ("webshop", "search"):
        from envs import demo

        kwargs = {"data_dir": getattr(demo, name)(str(tmp_path))}
    servers = contextlib.nullcontext(({}, None))
    if name == "appworld":  # against test_appworld.py's stand-in servers (the real one: test_appworld.py)
        from test_appworld import fake_servers

        servers = fake_servers(tmp_path)
    with servers as (server_kwargs, _):
        check_made_env(name, cls, {**kwargs, **server_kwargs})


def check_made_env(name, cls, kwargs):
    import gymnasium
    from gymnasium.utils.env_checker import check_env

    env = gymnasium.make(f"gigpo/{cls}-v0", **kwargs).unwrapped
    assert isinstance(env, gymnasium.Env)
    check_env(env, skip_render_check=True)
    other = make_env(name, **kwargs)
    assert env.reset(7)[0] == env.reset(seed=7)[0] == other.reset(7)[0]
    env.close(), other.close()


def test_sft_check_runs_and_fits(tiny_model, tmp_path, capsys):
    """bench.sft (the supervised ceiling check) end to end on the tiny model: the table has a row per
    eval, and 60 steps teach it to answer with a move and lower the loss."""
    from bench import sft

    model, tok = tiny_model
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    sft.main(
        ["--model", str(tmp_path), "--lr", "1e-2", "--steps", "60", "--eval_every", "20", "--batch", "16"]
    )
    rows = [
        line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("| 0.01 |")
    ]
    assert [int(r[1]) for r in rows] == [0, 20, 40, 60]
    assert float(rows[-1][5]) == 0.0 and float(rows[-1][2]) < float(
        rows[1][2]
    )  # no invalid first token; loss falls
    assert all(0 <= float(r[k]) <= 1 for r in rows for k in (3, 4, 5))


def test_an_env_script_takes_its_keys_and_names_them_in_one_line_otherwise():
    """python -m envs.keydoor / envs.sokoban size=6 ...: the env's constructor kwargs, typed."""
    from envs import script_args

    assert script_args("keydoor", ["size=6", "walls=4"]) == {"size": 6, "walls": 4}
    with pytest.raises(SystemExit) as e:
        script_args("sokoban", ["colour=red"])
    assert str(e.value).startswith(
        "error: python -m envs.sokoban colour=red: 'colour=red'"
    ) and "rows" in str(e.value)
    assert "--env_args" not in str(e.value)  # train.py's flag, not this script's
