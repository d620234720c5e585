"""Tests for gigpo.py. Every expected number is worked out by hand in a comment."""

import math
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import gigpo as G  # noqa: E402

SQ2 = math.sqrt(2.0)


def close(a, b, tol=1e-5):
    np.testing.assert_allclose(np.asarray(a, dtype=np.float64), b, rtol=tol, atol=tol)


def A(*args, **kw):
    """The advantage trained on, from the one call (its parts: test_parts_add_up_for_every_estimator)."""
    return G.advantages(*args, **kw)["adv"]


# ------------------------------------------------------------------ returns and scores
def test_discounted_returns_interleaved():
    # traj 0 = samples 0,2,4 with r = 1,3,5 ; traj 1 = samples 1,3 with r = 2,4 ; gamma .5
    # traj 0: R4 = 5, R2 = 3 + .5*5 = 5.5, R0 = 1 + .5*5.5 = 3.75
    # traj 1: R3 = 4, R1 = 2 + .5*4 = 4
    out = G.discounted_returns([1, 2, 3, 4, 5], [0, 1, 0, 1, 0], 0.5)
    close(out, [3.75, 4.0, 5.5, 4.0, 5.0])


def test_episode_scores_with_invalid_step():
    # traj 0 rewards 0,0,1 -> return 1 ; traj 1 rewards 0,0 -> 0
    # sample 1 is invalid: 1 - 0.1 = 0.9 ; the others keep their trajectory return
    out = G.episode_scores([0, 0, 1, 0, 0], [0, 0, 0, 1, 1], [1, 0, 1, 1, 1], 0.1)
    close(out, [1.0, 0.9, 1.0, 0.0, 0.0])


def test_step_returns_penalty_not_discounted():
    # R = [0 + .5*.5, 0 + .5*1, 1] = [.25, .5, 1]; penalty .1 only on sample 1 -> .4
    # sample 0 stays .25 (a discounted-back penalty would give .25 - .05 = .2)
    out = G.step_returns([0, 0, 1], [7, 7, 7], [True, False, True], 0.5, 0.1)
    close(out, [0.25, 0.4, 1.0])


# ------------------------------------------------------------------ group normalisation
VALS = [1, 0, 0, 1, 2, 4, 6]
GIDS = [0, 0, 0, 0, 1, 1, 1]


def test_mean_norm_two_groups():
    # group 0: mean .5 -> [.5, -.5, -.5, .5] ; group 1: mean 4 -> [-2, 0, 2]
    close(G.group_stats_normalize(VALS, GIDS, "mean_norm"), [0.5, -0.5, -0.5, 0.5, -2, 0, 2])


def test_mean_std_norm_two_groups():
    # group 0: mean .5, var = 4 * .25 / 3 = 1/3, std = sqrt(1/3) = .57735
    #          .5 / .57735 = .866025 (= sqrt(3)/2)
    # group 1: mean 4, var = (4 + 0 + 4) / 2 = 4, std 2 -> [-1, 0, 1]
    h = math.sqrt(3) / 2
    out = G.group_stats_normalize(VALS, GIDS, "mean_std_norm", eps=0.0)
    close(out, [h, -h, -h, h, -1, 0, 1], tol=1e-12)


def test_bad_norm_name():
    with pytest.raises(ValueError, match="mean_std_norm"):
        G.group_stats_normalize([1.0], [0], "zscore")


def test_singleton_episode_group():
    # group 0 has one member: mean 0, std 1 -> 3 / (1 + 1e-6) (mean_norm: 3)
    # group 1: values 1, 2 -> mean 1.5, std sqrt(.5) = .70711 -> -/+ .5 / .70711 = -/+ .70711
    out = G.group_stats_normalize([3, 1, 2], [0, 1, 1], "mean_std_norm")
    close(out, [3 / (1 + 1e-6), -1 / SQ2, 1 / SQ2])
    close(G.group_stats_normalize([3, 1, 2], [0, 1, 1], "mean_norm"), [3, -0.5, 0.5])


