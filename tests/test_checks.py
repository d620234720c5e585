"""The command line's one-line errors (checks.py) and `python -m evaluate`'s refusals, in-process:
check_config is what main runs first, so a SystemExit here is a stop before any work."""

import json

import pytest

import checks
import train


def stop_line(args, tmp_path):
    """check_config on these flags -> its one-line error (the test fails if it passes them)."""
    cfg = train.parse_args([*args, "--out_dir", str(tmp_path / "out")])
    with pytest.raises(SystemExit) as e:
        train.check_config(cfg)
    msg = str(e.value.code)
    assert msg.startswith("error: ") and "\n" not in msg, msg
    return msg


@pytest.mark.parametrize(
    "env, env_args",
    [
        ("keydoor", "max_steps=0"),
        ("keydoor", "size=1"),
        ("keydoor", "walls=100"),
        ("keydoor", "max_steps=abc"),
        ("keydoor", "key=2"),
        ("treasure", "max_steps=0"),
        ("treasure", "walls=24"),
        ("sokoban", "max_steps=0"),
        ("sokoban", "search_depth=x"),
    ],
)
def test_bad_env_args_of_every_built_in_game_are_one_line(env, env_args, tmp_path):
    msg = stop_line(["--env", env, "--env_args", env_args], tmp_path)
    assert msg.startswith(f"error: --env_args {env_args!r}: {env}: "), msg


@pytest.mark.parametrize("flag", ["kl_coef", "entropy_coef", "time_limit", "eval_temperature"])
def test_negative_weights_and_time_limit_are_refused(flag, tmp_path):
    assert f"--{flag} -0.5 must be >= 0" in stop_line([f"--{flag}", "-0.5"], tmp_path)


BELOW = [
    ("n_groups", 0, 1),
    ("threads", 0, 1),
    ("lora_rank", -1, 0),
    ("log_groups", -1, 0),
    ("mini_batch", 0, 1),
]


@pytest.mark.parametrize("flag, value, low", BELOW)
def test_counts_below_their_least_are_refused(flag, value, low, tmp_path):
    assert f"--{flag} {value} must be >= {low}" in stop_line([f"--{flag}", str(value)], tmp_path)


def write_eval(path, env, games, seeds=None, env_args=""):
    path.mkdir()
    ev = {"iteration": 1, "rates": {}, "games": {"held-out": games}, "env": env, "env_args": env_args}
    if seeds is not None:
        ev["seeds"] = {"held-out": seeds}
    (path / "eval.json").write_text(json.dumps(ev))


def test_compare_refuses_evals_of_different_envs_or_games(tmp_path):
    """A treasure run and a key-and-door run both play "held-out" seeds 10^9 + k: the same names, not
    the same games. An eval.json from before env and seeds were written is compared as before."""
    import evaluate

    write_eval(tmp_path / "t", "treasure", [1, 0, 1], [0, 1, 2])
    write_eval(tmp_path / "k", "keydoor", [0, 0, 1], [0, 1, 2])
    write_eval(tmp_path / "t2", "treasure", [0, 0, 1], [5, 6, 7])
    write_eval(tmp_path / "t3", "treasure", [0, 1, 1], [0, 1, 2], env_args="progress=0")
    with pytest.raises(ValueError, match="treasure and keydoor: not the same games"):
        evaluate.compare(str(tmp_path / "t"), str(tmp_path / "k"))
    with pytest.raises(ValueError, match="held-out: the evals played other seeds"):
        evaluate.compare(str(tmp_path / "t"), str(tmp_path / "t2"))
    table = evaluate.compare(str(tmp_path / "t"), str(tmp_path / "t3"))  # same games, another reward
    assert "env_args '' and 'progress=0'" in table.splitlines()[0]
    write_eval(tmp_path / "t4", "treasure", [0, 1, 1], [0, 1, 2], env_args="progress=0,size=8")
    with pytest.raises(ValueError, match="differ in size: not the same games"):  # same seeds, larger grids
        evaluate.compare(str(tmp_path / "t"), str(tmp_path / "t4"))
    write_eval(tmp_path / "t5", "treasure", [0, 1, 1], [0, 1, 2], env_args="size=5")  # the default, spelt out
    assert "env_args '' and 'size=5'" in evaluate.compare(str(tmp_path / "t"), str(tmp_path / "t5"))
    write_eval(
        tmp_path / "t7", "treasure", [0, 1, 1], [0, 1, 2], env_args="colour=red"
    )  # no longer an argument
    with pytest.raises(ValueError, match="differ in env_args: not the same games"):
        evaluate.compare(str(tmp_path / "t"), str(tmp_path / "t7"))
    (tmp_path / "t6").mkdir()  # another set's name: nothing to pair
    (tmp_path / "t6" / "eval.json").write_text(
        (tmp_path / "t" / "eval.json").read_text().replace("held-out", "x")
    )
    with pytest.raises(ValueError, match="the evals share no set"):
        evaluate.compare(str(tmp_path / "t"), str(tmp_path / "t6"))
    (tmp_path / "old").mkdir()
    old = {"iteration": 1, "rates": {}, "games": {"held-out": [0] * 3}}
    (tmp_path / "old" / "eval.json").write_text(json.dumps(old))
    rows = evaluate.compare(str(tmp_path / "k"), str(tmp_path / "old")).splitlines()
    assert rows[3].startswith("| held-out | 3 |")


