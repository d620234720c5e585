"""ALFWorld on the real games. The games come from $ALFWORLD_DATA, or else are unpacked (2 per task
type and split, 36 games, a few seconds) from the archive at $ALFWORLD_ARCHIVE or
../shared/data/alfworld/json_2.1.1.tgz into a cache dir in the temp dir; without either, the tests
that need games skip. The worker-restart test runs on the treasure game too, so CI always has it."""

import io
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
USER_DATA = os.environ.get("ALFWORLD_DATA")  # read first: importing alfworld sets it to its default

from envs import GroupedEnvs  # noqa: E402
from prompts import prompt_module  # noqa: E402


def games_dir():
    """$ALFWORLD_DATA, or the test subset unpacked from the archive (once, cached in the temp dir);
    skips the calling test where neither is there. tests/test_envs.py's check_env test calls it too."""
    pytest.importorskip("alfworld", reason="alfworld is not installed (pip install -r requirements.txt)")
    from envs.alfworld import unpack

    if USER_DATA:
        return USER_DATA
    archive = next(
        (
            p
            for p in (
                os.environ.get("ALFWORLD_ARCHIVE"),
                os.path.join(ROOT, "..", "shared", "data", "alfworld", "json_2.1.1.tgz"),
            )
            if p and os.path.isfile(p)
        ),
        None,
    )
    if archive is None:
        pytest.skip(
            "no ALFWorld games: set $ALFWORLD_DATA (an alfworld-download dir) or $ALFWORLD_ARCHIVE "
            "(json_2.1.1.tgz), or put the archive at ../shared/data/alfworld/json_2.1.1.tgz"
        )
    stat = os.stat(archive)
    cache = os.path.join(tempfile.gettempdir(), f"gigpo-alfworld-tests-{stat.st_size}-{int(stat.st_mtime)}")
    if not os.path.isdir(cache):
        tmp = f"{cache}.{os.getpid()}"
        unpack(archive, tmp, per_type=2)
        os.replace(tmp, cache)  # atomic: a half-unpacked dir is never used
    return cache


@pytest.fixture(scope="module")
def data_dir():
    return games_dir()


@pytest.mark.parametrize("kind", ["pick", "look", "clean", "heat", "cool", "pick2"])
def test_every_task_type_resets_and_steps(data_dir, kind):
    from envs.alfworld import ALFWorld, task_type

    env = ALFWorld("valid_unseen", data_dir=data_dir)
    seed = next(s for s, g in enumerate(env.games) if task_type(g) == kind)
    obs, info = env.reset(seed)
    assert "Your task is to: " in obs and not obs.startswith("-=")
    assert info["task"] and info["task"] in obs and info["task_type"] == kind
    assert info["anchor"] == obs and info["won"] is False and info["gamefile"] == env.games[seed]
    assert any(a.startswith("go to ") for a in info["admissible_actions"])
    obs2, reward, term, trunc, info2 = env.step(info["admissible_actions"][0])
    assert obs2 and reward == 0.0 and not term and not trunc and info2["task"] == info["task"]


def test_inert_anchor_keeps_the_state_after_nothing_happens(data_dir):
    """The reference's anchor is the raw observation, "Nothing happens." included; with inert_anchor=1
    a step that changed nothing keeps the anchor of the state it was taken in, and any other step
    takes its observation as before."""
    from envs.alfworld import INERT, ALFWorld

    plain, kept = (ALFWorld("valid_seen", data_dir=data_dir, inert_anchor=k) for k in (0, 1))
    first = plain.reset(0)[1]
    assert kept.reset(0)[1]["anchor"] == first["anchor"]
    go = first["admissible_actions"][0]
    inert_seen = 0
    for action in [go, "", "fly to the moon", go]:
        before = kept.anchor
        (obs, *_, info), (obs_k, *_, info_k) = plain.step(action), kept.step(action)
        assert obs == obs_k and info["anchor"] == obs
        assert info_k["anchor"] == (before if obs == INERT else obs)
        inert_seen += obs == INERT
    assert inert_seen >= 2 and info_k["anchor"] != INERT
    with pytest.raises(ValueError, match="inert_anchor"):
        ALFWorld("valid_seen", data_dir=data_dir, inert_anchor=2)


def test_walkthrough_wins_with_reward_10_and_reset_is_repeatable(data_dir):
    from envs.alfworld import ALFWorld

    env = ALFWorld("valid_seen", data_dir=data_dir)
    first = env.reset(3)
    for action in env.walkthrough():
        obs, reward, term, trunc, info = env.step(action)
    assert (reward, term, trunc, info["won"]) == (10.0, True, False, True)
    assert env.reset(3 + len(env.games)) == first  # same game (seed mod games), same start


def test_speedups_play_the_same_game(data_dir):
    """envs.alfworld replaces TextWorld's slow spots (memoized template and condition parses and PDDL
    translations, shallow context and symbol copies, a cheaper fact order): the same observations,
    admissible lists and rewards as TextWorld's own, step for step, on games of random admissible
    actions (one game twice, so the second loads from the cache), with all of them and each alone."""
    import envs.alfworld as alf

    assert all(getattr(m, a) is ours for m, a, ours in alf.SPEEDUPS.values())  # applied on import

    def play(seed):
        env, rng = alf.ALFWorld("valid_unseen", data_dir=data_dir, max_steps=30), random.Random(seed)
        obs, info = env.reset(seed)
        trace = [(obs, info["admissible_actions"])]
        for _ in range(30):
            obs, reward, term, trunc, info = env.step(rng.choice(sorted(info["admissible_actions"])))
            trace.append((obs, info["admissible_actions"], reward, term, trunc))
        env.env.close()
        return trace

    try:
        fast = [play(s) for s in (0, 5, 0)]
        alf.use_speedups(())
        assert [play(s) for s in (0, 5, 0)] == fast
        for name in alf.SPEEDUPS:
            alf.use_speedups([name])
            assert [play(s) for s in (5,)] == fast[1:2], name
    finally:
        alf.use_speedups()
    assert len(fast[0]) == 31 and len(set(t[0] for t in fast[0])) > 3  # a real walk, not one screen


def test_new_games_reuse_the_downward_library(data_dir):
    """TextWorld maps a new copy of libdownward.so (33 MB, a deleted temp file) for every game it
    starts and never unmaps it, so its disk space is held until the process ends; with the library
    reuse a process holds one copy per live game, however many games its envs have played."""
    import envs.alfworld as alf

    def mapped_copies():
        with open("/proc/self/maps") as maps:
            return len({line.split()[-2] for line in maps if "libdownward.so (deleted)" in line})

    env, before = alf.ALFWorld("valid_unseen", data_dir=data_dir, max_steps=3), mapped_copies()
    for seed in range(6):  # six games in a row: one copy at most is new
        obs, info = env.reset(seed)
        env.step(info["admissible_actions"][0])
    env.close()
    assert mapped_copies() - before <= 1
    alf.use_speedups([n for n in alf.SPEEDUPS if n != "library reuse"])
    try:  # without it, each game maps one more: the measure above sees the leak
        before = mapped_copies()
        for seed in range(3):
            env.reset(seed)
        env.close()
        assert mapped_copies() - before == 3
    finally:
        alf.use_speedups()