def test_zero_variance_group_gives_zeros():
    # all equal: x - mean = 0, std = 0 -> 0 / (0 + eps) = 0, not NaN
    for norm in G.NORMS:
        out = G.episode_advantage([1, 1, 1, 1], [0, 0, 0, 0], [0, 0, 1, 1], norm=norm)
        assert np.all(np.isfinite(out))
        close(out, [0, 0, 0, 0], tol=0)


def test_traj_stats_tied_group_with_invalid_steps_stays_bounded():
    # trajs a, b both return 1; a's step 1 and b's step 0 are invalid -> scores 1, .9, .9, 1.
    # traj units: a = .95, b = .95 -> std 0: a tied group, A^E = 0 (was (+-.05) / 1e-6 = +-5e4)
    out = A(
        [0, 1, 0, 1],
        ["a", "a", "b", "b"],
        [0] * 4,
        ["s0", "s1", "s0", "s2"],
        [True, False, False, True],
        norm="mean_std_norm",
        stats="traj",
        omega=0,
    )
    close(out, [0, 0, 0, 0], tol=0)
    # step stats: samples 1, .9, .9, 1 -> mean .95, std sqrt(4 * .0025 / 3) = .057735 -> +-.866
    step = A(
        [0, 1, 0, 1],
        ["a", "a", "b", "b"],
        [0] * 4,
        ["s0", "s1", "s0", "s2"],
        [True, False, False, True],
        norm="mean_std_norm",
        stats="step",
        omega=0,
    )
    close(step, [0.866025, -0.866025, -0.866025, 0.866025], tol=1e-4)


def test_step_vs_traj_statistics_differ():
    # traj A has 3 steps with score 1, traj B one step with score 0, one group.
    scores, gids, tids = [1, 1, 1, 0], [0, 0, 0, 0], ["A", "A", "A", "B"]
    # step stats: mean .75, var = (3 * .0625 + .5625) / 3 = .25, std .5
    #   A: .25 / .5 = .5 ; B: -.75 / .5 = -1.5
    step = G.episode_advantage(scores, gids, tids, stats="step")
    close(step, [0.5, 0.5, 0.5, -1.5])
    # traj stats: units A = 1, B = 0 -> mean .5, std sqrt(.5) = .70711
    #   A: .5 / .70711 = .70711 ; B: -.70711
    traj = G.episode_advantage(scores, gids, tids, stats="traj")
    close(traj, [1 / SQ2] * 3 + [-1 / SQ2])
    with pytest.raises(ValueError, match="traj"):
        G.episode_advantage(scores, gids, tids, stats="episode")


def test_unit_value_is_its_return():
    # traj A samples 1, .9 (its second step invalid) -> unit value 1 = R(A); traj B sample 0 -> 0;
    # mean over units .5; each sample subtracts from its own value: 1 - .5, .9 - .5, 0 - .5
    out = G.group_stats_normalize([1, 0.9, 0], [0, 0, 0], "mean_norm", unit_ids=["A", "A", "B"])
    close(out, [0.5, 0.4, -0.5])


def test_traj_stats_near_tie_from_the_penalty_stays_bounded():
    # two lost walks, 50 and 49 steps, one invalid action each: R = 0 for both. With a unit's
    # value the mean of its samples' scores (-.1/50 vs -.1/49, std 3e-5) the invalid samples got
    # -3281; with R(tau) the group ties and gets 0. The step statistics stay as they were.
    r, t, g, v = [0.0] * 99, [0] * 50 + [1] * 49, [0] * 99, [1] * 49 + [0] + [1] * 48 + [0]
    anchors = [str(i) for i in range(99)]
    traj = A(r, t, g, anchors, v, algo="grpo", stats="traj")
    close(traj, [0] * 99, tol=0)
    step = A(r, t, g, anchors, v, algo="grpo", stats="step")
    assert -7 < step.min() < -6.9 and 0.14 < step.max() < 0.15
    # a walk with every step invalid is worth R - penalty: ranked below, by a bounded amount
    out = A([0, 0, 0, 0], [0, 0, 1, 1], [0] * 4, list("abcd"), [1, 0, 0, 0], algo="grpo", stats="traj")
    assert np.abs(out).max() < 2 and out[0] > 0 > out[2]