def test_evaluate_writes_the_env_and_the_seeds_it_played(tmp_path, monkeypatch):
    import evaluate

    class Envs:
        n = 2

    monkeypatch.setattr(evaluate, "rollout", lambda *a, **k: ([], [{"won": True}, {"won": False}], None))
    monkeypatch.setattr(evaluate, "eval_envs_for", lambda cfg, envs, kwargs, seeds: envs)
    cfg = train.Config(env="keydoor", env_args="size=6", eval_episodes=2, out_dir=str(tmp_path))
    evaluate.evaluate(None, cfg, Envs(), None, None, iteration=3)
    saved = json.load(open(tmp_path / "eval.json"))
    assert saved["env"] == "keydoor" and saved["env_args"] == "size=6"
    assert saved["seeds"] == {"held-out": [evaluate.HELD_OUT, evaluate.HELD_OUT + 1]}


@pytest.mark.parametrize("env", ["webshop", "search"])
def test_the_web_envs_preset_applies_and_flags_override_it(env):
    """--env webshop|search sets window memory (k = 2) and 512 response tokens, as docs/envs.md says
    (they were once written in the env modules and never read); a flag still wins."""
    cfg = train.parse_args(["--env", env])
    assert (cfg.memory, cfg.memory_k, cfg.max_response_tokens) == ("window", 2, 512)
    assert train.parse_args(["--env", env, "--max_response_tokens", "8"]).max_response_tokens == 8
    assert train.parse_args(["--env", "treasure"]).max_response_tokens != 512


def test_flags_that_depend_on_the_ranks_are_one_line():
    """check_world: --n_groups must divide over the ranks."""
    with pytest.raises(SystemExit) as e:
        checks.check_world(train.parse_args(["--n_groups", "3"]), 2)
    assert str(e.value.code).startswith("error: ") and "--n_groups 3 must divide over 2 ranks" in str(
        e.value.code
    )
    checks.check_world(train.parse_args(["--n_groups", "3"]), 1)  # one process: fine


def test_flags_that_do_nothing_get_a_note_and_the_run_goes_on(tmp_path, capsys):
    """idle_flags: a flag given away from its default that the rest of the config never reads is a
    note on stderr (one line each), not an error; the same value left at its default, or one the
    config does read, gets none."""
    note = lambda *args: checks.idle_flags(train.parse_args(list(args)), train.env_defaults(args[1]))  # noqa: E731
    assert note("--env", "treasure", "--algo", "grpo", "--similarity", "0.8") == [
        "note: --similarity 0.8 does nothing: --algo grpo has no step groups"
    ]
    assert note("--env", "treasure", "--algo", "gigpo", "--similarity", "0.8") == []
    assert note("--env", "treasure", "--algo", "rloo", "--norm", "mean_std_norm")[0].startswith(
        "note: --norm"
    )
    assert note("--env", "treasure", "--memory_k", "3")[0].startswith("note: --memory_k 3 does nothing")
    assert note("--env", "treasure", "--memory", "window", "--memory_k", "3", "--overlap", "1") == [
        "note: --overlap 1 does nothing: envs stepped in-process have no wait to hide (--env_workers N)"
    ]
    # ALFWorld's preset sets memory_k 2: --memory none leaves it unread, but the user did not give it
    assert note("--env", "alfworld", "--memory", "none") == []
    cfg = train.parse_args(["--algo", "grpo", "--similarity", "0.5", "--out_dir", str(tmp_path / "out")])
    train.check_config(cfg, train.env_defaults(cfg.env))  # no SystemExit
    assert capsys.readouterr().err == "note: --similarity 0.5 does nothing: --algo grpo has no step groups\n"