def test_unparseable_response_is_invalid_and_env_survives(data_dir):
    from envs.alfworld import ALFWorld

    p = prompt_module("alfworld")
    env = ALFWorld("valid_seen", data_dir=data_dir, max_steps=3)
    obs, info = env.reset(0)
    adm = info["admissible_actions"]
    msgs = p.build(info["task"], "", obs, adm, 0)
    text = msgs[-1]["content"]
    assert info["task"] in text and obs in text and "<think>" in text and "<action>" in text
    assert "'help'" not in text and f"'{adm[0]}'" in text
    good = f"<think>look around first</think> <action>{adm[0].upper()}</action>"
    assert p.parse(good, adm) == (adm[0], True)
    assert p.parse(f"<action>{adm[0]}</action>", adm) == ("", False)  # no <think>: invalid
    # invalid is a no-op, also where the text holds an admissible command (it used to be carried out)
    for junk in ["", None, "<action>go to", adm[0], f"<action>{adm[0]}</action>", "\x00" * 99]:
        action, valid = p.parse(junk, adm)
        assert (action, valid) == ("", False)
        obs, reward, term, trunc, info = env.step(action)
        assert obs == "Nothing happens." and reward == 0.0 and not term
    assert trunc and info["admissible_actions"]  # still alive, truncated at max_steps


def test_groups_start_identical_in_workers(data_dir):
    envs = GroupedEnvs(
        "alfworld", n_groups=2, group_size=3, workers=2, split="valid_unseen", data_dir=data_dir
    )
    try:
        obs, infos = envs.reset([0, 5])
        assert len(set(obs[:3])) == 1 and len(set(obs[3:])) == 1 and obs[0] != obs[3]
        assert {i["gamefile"] for i in infos[:3]} == {infos[0]["gamefile"]}
        res = envs.step({0: infos[0]["admissible_actions"][0], 4: "dance"})
        assert res[4][0] == "Nothing happens." and res[0][0] != res[4][0]
    finally:
        envs.close()


def kill_and_step(envs, capfd, action):
    """Kill worker 0 (envs 0 and 1) mid-episode, step all 4 envs: its 2 episodes end as truncated on
    their last observation and info, the others step on; the new worker then plays on."""
    obs, infos = envs.reset([0, 1])
    os.kill(envs.procs[0].pid, signal.SIGKILL)
    envs.procs[0].join()
    res = envs.step({i: action for i in range(4)})
    assert all(res[i][3] and res[i][4]["worker_died"] and res[i][0] == obs[i] for i in (0, 1))
    assert res[0][4]["task"] == infos[0]["task"]
    assert not any(res[i][3] or res[i][4].get("worker_died") for i in (2, 3))
    assert envs.restarts == 1 and "env worker 0 (envs 0..1) died" in capfd.readouterr().err
    obs2, _ = envs.reset([0, 1])
    assert obs2 == obs and not envs.step({0: action})[0][3]


def test_killed_worker_is_replaced_treasure(capfd):
    envs = GroupedEnvs("treasure", n_groups=2, group_size=2, workers=2)
    try:
        kill_and_step(envs, capfd, "up")
        os.kill(envs.procs[1].pid, signal.SIGKILL)  # dead while idle: the next reset retries
        envs.procs[1].join()
        assert len(envs.reset([3, 4])[0]) == 4 and envs.restarts == 2
    finally:
        envs.close()


def screen(text):
    """What a terminal shows for `text`: '\r' goes back to the start of the line, later characters
    overwrite what is there."""
    lines, col = [[]], 0
    for ch in text:
        if ch == "\n":
            lines.append([])
            col = 0
        elif ch == "\r":
            col = 0
        else:
            line = lines[-1]
            line[col : col + 1] = [ch]
            col += 1
    return ["".join(line).rstrip() for line in lines]


def test_dead_worker_line_is_not_written_onto_the_progress_bar(monkeypatch):
    """train.py's bar sits on stderr without a newline; the worker's line used to be appended to it
    ("train:  30%|...| 3/10env worker 0 ... died"). It must get a line of its own."""
    from tqdm import tqdm

    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    envs = GroupedEnvs("treasure", n_groups=2, group_size=2, workers=2)
    bar = tqdm(total=10, desc="train", file=sys.stderr, ncols=80)
    try:
        bar.update(3)
        envs.reset([0, 1])
        os.kill(envs.procs[0].pid, signal.SIGKILL)
        envs.procs[0].join()
        assert envs.step({i: "up" for i in range(4)})[0][4]["worker_died"]
    finally:
        bar.close()
        envs.close()
    shown = screen(err.getvalue())
    assert any(line.startswith("env worker 0 (envs 0..1) died") for line in shown), shown
    assert any(line.startswith("train:") for line in shown)


def test_killed_worker_is_replaced_and_its_episodes_truncated(data_dir, capfd):
    envs = GroupedEnvs("alfworld", n_groups=2, group_size=2, workers=2, split="valid_seen", data_dir=data_dir)
    try:
        kill_and_step(envs, capfd, "look")
    finally:
        envs.close()


def test_train_split_mixes_task_types_eval_splits_stay_sorted(tmp_path):
    """Sorted game paths come grouped by task type, and an iteration's groups get consecutive seeds:
    the train split must be played in a fixed shuffled order (so one iteration's 16 groups span the
    types), the valid splits in sorted order. Only the paths matter: a fake tree, no real games."""
    pytest.importorskip("alfworld", reason="alfworld is not installed (pip install -r requirements.txt)")
    from envs.alfworld import TASK_TYPES, ALFWorld, task_type

    for split in ("train", "valid_seen"):
        for folder in TASK_TYPES:
            for k in range(30):
                game = tmp_path / "json_2.1.1" / split / f"{folder}-Apple-None-Fridge-{k}" / "trial_0"
                game.mkdir(parents=True)
                (game / "game.tw-pddl").write_text("{}")
    train = ALFWorld("train", data_dir=str(tmp_path)).games
    assert train == ALFWorld("train", data_dir=str(tmp_path)).games and train != sorted(train)  # fixed
    for it in range(10):  # the paper's 16 groups an iteration, seeds it * 16 + g
        assert len({task_type(train[(it * 16 + g) % len(train)]) for g in range(16)}) >= 4
    valid = ALFWorld("valid_seen", data_dir=str(tmp_path)).games
    assert valid == sorted(valid) and task_type(valid[0]) == task_type(valid[29])