# ------------------------------------------------------------------ step groups
def test_step_groups_exact_with_loop_and_group_separation():
    anchors = ["s0", "s1", "s0", "s0", "s2", "s0"]
    gids = [0, 0, 0, 0, 0, 1]
    # traj 0 = samples 0,1,2 (visits s0 twice: a loop) ; traj 1 = samples 3,4 ; group 1 = sample 5
    # (0,s0) -> 0, (0,s1) -> 1, (0,s0) -> 0, (0,s0) -> 0, (0,s2) -> 2, (1,s0) -> 3 (other group)
    out = G.step_groups(anchors, gids)
    assert out.tolist() == [0, 1, 0, 0, 2, 3]
    assert out.dtype.kind == "i"


def test_step_groups_similarity():
    anchors = ["at (1, 2)", "at (1, 2) ", "at (3, 4)"]
    # exact: three different strings -> three groups
    assert G.step_groups(anchors, [0, 0, 0]).tolist() == [0, 1, 2]
    # ratio("at (1, 2) ", "at (1, 2)") = 2*9/(10+9) = .947 >= .9 -> joins group 0
    # ratio("at (3, 4)", "at (1, 2)"): matches "at (", ", ", ")" = 7 chars -> 14/18 = .778 -> new
    assert G.step_groups(anchors, [0, 0, 0], similarity=0.9).tolist() == [0, 0, 1]
    with pytest.raises(ValueError):
        G.step_groups(anchors, [0, 0, 0], similarity=0.0)


def test_step_advantage_singleton_is_zero():
    # step group 0: rets 1, 3 -> mean 2, std sqrt(2) -> -/+ 1/sqrt(2) ; group 1 alone -> 0
    out = G.step_advantage([1, 3, 5], [0, 0, 1])
    close(out, [-1 / SQ2, 1 / SQ2, 0])


# ------------------------------------------------------------------ advantages (the one call)
# One episode group, gamma .5, omega 1, penalty .1, samples interleaved:
#   sample: 0      1      2      3      4
#   traj:   0      1      0      1      0
#   anchor: s0     s0     s1     s1     s2
#   reward: 0      0      0      0      1
#   valid:  1      1      1      0      1
EX = dict(
    rewards=[0, 0, 0, 0, 1],
    traj_ids=[0, 1, 0, 1, 0],
    group_ids=[9] * 5,
    anchors=["s0", "s0", "s1", "s1", "s2"],
    valid=[1, 1, 1, 0, 1],
)
EX_KW = dict(gamma=0.5, omega=1.0, penalty=0.1)
# Episode scores: traj 0 returns 1 -> [1, ., 1, ., 1]; traj 1 returns 0, sample 3 invalid -> -.1
#   values [1, 0, 1, -.1, 1]; mean = 2.9 / 5 = .58
#   deviations .42 (x3), -.58, -.68; squares .1764*3 + .3364 + .4624 = 1.328
#   var = 1.328 / 4 = .332, std = .576194
#   A^E: .42/.576194 = .728921 ; -.58/.576194 = -1.006605 ; -.68/.576194 = -1.180157
AE = [0.728921, -1.006605, 0.728921, -1.180157, 0.728921]
# Step returns: traj 0: [0 + .5*.5, 0 + .5*1, 1] = [.25, .5, 1] ; traj 1: [0, 0 - .1] = [0, -.1]
#   s0 = {.25 (s0), 0 (s1)} -> mean .125, std .125*sqrt2 -> +/- 1/sqrt2 = .707107
#   s1 = {.5 (s2), -.1 (s3)} -> +/- .707107 ; s2 = {1} alone -> 0
AS = [1 / SQ2, -1 / SQ2, 1 / SQ2, -1 / SQ2, 0.0]


def test_advantages_gigpo_by_hand():
    out = A(**EX, **EX_KW)
    # A = A^E + A^S = [1.436028, -1.713712, 1.436028, -1.887264, .728921]
    close(out, [a + s for a, s in zip(AE, AS)])
    close(out, [1.436028, -1.713712, 1.436028, -1.887264, 0.728921])
    assert out.shape == (5,)


