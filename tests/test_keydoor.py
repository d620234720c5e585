"""The key-and-door game (envs/keydoor.py), the credit measurements on its episodes (bench/credit.py)
and the seed-sweep statistics (bench/sweep.py)."""

import json

import numpy as np
import pytest

from envs.keydoor import KeyDoor, good_moves, rates
from prompts import prompt_module


def start(env, pos, key, door, walls=()):
    env.reset(seed=0)
    env.pos, env.key, env.door, env.walls, env.has_key, env.steps = pos, key, door, set(walls), key is None, 0


def test_key_then_door_sparse_reward():
    env = KeyDoor(size=5, max_steps=40)
    start(env, (0, 0), (0, 2), (0, 1))
    obs, r, term, trunc, info = env.step("right")  # onto the door without the key: nothing
    assert (obs, r, term) == ("at (0, 1) key (0, 2) door (0, 1)", 0.0, False)
    obs, r, term, _, _ = env.step("right")  # the key: picked up, no reward
    assert (obs, r, term) == ("at (0, 2) door (0, 1) have key", 0.0, False)
    assert env.step("up")[0] == obs  # border: same state, same text (anchors recur)
    assert env.step("dance")[0] == obs  # invalid: a no-op, not a crash
    obs, r, term, trunc, info = env.step("left")  # the door with the key: the only reward
    assert (r, term, trunc, info["won"]) == (1.0, True, False, True)


def test_truncates_walls_block_and_key0():
    env = KeyDoor(size=5, max_steps=3)
    start(env, (0, 0), (4, 4), (4, 3), walls=[(1, 0)])
    assert env.step("down")[0].startswith("at (0, 0)")  # a wall: stays
    assert env.step("up")[3] is False and env.step("up")[3] is True  # truncated at max_steps
    env = KeyDoor(key=0)
    obs, info = env.reset(seed=3)
    assert "key" not in obs and info["task"] == "walk to the door"
    start(env, (0, 0), None, (0, 1))
    assert env.step("right")[1:3] == (1.0, True)


def test_pool_bumps_pools_the_anchor_after_a_no_op_only():
    """pool_bumps=1: the step after a move that changed nothing is anchored on "Nothing happens."
    (ALFWorld's pooled anchor); a real move, a pickup and the default env keep the state's text."""
    env = KeyDoor(size=5, pool_bumps=1)
    start(env, (0, 0), (0, 1), (4, 4))
    assert "anchor" not in env.step("right")[4]  # onto the key: picked up, the state changed
    obs, _, _, _, info = env.step("up")  # the border: stays, same observation
    assert obs == "at (0, 1) door (4, 4) have key" and info["anchor"] == "Nothing happens."
    assert env.step("dance")[4]["anchor"] == "Nothing happens."  # an invalid reply is a no-op too
    assert "anchor" not in env.step("down")[4]
    plain = KeyDoor(size=5)
    start(plain, (0, 0), (0, 1), (4, 4))
    assert "anchor" not in plain.step("up")[4]
    with pytest.raises(ValueError, match="pool_bumps"):
        KeyDoor(pool_bumps=2)


def test_reset_is_seeded_and_always_solvable():
    a, b = KeyDoor(walls=6), KeyDoor(walls=6)
    assert a.reset(5)[0] == b.reset(seed=5)[0]
    for s in range(200):  # the optimal walk wins every drawn layout
        a.reset(s)
        done = False
        while not done:
            _, _, won, trunc, _ = a.step(a.optimal_action())
            done = won or trunc
        assert won
    with pytest.raises(ValueError, match="keydoor"):
        KeyDoor(walls=20)
    with pytest.raises(ValueError, match="integers"):
        KeyDoor(size="5")


def test_random_policy_wins_rarely_and_by_long_walks():
    rand, rand_len, opt, opt_len = rates(n=1000)
    assert 0.12 < rand < 0.3 and rand_len > 2.5 * opt_len and opt == 1.0


def test_good_moves_follow_the_current_target():
    assert good_moves("at (2, 1) key (1, 4) door (3, 0)") == {"up", "right"}
    assert good_moves("at (2, 1) door (3, 0) have key") == {"down", "left"}
    assert good_moves("at (0, 0) door (0, 2) have key wall (0, 1)") == {"down"}  # around the wall