def test_game_filter_reads_the_game_folder_not_the_data_dir(tmp_path):
    """Games whose folder says movable or Sliced are left out (as ALFWorld's loader does); a data dir
    with such a word in its own path keeps its games."""
    pytest.importorskip("alfworld", reason="alfworld is not installed (pip install -r requirements.txt)")
    from envs.alfworld import game_files

    root = tmp_path / "Sliced-movable-copy"
    for folder in (
        "pick_and_place_simple-Apple-None-Fridge-1",
        "pick_and_place_simple-AppleSliced-None-Fridge-2",
        "pick_and_place_movable-Apple-None-Fridge-3",
    ):
        game = root / "json_2.1.1" / "valid_seen" / folder / "trial_0"
        game.mkdir(parents=True)
        (game / "game.tw-pddl").write_text("{}")
    assert [
        os.path.basename(os.path.dirname(os.path.dirname(g))) for g in game_files("valid_seen", str(root))
    ] == ["pick_and_place_simple-Apple-None-Fridge-1"]


def test_eval_sets_cover_the_splits_in_order(data_dir):
    from envs.alfworld import ALFWorld, eval_sets, task_type

    sets = eval_sets(data_dir=data_dir)
    assert set(sets) == {"valid_seen", "valid_unseen"}
    for split, (kwargs, seeds) in sets.items():
        assert kwargs == {"split": split} and seeds == list(range(len(ALFWorld(split, data_dir).games)))
    assert all(len(s) == 2 for _, s in eval_sets(2, data_dir).values())
    if not USER_DATA:  # the unpacked subset: 2 games per task type
        assert len(ALFWorld("train", data_dir).games) == 12
        for split, (_, seeds) in eval_sets(6, data_dir).items():  # a cap spreads over the sorted split
            games = ALFWorld(split, data_dir).games
            assert len({task_type(games[k]) for k in seeds}) == 6, (split, seeds)


def test_eval_sets_need_only_their_own_games(data_dir, tmp_path, monkeypatch):
    """--eval_sets valid_unseen works where only that split is unpacked; a missing split or an
    unknown set name is an error that names the fix."""
    import train
    from evaluate import eval_plan

    (tmp_path / "json_2.1.1").mkdir()
    os.symlink(os.path.join(data_dir, "json_2.1.1", "valid_unseen"), tmp_path / "json_2.1.1" / "valid_unseen")
    monkeypatch.setenv("ALFWORLD_DATA", str(tmp_path))
    cfg = train.Config(env="alfworld", eval_sets="valid_unseen")
    assert list(eval_plan(cfg)) == ["valid_unseen"]
    train.check_config(cfg)  # passes: nothing else looks for valid_seen
    with pytest.raises(FileNotFoundError, match="valid_seen"):
        eval_plan(train.Config(env="alfworld"))
    with pytest.raises(ValueError, match="--eval_sets"):
        eval_plan(train.Config(env="alfworld", eval_sets="valid_bogus"))