def test_advantages_tied_step_ablation():
    # the example's group (scores differ) keeps its A^S; a second group where both walks win, one in
    # 1 step (return 1) and one in 2 (returns .5, 1) from the shared start t0, ties at score 1:
    # A^E = 0 there, A^S on t0 = (1 - .75) / std(1, .5) = +-.707107, zeroed by tied_step=False
    ex = {
        k: v + extra
        for (k, v), extra in zip(EX.items(), ([1, 0, 1], [2, 3, 3], [8] * 3, ["t0", "t0", "t1"], [1, 1, 1]))
    }
    full = A(**ex, **EX_KW)
    close(full, [a + s for a, s in zip(AE, AS)] + [1 / SQ2, -1 / SQ2, 0.0])
    ablated = A(**ex, **EX_KW, tied_step=False)
    close(ablated, [a + s for a, s in zip(AE, AS)] + [0.0, 0.0, 0.0])


def test_advantages_grpo_is_gigpo_omega_zero():
    grpo = A(**EX, **EX_KW, algo="grpo")
    close(grpo, AE)
    zero = A(**EX, gamma=0.5, omega=0.0, penalty=0.1)
    np.testing.assert_array_equal(grpo, zero)


def test_advantages_rloo():
    # scores [1, 0, 1, -.1, 1], n = 5, sum 2.9
    # a "1": 1 - (2.9 - 1)/4 = 1 - .475 = .525 ; the 0: 0 - 2.9/4 = -.725 ; -.1 - 3/4 = -.85
    out = A(**EX, **EX_KW, algo="rloo")
    close(out, [0.525, -0.725, 0.525, -0.85, 0.525])


def test_advantages_bad_inputs():
    bad = dict(EX, rewards=[0, float("nan"), 0, 0, 1])
    with pytest.raises(ValueError, match="NaN/inf reward at sample 1"):
        A(**bad)
    with pytest.raises(ValueError, match="NaN/inf reward at sample 4"):
        A(**dict(EX, rewards=[0, 0, 0, 0, float("inf")]))
    with pytest.raises(ValueError, match="same length"):
        A(**dict(EX, valid=[1, 1, 1]))
    with pytest.raises(ValueError, match="gigpo"):
        A(**EX, algo="dqn")
    with pytest.raises(ValueError, match="ppo needs one critic value per sample"):
        A(**EX, algo="ppo")
    with pytest.raises(ValueError, match="episode groups"):
        A(**dict(EX, group_ids=[9, 9, 8, 9, 9]))


def test_advantages_empty():
    out = A([], [], [], [], [])
    assert isinstance(out, np.ndarray) and out.shape == (0,)


def test_advantage_stats():
    # groups: 0 -> scores 1,1,0,0 (varies), 1 -> 2,2 (all equal) -> zero_var 1/2
    # step groups sizes: id0: 2, id1: 1, id2: 1, id3: 2 -> hist {1: 2, 2: 2}
    # singleton 2/4 = .5 ; mean size 6/4 = 1.5
    st = G.advantage_stats([1, 1, 0, 0, 2, 2], [0, 0, 0, 0, 1, 1], [0, 0, 1, 2, 3, 3])
    assert st == {
        "zero_var_group_frac": 0.5,
        "step_group_size_hist": {1: 2, 2: 2},
        "singleton_step_group_frac": 0.5,
        "mean_step_group_size": 1.5,
    }


# ------------------------------------------------------------------ the baselines through the registry
def test_reinforce_pp_is_global_not_per_group():
    # one-step trajectories a, b (group 0) return 2, 0 ; c, d (group 1) return 4, 2
    # global mean 2: deviations 0, -2, 2, 0, var 8/3, std 1.632993 -> 0, -1.224745, 1.224745, 0
    # (a group baseline would give 1, -1, 1, -1)
    out = A(
        [2, 0, 4, 2], ["a", "b", "c", "d"], [0, 0, 1, 1], ["s"] * 4, [1] * 4, algo="reinforce_pp", gamma=0.5
    )
    close(out, [0, -1.224745, 1.224745, 0])