def test_chat_prompt_names_the_current_target():
    chat = prompt_module("keydoor", chat=True)
    before = chat.build("t", "", "at (2, 1) key (1, 4) door (3, 0)", [], 0)[0]["content"]
    after = chat.build("t", "", "at (2, 1) door (3, 0) have key", [], 0)[0]["content"]
    assert "The key is at row 1, column 4, that is 1 row above you and 3 columns to your right" in before
    assert "You have the key. The door is at row 3, column 0" in after
    assert chat.parse("Left.", ["up", "down", "left", "right"]) == ("left", True)
    door = chat.build("t", "", "at (2, 1) door (3, 0)", [], 0)[0]["content"]  # key=0: no key in the rules
    assert "key" not in door and "Walk onto the door to open it" in door
    coords = prompt_module("keydoor", chat=True, variant="coords").build(
        "t", "", "at (2, 1) door (3, 0) have key", [], 0
    )
    assert coords[0]["content"] == after.replace(", that is 1 row below you and 1 column to your left", "")


def test_mann_whitney_and_bootstrap_by_hand():
    from bench.sweep import bootstrap_diff, mann_whitney

    # a = 1 2 3 below b = 4 5 6: U = 0; of the C(6, 3) = 20 splits only this one and its mirror are as extreme
    assert mann_whitney([1, 2, 3], [4, 5, 6]) == (0.0, pytest.approx(0.1))
    assert mann_whitney([4, 5, 6], [1, 2, 3]) == (9.0, pytest.approx(0.1))
    assert mann_whitney([1, 1], [1, 1]) == (2.0, 1.0)  # all tied: U at its centre
    # ties at mid-rank: pooled 0 0 1 1 -> ranks 1.5 1.5 3.5 3.5; a = (0, 1) has U = 5 - 3 = 2, the centre
    assert mann_whitney([0, 1], [0, 1]) == (2.0, 1.0)
    d, lo, hi = bootstrap_diff([1, 1, 1], [0, 0, 0])
    assert (d, lo, hi) == (1.0, 1.0, 1.0)
    d, lo, hi = bootstrap_diff([0.9, 1.0, 0.8, 1.0], [0.2, 0.5, 0.3, 0.4])
    assert d == pytest.approx(0.575) and 0.3 < lo < d < hi < 0.8