def test_train_one_iteration_then_eval_only(data_dir, tmp_path):
    """The tiny model through the whole loop on real games: `--env alfworld` applies the env's
    defaults (window memory, 512 tokens, ...), which the flags here cut down to CPU test size.
    The tiny tokenizer is trained from envs.alfworld.TINY_CORPUS_EPISODES = 3 random episodes
    (unseen words become <unk>)."""
    out = tmp_path / "run"
    env = {**os.environ, "ALFWORLD_DATA": data_dir, "PYTHONPATH": ROOT}
    args = [
        *(
            "--env alfworld --model tiny --n_groups 2 --group_size 2 --iterations 1 --eval_every 1 "
            "--eval_episodes 1 --max_response_tokens 4 --mini_batch 16 --env_workers 2 --out_dir"
        ).split(),
        str(out),
    ]
    t0 = time.time()
    r = subprocess.run(
        [sys.executable, "train.py", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stderr[-3000:]
    config = json.loads(r.stdout.split("config: ", 1)[1].splitlines()[0])
    assert (config["memory"], config["memory_k"], config["lr"], config["n_groups"]) == ("window", 2, 1e-6, 2)
    assert "eval valid_seen: success" in r.stdout and "eval valid_unseen: success" in r.stdout
    last = r.stdout.strip().splitlines()[-1]  # each split apart, never their mean
    assert re.fullmatch(
        r"held-out success valid_seen 0\.000, valid_unseen 0\.000 \(valid_seen 1 \+ "
        r"valid_unseen 1 games, T=0\.4; random policy valid_seen \d\.\d{3}, "
        r"valid_unseen \d\.\d{3}\) at iteration 1",
        last,
    ), last
    row = json.loads(open(out / "metrics.jsonl").read().splitlines()[-1])
    assert row["samples"] == 4 * 50 and row["valid_ratio"] == 0.0 and row["episode_length"] == 50
    split_keys = {k for k in row if k.startswith("eval_success/")}  # per split and per task type
    assert {"eval_success/valid_seen", "eval_success/valid_unseen"} <= split_keys
    assert {k.count("/") for k in split_keys} == {1, 2} and "eval_sets" not in row
    assert row["eval_success"] == row["eval_success/valid_seen"]  # the headline: the first set
    saved = json.load(open(out / "eval.json"))  # each game's result and task type, per split
    assert saved["games"] == {"valid_seen": [0], "valid_unseen": [0]}
    from envs.alfworld import TASK_TYPES

    assert set(saved["types"]) == {"valid_seen", "valid_unseen"}
    assert all(len(t) == 1 and t[0] in TASK_TYPES.values() for t in saved["types"].values()), saved["types"]
    print(f"train + eval: {time.time() - t0:.0f}s")
    r = subprocess.run(
        [
            sys.executable,
            *"train.py --env alfworld --eval_only 1 --model".split(),
            str(out / "model"),
            *(
                "--eval_sets valid_unseen --eval_episodes 1 --max_response_tokens 4 --env_workers 0 "
                "--n_groups 1 --group_size 2 --out_dir"
            ).split(),
            str(tmp_path / "eval"),
        ],  # not the repository's out/, which may hold a run
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()
    assert lines[-2].startswith("eval-only success valid_unseen 0.000 (valid_unseen 1 games, T=0.4")
    assert lines[-1].startswith("per task type: valid_unseen/")  # the eval-only's last line (16b221f)
    assert "over 1 games, invalid actions 1.000 of steps" in r.stdout  # 4 tokens: never both tags


def play(env, seed, deviate=0):
    """Reset, make `deviate` off-plan moves (to some other place), then follow info["expert_action"]
    -> (won, steps, the actions taken)."""
    obs, info = env.reset(seed)
    done = trunc = False
    actions = []
    while not (done or trunc):
        action = info["expert_action"]
        if len(actions) < deviate:
            action = next(a for a in info["admissible_actions"] if a.startswith("go to ") and a != action)
        obs, reward, done, trunc, info = env.step(action)
        actions.append(action)
    assert not done or info["expert_action"] == ""
    return done, len(actions), actions


def test_expert_action_wins_every_game_also_after_leaving_its_plan(data_dir):
    """Following info["expert_action"] wins one game per task type of each valid split (all 274 by
    hand, docs/envs.md), from the start (the walkthrough) and after an off-plan first move (a
    replan: seconds in a big kitchen, so valid_unseen's only). No expert_action unless asked for."""
    from envs import parse_env_args
    from envs.alfworld import TASK_TYPES, ALFWorld, task_type

    assert parse_env_args("alfworld", "expert=1") == {"expert": 1}
    with pytest.raises(ValueError, match="--env_args expert="):
        ALFWorld("valid_seen", data_dir=data_dir, expert=2)
    assert "expert_action" not in ALFWorld("valid_seen", data_dir=data_dir).reset(0)[1]
    for split in ("valid_seen", "valid_unseen"):
        env = ALFWorld(split, data_dir=data_dir, expert=True)
        for kind in TASK_TYPES.values():
            seed = next(s for s, g in enumerate(env.games) if task_type(g) == kind)
            won, steps, actions = play(env, seed)
            assert won and actions == env.walkthrough(), env.gamefile
            if split == "valid_unseen":
                won, steps, actions = play(env, seed, deviate=1)
                assert won and actions[0] != env.walkthrough()[0] and steps <= len(env.walkthrough()) + 2, (
                    env.gamefile
                )


def test_bc_collects_expert_steps_and_cloning_lowers_the_loss(data_dir, tiny_model, tmp_path):
    """bench.bc: the expert's steps on 2 train games, in both prompt formats, are prompts the RL run
    would build (memory of the last 2 steps) with replies its parser reads back as the expert action;
    30 steps of cloning on the tiny model lower the reply loss and save a folder train.py loads."""
    from transformers import AutoModelForCausalLM

    from bench import bc
    from tiny import is_tiny

    n = bc.main(
        [
            "--collect",
            str(tmp_path / "bc-{prompt}.jsonl"),
            *"--games 2 --prompt tagged choice --data_dir".split(),
            data_dir,
        ]
    )
    rows = {v: [json.loads(line) for line in open(tmp_path / f"bc-{v}.jsonl")] for v in ("tagged", "choice")}
    assert len(rows["tagged"]) == len(rows["choice"]) == n >= 4
    for v, variant in (("tagged", ""), ("choice", "choice")):
        p = prompt_module("alfworld", chat=True, variant=variant)
        for prev, r in zip([None] + rows[v], rows[v]):
            assert p.parse(r["reply"], r["admissible"]) == (r["action"], True)
            text = r["messages"][-1]["content"]
            if r["step"] > 0:  # the window memory shows the previous step's action
                assert f"-> {prev['action']}]" in text and f"{r['step']} step(s)" in text
    for r in rows["choice"]:
        assert f"\n{r['reply']}. {r['action']}\n" in r["messages"][-1]["content"]
    assert rows["tagged"][0]["reply"] == (
        f"<think>The next step towards the task is {rows['tagged'][0]['action']}."
        f"</think><action>{rows['tagged'][0]['action']}</action>"
    )
    model, tok = tiny_model
    model.save_pretrained(tmp_path / "tiny")
    tok.save_pretrained(tmp_path / "tiny")
    out = tmp_path / "bc"
    losses, _ = bc.main(
        [
            "--train",
            str(tmp_path / "bc-choice.jsonl"),
            "--model",
            str(tmp_path / "tiny"),
            "--out",
            str(out),
            *"--steps 30 --batch 4 --lr 1e-2 --device cpu".split(),
        ]
    )
    assert len(losses) == 30 and sum(losses[-5:]) / 5 < 0.5 * losses[0]
    assert AutoModelForCausalLM.from_pretrained(out).num_parameters() == model.num_parameters() and is_tiny(
        str(out)
    )
    with pytest.raises(SystemExit, match="--games"):
        bc.main(["--collect", str(tmp_path / "x.jsonl"), "--games", "0", "--data_dir", data_dir])
    with pytest.raises(SystemExit, match="--prompt"):
        bc.main(
            ["--collect", str(tmp_path / "x.jsonl"), "--prompt", "tagged", "choice", "--data_dir", data_dir]
        )


def test_pair_plays_a_replicate_end_to_end_and_pools_replicates(data_dir, tiny_model, tmp_path, monkeypatch):
    """bench.pair with the tiny model on CPU: the expert's steps of 2 games over 2 processes, a 4-step
    clone, GiGPO and GRPO side by side for one iteration with the clone's eval beside them, the paired
    tables; an arm's folder left by a run cut short is kept aside, but not while a process still runs
    in it; a second run finds every stage done, and does again a clone saved in part and an eval cut
    short; --report pools two replicates, game by game and across replicates."""
    from bench import pair

    model, tok = tiny_model
    model.save_pretrained(tmp_path / "tiny")
    tok.save_pretrained(tmp_path / "tiny")
    monkeypatch.setenv("ALFWORLD_DATA", data_dir)
    small = [
        "--bc_flags=--steps 4 --batch 2 --device cpu",
        *"--games 2 --procs 2 --engine hf --env_workers 0 --max_response_tokens 4 --eval_episodes 2".split(),
        *"--iterations 1 --n_groups 1 --group_size 2 --env_args max_steps=2 --threads 1".split(),
    ]
    cut = tmp_path / "r2" / "gigpo"  # an arm that died before its checkpoint: kept aside, run again
    cut.mkdir(parents=True)
    (cut / "metrics.jsonl").write_text('{"iteration": 1}\n')
    calls, real_run = [], pair.run
    monkeypatch.setattr(
        pair, "run", lambda cmd, *a, **k: calls.append((cmd, k.get("wait", True))) or real_run(cmd, *a, **k)
    )
    pair.main(["--collect_only", "--out", str(tmp_path / "r1"), *small])  # stage 1 alone, no model
    assert (tmp_path / "r1" / "bc.jsonl").exists() and not (tmp_path / "r1" / "clone").exists()
    pair.main(["--model", str(tmp_path / "tiny"), "--out", str(tmp_path / "r1"), *small])
    assert sum("--collect" in c for c, _ in calls) == 2  # its 2 processes: the second call collected none
    order = [
        ("clone_eval" if "--eval_only" in c else c[c.index("--algo") + 1], w)
        for c, w in calls
        if "train.py" in c
    ]
    beside = [("gigpo", False), ("grpo", False), ("clone_eval", False)]  # the clone's eval after the arms,
    assert order[:3] == beside  # none of them waited for
    # r2's arms stop at a time limit (as a replicate's do): saved, not evaluated; pair evaluates them
    r2 = ["--model", str(tmp_path / "tiny"), "--out", str(tmp_path / "r2"), *small, "--iterations", "3"]
    r2 += ["--time_limit", "1e-9"]
    hold = "import fcntl, sys, time; f = open(sys.argv[1], 'a'); fcntl.flock(f, fcntl.LOCK_EX); print(1)"
    hold += "; sys.stdout.flush(); time.sleep(600)"
    running = subprocess.Popen([sys.executable, "-c", hold, str(cut / ".lock")], stdout=subprocess.PIPE)
    running.stdout.readline()  # an earlier bench.pair's arm still running there: not renamed under it
    with pytest.raises(SystemExit, match="in use"):
        pair.main(r2)
    running.kill()
    running.wait()
    assert not (tmp_path / "r2" / "gigpo.cut1").exists()
    pair.main(r2)
    assert (tmp_path / "r2" / "gigpo.cut1" / "metrics.jsonl").exists()
    for arm in ("gigpo", "grpo"):
        assert not (tmp_path / "r2" / arm / "eval.json").exists()
        assert len(json.load(open(tmp_path / "r2" / f"{arm}_eval" / "eval.json"))["games"]["valid_seen"]) == 2
    assert (tmp_path / "r2" / "pair.md").read_text().count("| valid_unseen |") == 3
    out = tmp_path / "r1"
    rows = [json.loads(line) for line in open(out / "bc.jsonl")]
    assert len({r["game"] for r in rows}) == 2 and not list(out.glob("bc.jsonl.*"))
    md = (out / "pair.md").read_text()
    assert md.count("| valid_seen |") == 3 and md.count("| valid_unseen |") == 3  # 3 pairs x 2 splits
    assert "| training success (T = 1) | iterations 1-1 |" in md  # and the arms' trajectory
    for arm in ("gigpo", "grpo"):
        ev = json.load(open(out / arm / "eval.json"))
        assert ev["iteration"] == 1 and len(ev["games"]["valid_seen"]) == 2
    stamp = (out / "gigpo" / "eval.json").stat().st_mtime
    with pytest.raises(SystemExit, match="made with --games 2 .this call: 3."):  # not reused unsaid
        pair.main(["--model", str(tmp_path / "tiny"), "--out", str(out), *small, "--games", "3"])
    ev = json.load(open(out / "clone_eval" / "eval.json"))
    (out / "clone_eval" / "eval.json").write_text(json.dumps({**ev, "complete": False}))  # cut short
    (out / "clone" / "tokenizer_config.json").unlink()  # a clone killed mid-save: written last
    pair.main(["--model", str(tmp_path / "tiny"), "--out", str(out), *small])  # every other stage is done
    assert (out / "gigpo" / "eval.json").stat().st_mtime == stamp
    assert json.load(open(out / "clone_eval" / "eval.json"))["complete"] is True
    assert (out / "clone" / "tokenizer_config.json").exists()
    text = pair.main(["--report", str(out), str(tmp_path / "r2")])
    assert text.count("| valid_seen |") == 3 and "| valid_seen | 4 |" in text  # 2 rows + 4 games pooled
    assert text.count(" of 2 replicates") == 2  # the sign test across replicates, per split


def test_pair_stops_its_running_stages_when_it_is_stopped(tmp_path):
    """A SIGTERM (a scheduler's kill) or Ctrl-C to bench.pair stops the stages it started (an arm
    left running would hold the GPU and its folder) and ends in one line."""
    script = (
        "import signal, sys, time; import bench.pair as P\n"
        "def rep(args, extra):\n"
        "    p = P.run(['-c', 'import time; time.sleep(600)'], sys.argv[1], wait=False)\n"
        "    print(p.pid, flush=True); time.sleep(600)\n"
        "P.replicate = rep; signal.signal(signal.SIGTERM, P._interrupt)\n"
        "P.main(['--model', '.', '--out', sys.argv[2]])\n"
    )
    cmd = [sys.executable, "-c", script, str(tmp_path / "stage.log"), str(tmp_path / "out")]
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stage = int(p.stdout.readline())
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 1 and err.strip().splitlines()[-1].startswith("interrupted: bench.pair stopped 1 ")
    with pytest.raises(ProcessLookupError):  # the stage ended and was waited for
        os.kill(stage, 0)


def test_pair_report_pools_games_and_replicates(tmp_path):
    """bench.pair --report on two made-up replicates of 4 games: gains per replicate, the sign test on
    every replicate's games in one list (also by task type), and across replicates."""
    from bench import pair, pair_report

    wins = {  # replicate -> run -> valid_seen games won
        "r1": {"clone_eval": [0, 0, 0, 0], "gigpo": [1, 1, 0, 0], "grpo": [0, 0, 0, 1]},
        "r2": {"clone_eval": [0, 1, 0, 0], "gigpo": [1, 1, 1, 0], "grpo": [0, 1, 0, 0]},
    }
    for rep, runs in wins.items():
        for run, games in runs.items():
            (tmp_path / rep / run).mkdir(parents=True)
            ev = {"games": {"valid_seen": games}, "rates": {"valid_seen": sum(games) / 4}, "iteration": 7}
            ev["types"] = {"valid_seen": ["pick", "pick", "cool", "cool"]}
            json.dump(ev, open(tmp_path / rep / run / "eval.json", "w"))
    for run, success in ("gigpo", [0.1, 0.2, 0.3, 0.5]), ("grpo", [0.1, 0.1, 0.1]):  # r1's training logs
        lines = [
            json.dumps(
                {"iteration": i + 1, "success": x, "time_iteration": 60.0 / (i + 1), "time_update": 9.0 + i}
                | ({"gpu_mem_gib": 40.0 + i, "gpu_alloc_gib": 20.0 + i} if run == "gigpo" else {})
            )
            + "\n"
            for i, x in enumerate(success)
        ]
        (tmp_path / "r1" / run / "metrics.jsonl").write_text("".join(lines))
    assert pair_report.trajectory(str(tmp_path / "r1"), pair.ARMS, block=2).splitlines()[2:] == [
        "| gigpo | 0.150 | 0.400 |",  # iterations 1-2, 3-4
        "| grpo | 0.100 | - |",  # a block it has not finished
        "",  # then the cost: medians after the first iteration (compile's), peaks over all; CPU: no memory
        "| arm | iteration s | update s | gpu_mem_gib | gpu_alloc_gib |",
        "|---|---|---|---|---|",
        "| gigpo | 20.0 | 11.0 | 43.0 | 23.0 |",
        "| grpo | 25.0 | 10.5 | - | - |",
    ]
    text = pair.main(["--report", str(tmp_path / "r1"), str(tmp_path / "r2")])
    assert f"{tmp_path / 'r1'}:\n| training success (T = 1) | iterations 1-4 |" in text  # r2 has no logs
    assert "| valid_seen | 7/7 | 0.000 | 0.500 | 0.250 | +0.500 | +0.250 |" in text
    assert "| valid_seen | 7/7 | 0.250 | 0.750 | 0.250 | +0.500 | +0.000 |" in text
    # pooled: gigpo alone won 4 games against the clone (p = 2/16); against gigpo, grpo alone won 1 of 5
    assert "| valid_seen | 8 | 4 / 0, p 0.125 | 1 / 0, p 1.000 | 1 / 4, p 0.375 |" in text
    assert "| valid_seen/pick | 4 | 3 / 0, p 0.250 |" in text
    assert "gigpo's gain above grpo's in 2 of 2 replicates, below in 0, sign test p 0.500" in text
    assert "(its smallest possible p here: 0.500)" in text  # 2 replicates cannot reach 0.05
    (tmp_path / "r2" / "grpo" / "eval.json").unlink()  # a replicate not yet ended: one line, which says so
    with pytest.raises(SystemExit) as e:
        pair.main(["--report", str(tmp_path / "r1"), str(tmp_path / "r2")])
    assert "r2 has no whole final eval of grpo" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(SystemExit, match="r3: no such folder"):
        pair.main(["--report", str(tmp_path / "r1"), str(tmp_path / "r3")])


def test_bc_lora_clone_is_rebuilt_from_its_adapter(tiny_model, tmp_path):
    """bench.bc --lora_rank: the clone trains LoRA adapters, keeps them in OUT/adapter (no base
    weights) and writes the base with them merged; --merge rebuilds exactly that clone from the
    adapter and the base (how a clone moves to another machine in a few MB)."""
    from transformers import AutoModelForCausalLM

    from bench import bc

    model, tok = tiny_model
    model.save_pretrained(tmp_path / "tiny")
    tok.save_pretrained(tmp_path / "tiny")
    with open(tmp_path / "bc.jsonl", "w") as f:
        for k in range(40):
            row = {"messages": [{"role": "user", "content": "up or down"}], "reply": "up", "game": k % 5}
            f.write(json.dumps(row) + "\n")
    base = str(tmp_path / "tiny")
    flags = "--steps 5 --batch 4 --lr 1e-2 --device cpu --lora_rank 2".split()
    bc.main(
        ["--train", str(tmp_path / "bc.jsonl"), "--model", base, "--out", str(tmp_path / "clone"), *flags]
    )
    adapter = tmp_path / "clone" / "adapter"
    assert (adapter / "adapter_config.json").exists()
    assert sum(f.stat().st_size for f in adapter.iterdir()) < 0.5 * sum(
        p.numel() * 4 for p in model.parameters()
    )
    bc.main(["--merge", str(adapter), "--model", base, "--out", str(tmp_path / "again")])
    clone, again, plain = (
        AutoModelForCausalLM.from_pretrained(tmp_path / d).state_dict() for d in ("clone", "again", "tiny")
    )
    assert set(clone) == set(plain) and all(torch.equal(clone[k], again[k]) for k in clone)
    assert any(not torch.equal(clone[k], plain[k]) for k in clone if "proj" in k)  # the adapters moved


def fake_checkpoint(run_dir, iteration):
    """A checkpoint folder as a save swaps it in: a new ckpt/ with its meta.json."""
    ckpt = run_dir / "ckpt"
    if ckpt.exists():
        ckpt.rename(run_dir / "ckpt.gone")
    tmp = run_dir / "ckpt.tmp"
    tmp.mkdir(parents=True)
    (tmp / "meta.json").write_text(json.dumps({"iteration": iteration}))
    tmp.rename(ckpt)
    shutil.rmtree(run_dir / "ckpt.gone", ignore_errors=True)


def test_a_long_pairs_carry_follows_each_checkpoint_and_never_packs_two_saves(tmp_path, monkeypatch):
    """While a long pair's arms run (they save every SAVE_EVERY iterations), carry.tgz is written again
    each time a checkpoint moves on, so a lost host costs only the iterations since; a save swapped in
    while the carry was being packed leaves the last carry as it was (no mix of two checkpoints)."""
    from bench import pair

    out = tmp_path / "pair"
    for arm in pair.ARMS:
        fake_checkpoint(out / arm, 3)
    assert pair.carry(str(out), pair.ARMS, with_ckpt=True)
    packed, real_add = (out / "carry.tgz").read_bytes(), tarfile.TarFile.add

    def add_during_a_save(tar, name, *a, **k):
        if name.endswith(os.path.join("gigpo", "ckpt")):
            fake_checkpoint(out / "gigpo", 6)
        return real_add(tar, name, *a, **k)

    monkeypatch.setattr(tarfile.TarFile, "add", add_during_a_save)
    assert pair.carry(str(out), pair.ARMS, with_ckpt=True) is None
    assert (out / "carry.tgz").read_bytes() == packed
    monkeypatch.undo()

    class Arm:  # a process that is running for its first polls
        def __init__(self, polls, saves=None, clone_eval_at=None):
            self.polls, self.saves, self.clone_eval_at, self.returncode = polls, saves, clone_eval_at, None

        def poll(self):
            self.polls -= 1
            if self.polls == 2 and self.saves:  # it saves a checkpoint between two looks
                fake_checkpoint(out / self.saves, 9)
            if self.polls == self.clone_eval_at:  # the clone's eval, beside the arms, ends
                (out / "clone_eval").mkdir()
                (out / "clone_eval" / "eval.json").write_text(json.dumps({"complete": True}))
            self.returncode = 0 if self.polls < 0 else None
            return self.returncode

        def wait(self, timeout):
            if self.poll() is None:
                raise subprocess.TimeoutExpired("train.py", timeout)

    carried, real_carry = [], pair.carry
    monkeypatch.setattr(pair, "POLL", 0)
    monkeypatch.setattr(pair, "carry", lambda *a, **k: carried.append(1) or real_carry(*a, **k))
    assert (
        pair.wait_for_arms(str(out), {"gigpo": Arm(5), "grpo": Arm(5, "grpo")}, pair.ARMS, refresh=True) == []
    )
    assert carried == [1]  # once: at the save, not at every look
    with tarfile.open(out / "carry.tgz") as tar:
        assert json.load(tar.extractfile("grpo/ckpt/meta.json"))["iteration"] == 9
    carried.clear()
    arms = {"gigpo": Arm(6, clone_eval_at=4), "grpo": Arm(6)}
    assert pair.wait_for_arms(str(out), arms, pair.ARMS, refresh=True) == []
    assert carried == [1]  # the clone's eval became whole: carried at once, not at the next save
    with tarfile.open(out / "carry.tgz") as tar:
        assert "clone_eval/eval.json" in tar.getnames()


def test_an_arm_dead_of_cuda_out_of_memory_starts_again(tmp_path, monkeypatch, capsys):
    """Two arms and the clone's eval share one GPU, and their peaks can meet its memory: an arm that
    dies of CUDA out of memory starts again from its checkpoint (up to OOM_TRIES times) while the other
    runs on; any other failure, or one out of memory more than that, stops bench.pair in one line."""
    import argparse

    from bench import pair

    oom = "import sys; print('torch.OutOfMemoryError: CUDA out of memory. Tried to allocate'); sys.exit(1)"
    ok, other = "pass", "import sys; print('ValueError: not memory'); sys.exit(1)"
    monkeypatch.setattr(pair, "POLL", 0.05)

    def replicate(name, scripts):
        out = tmp_path / name
        (out / "clone").mkdir(parents=True)
        (out / "bc.jsonl").write_text("{}\n")
        (out / "clone" / "tokenizer_config.json").write_text("{}")
        (out / "clone_eval").mkdir()
        (out / "clone_eval" / "eval.json").write_text(json.dumps({"complete": True}))
        started = []

        def start_arms(args, extra, clone, lora, minutes, arms, at):
            for arm in arms:
                started.append((arm, at[arm]))
                if arm == "gigpo" and len(started) == 1:
                    fake_checkpoint(out / arm, 2)  # its first run saved iteration 2, then died
            return {
                arm: pair.run(["-c", scripts[arm].pop(0)], str(out / f"{arm}.log"), wait=False)
                for arm in arms
            }

        monkeypatch.setattr(pair, "start_arms", start_arms)
        flags = dict(
            games=300, epochs=1, bc_flags="", lora_rank=4, seed=0, minutes=0, start_up=0, caches=None
        )
        where = dict(out=str(out), arms=list(pair.ARMS), model="m", procs=1, collect_only=False)
        pair.replicate(argparse.Namespace(**where, **flags), [])
        return started

    assert replicate("oom", {"gigpo": [oom, ok], "grpo": [ok]}) == [("gigpo", 0), ("grpo", 0), ("gigpo", 2)]
    assert (
        "gigpo: out of GPU memory beside the other runs; again from iteration 2 (1)"
        in capsys.readouterr().out
    )
    with pytest.raises(SystemExit, match="grpo failed") as e:
        replicate("other", {"gigpo": [ok], "grpo": [other, ok]})
    assert "grpo: ValueError: not memory (log: " in str(e.value) and "\n" not in str(e.value)  # its last line
    monkeypatch.setattr(pair, "OOM_TRIES", 1)
    with pytest.raises(SystemExit, match="gigpo failed"):
        replicate("twice", {"gigpo": [oom, oom, ok], "grpo": [ok]})


def test_pair_puts_each_arm_on_its_own_gpu_where_there_are_several(tmp_path, monkeypatch):
    """On a host of several GPUs the arms (and their evals) each get one, so neither waits on the
    other; on one GPU they share it, the environment untouched."""
    import argparse

    from bench import pair

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(pair.torch.cuda, "device_count", lambda: 2)
    assert [pair.arm_device(list(pair.ARMS), a) for a in pair.ARMS] == [
        {"CUDA_VISIBLE_DEVICES": "0"},
        {"CUDA_VISIBLE_DEVICES": "1"},
    ]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6,7")  # the user's choice of GPUs is kept
    assert pair.arm_device(["gigpo", "grpo"], "grpo") == {"CUDA_VISIBLE_DEVICES": "6"}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    assert pair.arm_device(["gigpo", "grpo"], "grpo") == {}
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")  # device_count still 2
    envs = {}
    monkeypatch.setattr(
        pair, "run", lambda cmd, log, wait=True, env=None: envs.setdefault(cmd[cmd.index("--algo") + 1], env)
    )
    args = argparse.Namespace(out=str(tmp_path), arms=list(pair.ARMS), minutes=0, lora_rank=0, caches=None)
    pair.start_arms(args, [], "clone", [], 0, ["grpo"], {"grpo": 0})  # grpo alone (again): still GPU 1
    assert envs["grpo"]["CUDA_VISIBLE_DEVICES"] == "1" and envs["grpo"]["PATH"] == os.environ["PATH"]
    monkeypatch.setattr(pair.torch.cuda, "device_count", lambda: 1)
    pair.start_arms(args, [], "clone", [], 0, ["gigpo"], {"gigpo": 0})
    assert "CUDA_VISIBLE_DEVICES" not in envs["gigpo"]


def test_pair_keeps_the_seed_its_clone_was_made_with(tmp_path):
    """OUT/stages.json records --seed with the clone's flags. An older OUT's expert data (no seed
    recorded) takes this call's; one whose clone was made before the seed was recorded had seed 0;
    a later call with another seed is one line, before anything runs."""
    import argparse

    from bench import pair

    def call(out, seed):
        flags = dict(games=300, epochs=1, bc_flags="--lr 5e-4", lora_rank=4)
        return pair.same_stages(str(out), argparse.Namespace(**flags, seed=seed))

    for name, clone in (("data_only", False), ("with_clone", True)):
        out = tmp_path / name
        out.mkdir()
        (out / "bc.jsonl").write_text("{}\n")
        (out / "stages.json").write_text(
            json.dumps(dict(games=300, epochs=1, bc_flags="--lr 5e-4", lora_rank=4))
        )
        if clone:
            (out / "clone").mkdir()
    call(tmp_path / "data_only", 2)
    assert json.load(open(tmp_path / "data_only" / "stages.json"))["seed"] == 2
    for name, seed, made in (("data_only", 3, 2), ("with_clone", 1, 0)):
        with pytest.raises(SystemExit) as e:
            call(tmp_path / name, seed)
        assert f"was made with --seed {made} (this call: {seed})" in str(e.value) and "\n" not in str(e.value)
    call(tmp_path / "with_clone", 0)


def test_pair_caches_are_an_earlier_replicates_and_a_bad_one_is_one_line(tmp_path, capsys):
    """--caches SRC (an earlier replicate's OUT or carry.tgz) seeds a new arm's compile caches; a SRC
    without them, a broken archive, or no --lora_rank (whose arms alone read OUT/ARM/compile_cache) is
    one line, before anything runs; so is a --model that is not a folder."""
    from bench import pair

    (tmp_path / "old" / "grpo" / "compile_cache" / "inductor").mkdir(parents=True)
    (tmp_path / "old" / "grpo" / "compile_cache" / "inductor" / "k").write_text("kernel")
    pair.seed_caches(str(tmp_path / "old"), str(tmp_path / "new" / "grpo"), "grpo")
    assert (tmp_path / "new" / "grpo" / "compile_cache" / "inductor" / "k").read_text() == "kernel"
    assert capsys.readouterr().out == f"grpo: 1 compile cache files from {tmp_path / 'old'}\n"
    (tmp_path / "broken.tgz").write_bytes(b"not a tar")
    for src, arm in ((tmp_path / "old", "gigpo"), (tmp_path / "broken.tgz", "grpo")):
        with pytest.raises(SystemExit) as e:
            pair.seed_caches(str(src), str(tmp_path / "new" / arm), arm)
        assert str(e.value).startswith(f"error: bench.pair: --caches {src}") and "\n" not in str(e.value)
    base = ["--model", str(tmp_path), "--out", str(tmp_path / "out")]
    for flags, why in (
        (["--caches", str(tmp_path / "old")], "needs --lora_rank"),
        (["--caches", "x", "--lora_rank", "2"], "not found"),
        (["--model", str(tmp_path / "none")], "--model " + str(tmp_path / "none") + ": no such folder"),
    ):
        with pytest.raises(SystemExit) as e:
            pair.main([*base, *flags])
        assert why in str(e.value)
    assert not (tmp_path / "out").exists()


def test_pair_with_lora_goes_on_on_another_machine_from_its_carry(
    data_dir, tiny_model, tmp_path, monkeypatch
):
    """bench.pair --lora_rank: one iteration per arm, then OUT is lost but for carry.tgz (MBs, with the
    arms' compile caches); unpacked into a fresh OUT, the same command with --iterations 2 merges the
    clone again from its adapter, keeps the clone's eval and resumes both arms from their checkpoints
    to iteration 2."""
    from bench import pair

    model, tok = tiny_model
    model.save_pretrained(tmp_path / "tiny")
    tok.save_pretrained(tmp_path / "tiny")
    monkeypatch.setenv("ALFWORLD_DATA", data_dir)
    out = tmp_path / "pair"
    flags = [
        "--bc_flags=--steps 2 --batch 2 --device cpu",
        *"--lora_rank 2 --games 2 --procs 2 --engine hf --env_workers 0 --max_response_tokens 4".split(),
        *"--eval_episodes 1 --n_groups 1 --group_size 2 --env_args max_steps=2 --threads 1 --seed 3".split(),
    ]
    with tarfile.open(tmp_path / "earlier.tgz", "w:gz") as tar:  # an earlier replicate's carry
        for arm in pair.ARMS:
            (tmp_path / "earlier" / arm / "compile_cache" / "vllm").mkdir(parents=True)
            (tmp_path / "earlier" / arm / "compile_cache" / "vllm" / "g").write_text(f"{arm}'s graph")
            tar.add(tmp_path / "earlier" / arm, arcname=arm)
    flags.append(f"--caches={tmp_path / 'earlier.tgz'}")
    packs, real_carry, cmds, real_run = [], pair.carry, [], pair.run
    monkeypatch.setattr(pair, "run", lambda cmd, *a, **k: cmds.append(cmd) or real_run(cmd, *a, **k))
    monkeypatch.setattr(
        pair, "carry", lambda o, *a, **k: packs.append(sorted(os.listdir(o))) or real_carry(o, *a, **k)
    )
    pair.main(["--model", str(tmp_path / "tiny"), "--out", str(out), *flags, "--iterations", "1"])
    assert (out / "pair.md").exists() and (out / "carry.tgz").stat().st_size < 2**20
    assert "clone" in packs[0] and "gigpo" not in packs[0]  # packed once the clone is made, before the arms
    # the replicate's seed: its clone's, its arms' and the clone eval's, kept with OUT's stage flags
    assert json.load(open(out / "clone" / "bc.json"))["seed"] == 3
    assert json.load(open(out / "stages.json"))["seed"] == 3
    for run in ("gigpo/ckpt", "grpo/ckpt"):
        assert json.load(open(out / run / "meta.json"))["config"]["seed"] == 3
    seeds = [c[len(c) - c[::-1].index("--seed")] for c in cmds if c[0] == "train.py" or "--train" in c]
    assert len(seeds) == 4 and set(seeds) == {"3"}  # the clone, its eval, both arms (argparse: the last wins)
    monkeypatch.setattr(pair, "carry", real_carry)
    monkeypatch.setattr(pair, "run", real_run)
    for arm in pair.ARMS:  # the new arms started with the earlier replicate's caches
        assert (out / arm / "compile_cache" / "vllm" / "g").read_text() == f"{arm}'s graph"
    flags.pop()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/tmp/torchinductor_x")  # torch's own, once it compiles
    env = pair.compile_caches(str(out / "gigpo"))  # the arms' caches (compiled on a GPU), in the carry
    assert env["VLLM_CACHE_ROOT"] == str(out / "gigpo" / "compile_cache" / "vllm")
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(out / "gigpo" / "compile_cache" / "inductor")
    kernel = out / "gigpo" / "compile_cache" / "inductor" / "fxgraph" / "k"
    kernel.parent.mkdir(parents=True)
    kernel.write_text("a compiled graph")
    pair.carry(str(out), pair.ARMS, with_ckpt=True)
    clone_eval = (out / "clone_eval" / "eval.json").read_text()
    out.rename(tmp_path / "lost")  # a fresh machine: only the carry comes along
    out.mkdir()
    with tarfile.open(tmp_path / "lost" / "carry.tgz") as tar:
        tar.extractall(out)
    assert not (out / "clone" / "config.json").exists() and (out / "gigpo" / "ckpt").exists()
    assert (out / "gigpo" / "compile_cache" / "inductor" / "fxgraph" / "k").read_text() == "a compiled graph"
    pair.main(["--model", str(tmp_path / "tiny"), "--out", str(out), *flags, "--iterations", "2"])
    assert "merged onto" in (out / "pair.log").read_text()
    assert (out / "clone_eval" / "eval.json").read_text() == clone_eval  # kept, not played again
    assert not list(out.glob("*.cut*"))  # resumed, not started over
    for arm in ("gigpo", "grpo"):
        assert [json.loads(line)["iteration"] for line in open(out / arm / "metrics.jsonl")] == [1, 2]
        assert {json.loads(line)["iteration"] for line in open(out / arm / "episodes.jsonl")} == {1, 2}
        assert json.load(open(out / arm / "eval.json"))["iteration"] == 2