def test_advantages_reinforce_pp_on_the_example():
    # step returns (the GiGPO example below): [.25, 0, .5, -.1, 1], mean .33
    # deviations -.08, -.33, .17, -.43, .67; squares sum .778, var .1945, std .441022
    out = A(**EX, **EX_KW, algo="reinforce_pp")
    close(out, [-0.181397, -0.748263, 0.385469, -0.975009, 1.519200])


def test_advantages_ppo_by_hand():
    # the example below, V = .5, .2, .6, .4, .8, gamma .5, lam 1: GAE = return - V
    #   traj 0 (samples 0, 2, 4): returns .25, .5, 1 -> -.25, -.1, .2 ; traj 1: 0, 0 -> -.2, -.4
    #   invalid sample 3: -.4 - .1 = -.5 -> raw [-.25, -.2, -.1, -.5, .2], mean -.17
    #   deviations -.08, -.03, .07, -.33, .37; squares sum .258, var .0645, std .253969
    out = A(**EX, **EX_KW, algo="ppo", values=[0.5, 0.2, 0.6, 0.4, 0.8], gae_lambda=1.0)
    close(out, [-0.315000, -0.118125, 0.275625, -1.299374, 1.456874])


# ------------------------------------------------------------------ every estimator: its parts add up
# Each estimator's parts on the example (gamma .5, penalty .1, omega .5, V as in the ppo test, lam 1):
# (adv_episode, adv_step, step_weight), the numbers worked out by hand in the tests above.
PARTS = {
    "gigpo": (AE, AS, 0.5),
    "grpo": (AE, 0, None),
    "rloo": ([0.525, -0.725, 0.525, -0.85, 0.525], 0, None),
    "ppo": (0, [-0.315000, -0.118125, 0.275625, -1.299374, 1.456874], 1.0),
    "reinforce_pp": (0, [-0.181397, -0.748263, 0.385469, -0.975009, 1.519200], 1.0),
}


@pytest.mark.parametrize("algo", G.ALGOS)
def test_parts_add_up_for_every_estimator(algo):
    """For every name in the registry: the parts the one call returns (and records logs) are the
    estimator's own (PARTS) and add up to the advantage trained on, adv = adv_episode + w * adv_step."""
    import records

    assert set(G.ALGOS) == set(G.ESTIMATORS) == set(PARTS), "a new estimator: add its parts to PARTS"
    p = G.advantages(
        **EX, **dict(EX_KW, omega=0.5), algo=algo, values=[0.5, 0.2, 0.6, 0.4, 0.8], gae_lambda=1.0
    )
    a_e, a_s, w = PARTS[algo]
    close(p["adv_episode"], a_e)
    close(p["adv_step"], a_s)
    if w is not None:  # no step term: its weight does not matter
        assert p["step_weight"] == w
    close(p["adv"], p["adv_episode"] + p["step_weight"] * p["adv_step"], tol=1e-12)
    for k in ("adv", "adv_episode", "adv_step", "score", "step_return", "step_group"):
        assert p[k].shape == (5,) and np.all(np.isfinite(p[k])), k
    close(p["score"], [1, 0, 1, -0.1, 1])  # the example's episode scores
    close(p["step_return"], [0.25, 0, 0.5, -0.1, 1])  # and step returns
    assert p["step_group"].tolist() == [0, 0, 1, 1, 2]  # s0, s0, s1, s1, s2
    if algo == "ppo":  # lam 1: the critic's targets are the discounted returns, without the penalty
        close(p["value_target"], [0.25, 0, 0.5, 0, 1])
    logged = records.advantage_parts(p, [3, 4])  # what episodes.jsonl shows of samples 3, 4
    close(p["adv"][[3, 4]], logged["adv_episode"] + p["step_weight"] * logged["adv_step"], tol=1e-12)
    assert logged["step_group_size"].tolist() == [2, 1]