def test_sweep_reads_runs_up_to_an_iteration(tmp_path, capsys):
    """--at N: each run's last eval at or before N is its "final", the bar counts only up to N, and the
    sampled-policy measure is the mean training success of the last 5 iterations up to N."""
    from bench.sweep import summarise

    run = tmp_path / "gigpo-s0"
    run.mkdir()
    lines = [
        {"iteration": i, "wall": 2.0 * i, "eval_success": [0.1, 0.2, 0.5][i // 5 - 1] if i % 5 == 0 else None}
        for i in range(1, 16)
    ]
    for m in lines:
        m["success"] = m["iteration"] / 100  # training success at T = 1: 0.01 .. 0.15
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    full, early = summarise("gigpo", [str(run)], 0.4)[0], summarise("gigpo", [str(run)], 0.4, at=12)[0]
    assert (full["final"], full["it_bar"], full["last"]) == (0.5, 15, 15)
    assert (early["final"], early["it_bar"], early["last"]) == (0.2, None, 12)
    assert full["sampled"] == pytest.approx(0.13) and early["sampled"] == pytest.approx(0.10)  # 11-15, 8-12
    row = capsys.readouterr().out.splitlines()[-1]  # --at 12's row: its last column the sampled measure
    assert row.startswith("| gigpo | 0/1 |") and row.endswith("| 0.20 | 0.10 |")


def fake_run(path, step_returns, adv_episode, anchors, actions, won):
    """One training group of two episodes written as records.episodes does."""
    eps = []
    for t, (rets, aes, anch, acts, w) in enumerate(zip(step_returns, adv_episode, anchors, actions, won)):
        steps = [
            {
                "step": k,
                "anchor": a,
                "action": x,
                "valid": True,
                "reward": 0.0,
                "step_return": r,
                "adv_episode": e,
                "step_group": a,
                "step_group_size": sum(a == b for aa in anchors for b in aa),
            }
            for k, (r, e, a, x) in enumerate(zip(rets, aes, anch, acts))
        ]
        eps.append(
            {
                "iteration": 1,
                "split": "train",
                "group": 0,
                "traj": t,
                "return": float(w),
                "length": len(steps),
                "steps": steps,
            }
        )
    path.mkdir()
    (path / "episodes.jsonl").write_text("".join(json.dumps(e) + "\n" for e in eps))


def test_credit_puts_both_advantages_on_the_same_steps(tmp_path):
    """Two episodes from one start: the winner steps right (towards the key) and wins; the loser
    bumps the border, then steps right and loses. GRPO credits each episode's steps alike; GiGPO's
    A^S ranks the two visits of the shared state by their discounted returns."""
    from bench import credit

    s0, s1 = "at (0, 0) key (0, 1) door (0, 2)", "at (0, 1) door (0, 2) have key"
    fake_run(
        tmp_path / "run-s0",
        step_returns=[[0.9025, 0.95], [0.0, 0.0, 0.0]],
        adv_episode=[[0.6, 0.6], [-0.4, -0.4, -0.4]],
        anchors=[[s0, s1], [s0, s0, s1]],
        actions=[["right", "right"], ["up", "right", "up"]],
        won=[1, 0],
    )
    (r,) = credit.main([str(tmp_path / "run-s0")])
    assert r["samples"] == 5 and r["singleton_samples"] == 0.0
    # step group s0 has returns (0.9025, 0, 0): A^S = 0.9025 - 0.30083 = +0.60 for the winner's step,
    # -0.30 for the loser's two; every A^S here has its episode's sign
    assert r["sign_disagree"] == 0.0
    assert r["grpo_pickup_won"] == pytest.approx(0.6) and r["grpo_pickup_lost"] == pytest.approx(-0.4)
    assert r["gigpo_pickup_won"] == pytest.approx(0.6 + 0.9025 - 0.9025 / 3)
    # towards the key: the winner's first step and the loser's second; the loser's bump is the other
    # valid step
    assert r["grpo_sep_lost"] == pytest.approx(0.0)  # same episode, same A^E
    assert r["gigpo_sep_all"] > r["grpo_sep_all"]
    assert np.isfinite(r["mean_group_size"])
    assert (r["top_anchor"], r["top_anchor_share"]) == (s0, pytest.approx(3 / 5))  # s0: 3 of the 5 samples
    assert (r["mixed_samples"], r["mixed_step_mass"], r["won_samples"]) == (
        1.0,
        1.0,
        0.0,
    )  # one won, one lost


def test_credit_sorts_samples_by_their_groups_outcome(tmp_path):
    """A group whose episodes all won (GRPO's A^E = 0 there) and one whose episodes all lost."""
    from bench import credit

    s0, s1 = "at (0, 0) key (0, 1) door (0, 2)", "at (0, 1) door (0, 2) have key"
    for name, won in (("allwon-s0", [1, 1]), ("alllost-s0", [0, 0])):
        fake_run(
            tmp_path / name,
            step_returns=[[0.9025, 0.95], [0.857, 0.9025, 0.95]] if won[0] else [[0, 0], [0, 0, 0]],
            adv_episode=[[0, 0], [0, 0, 0]],
            anchors=[[s0, s1], [s0, s0, s1]],
            actions=[["right", "right"], ["up", "right", "right"]],
            won=won,
        )
    r_won, r_lost = credit.main([str(tmp_path / "allwon-s0"), str(tmp_path / "alllost-s0")])
    # s0's three visits return 0.9025, 0.857, 0.9025: A^S != 0 on them; s1's two both return 0.95: A^S = 0
    assert (r_won["won_samples"], r_won["won_step_mass"], r_won["step_only"]) == (
        1.0,
        1.0,
        pytest.approx(3 / 5),
    )
    assert (r_won["won_groups"], r_won["lost_groups"], r_lost["lost_groups"]) == (1, 0, 1)
    assert (r_lost["lost_samples"], r_lost["step_only"]) == (1.0, 0.0)  # no return differs: A^S = 0 too


def test_credit_sign_disagreement_counts_only_steps_with_both_parts():
    from bench.credit import report

    rows = [
        {
            "a_e": e,
            "a_s": a,
            "size": 2,
            "group": 0,
            "anchor": "s",
            "won": e > 0,
            "valid": True,
            "pickup": False,
            "toward": False,
            "keydoor": False,
            "outcome": o,
        }
        for e, a, o in [
            (0.5, 0.2, "mixed"),
            (0.5, -0.1, "mixed"),
            (-0.5, -0.3, "mixed"),
            (0.0, 0.4, "won"),
            (0.5, 0.0, "mixed"),
        ]
    ]
    r = report("x", rows)
    assert (r["won_samples"], r["mixed_samples"], r["lost_samples"]) == (
        pytest.approx(1 / 5),
        pytest.approx(4 / 5),
        0.0,
    )
    assert r["won_step_mass"] == pytest.approx(0.4 / 1.0)  # sum abs(A^S) = 0.2 + 0.1 + 0.3 + 0.4
    assert (
        r["sign_disagree"] == pytest.approx(1 / 3)
        and r["singleton_samples"] == 0.0
        and r["mean_group_size"] == 2
    )
    # whole advantages: (0.7, 0.4, -0.8, 0.4, 0.5) against (0.5, 0.5, -0.5, 0, 0.5): only the 4th
    # differs in sign
    assert r["flips"] == pytest.approx(1 / 5)
    assert r["cosine"] == pytest.approx(
        (0.35 + 0.2 + 0.4 + 0.25) / (np.sqrt(0.49 + 0.16 + 0.64 + 0.16 + 0.25) * 1.0)
    )
