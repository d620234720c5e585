"""Tests for gigpo.py. Every expected number is worked out by hand in a comment."""
import math
import os
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import gigpo as G  # noqa: E402

SQ2 = math.sqrt(2.0)


def close(a, b, tol=1e-5):
    np.testing.assert_allclose(np.asarray(a, dtype=np.float64), b, rtol=tol, atol=tol)


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
    close(G.group_stats_normalize(VALS, GIDS, "mean_norm"), [.5, -.5, -.5, .5, -2, 0, 2])


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
    close(G.group_stats_normalize([3, 1, 2], [0, 1, 1], "mean_norm"), [3, -.5, .5])


def test_zero_variance_group_gives_zeros():
    # all equal: x - mean = 0, std = 0 -> 0 / (0 + eps) = 0, not NaN
    for norm in G.NORMS:
        out = G.episode_advantage([1, 1, 1, 1], [0, 0, 0, 0], [0, 0, 1, 1], norm=norm)
        assert np.all(np.isfinite(out))
        close(out, [0, 0, 0, 0], tol=0)


def test_traj_stats_tied_group_with_invalid_steps_stays_bounded():
    # trajs a, b both return 1; a's step 1 and b's step 0 are invalid -> scores 1, .9, .9, 1.
    # traj units: a = .95, b = .95 -> std 0: a tied group, A^E = 0 (was (+-.05) / 1e-6 = +-5e4)
    out = G.compute_advantages([0, 1, 0, 1], ["a", "a", "b", "b"], [0] * 4, ["s0", "s1", "s0", "s2"],
                               [True, False, False, True], norm="mean_std_norm", stats="traj", omega=0)
    close(out, [0, 0, 0, 0], tol=0)
    # step stats: samples 1, .9, .9, 1 -> mean .95, std sqrt(4 * .0025 / 3) = .057735 -> +-.866
    step = G.compute_advantages([0, 1, 0, 1], ["a", "a", "b", "b"], [0] * 4, ["s0", "s1", "s0", "s2"],
                                [True, False, False, True], norm="mean_std_norm", stats="step", omega=0)
    close(step, [.866025, -.866025, -.866025, .866025], tol=1e-4)


def test_step_vs_traj_statistics_differ():
    # traj A has 3 steps with score 1, traj B one step with score 0, one group.
    scores, gids, tids = [1, 1, 1, 0], [0, 0, 0, 0], ["A", "A", "A", "B"]
    # step stats: mean .75, var = (3 * .0625 + .5625) / 3 = .25, std .5
    #   A: .25 / .5 = .5 ; B: -.75 / .5 = -1.5
    step = G.episode_advantage(scores, gids, tids, stats="step")
    close(step, [.5, .5, .5, -1.5])
    # traj stats: units A = 1, B = 0 -> mean .5, std sqrt(.5) = .70711
    #   A: .5 / .70711 = .70711 ; B: -.70711
    traj = G.episode_advantage(scores, gids, tids, stats="traj")
    close(traj, [1 / SQ2] * 3 + [-1 / SQ2])
    with pytest.raises(ValueError, match="traj"):
        G.episode_advantage(scores, gids, tids, stats="episode")


def test_unit_value_is_its_return():
    # traj A samples 1, .9 (its second step invalid) -> unit value 1 = R(A); traj B sample 0 -> 0;
    # mean over units .5; each sample subtracts from its own value: 1 - .5, .9 - .5, 0 - .5
    out = G.group_stats_normalize([1, .9, 0], [0, 0, 0], "mean_norm", unit_ids=["A", "A", "B"])
    close(out, [.5, .4, -.5])


def test_traj_stats_near_tie_from_the_penalty_stays_bounded():
    # two lost walks, 50 and 49 steps, one invalid action each: R = 0 for both. With a unit's
    # value the mean of its samples' scores (-.1/50 vs -.1/49, std 3e-5) the invalid samples got
    # -3281; with R(tau) the group ties and gets 0. The step statistics stay as they were.
    r, t, g, v = [0.0] * 99, [0] * 50 + [1] * 49, [0] * 99, [1] * 49 + [0] + [1] * 48 + [0]
    anchors = [str(i) for i in range(99)]
    traj = G.compute_advantages(r, t, g, anchors, v, algo="grpo", stats="traj")
    close(traj, [0] * 99, tol=0)
    step = G.compute_advantages(r, t, g, anchors, v, algo="grpo", stats="step")
    assert -7 < step.min() < -6.9 and 0.14 < step.max() < 0.15
    # a walk with every step invalid is worth R - penalty: ranked below, by a bounded amount
    out = G.compute_advantages([0, 0, 0, 0], [0, 0, 1, 1], [0] * 4, list("abcd"),
                               [1, 0, 0, 0], algo="grpo", stats="traj")
    assert np.abs(out).max() < 2 and out[0] > 0 > out[2]


def test_rloo_by_hand():
    scores, gids, tids = [1, 1, 1, 0, 5], [0, 0, 0, 0, 1], ["A", "A", "A", "B", "C"]
    # step: group 0 members 1,1,1,0 (n = 4).
    #   a "1" sample: 1 - mean(1, 1, 0) = 1 - 2/3 = 1/3 ; the "0": 0 - mean(1, 1, 1) = -1
    #   group 1 has n = 1 -> 0
    close(G.rloo_advantage(scores, gids, tids), [1 / 3] * 3 + [-1, 0])
    # traj: units A = 1, B = 0 (n = 2): A: 1 - 0 = 1 ; B: 0 - 1 = -1 ; C alone -> 0
    close(G.rloo_advantage(scores, gids, tids, stats="traj"), [1, 1, 1, -1, 0])


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


# ------------------------------------------------------------------ compute_advantages
# One episode group, gamma .5, omega 1, penalty .1, samples interleaved:
#   sample: 0      1      2      3      4
#   traj:   0      1      0      1      0
#   anchor: s0     s0     s1     s1     s2
#   reward: 0      0      0      0      1
#   valid:  1      1      1      0      1
EX = dict(rewards=[0, 0, 0, 0, 1], traj_ids=[0, 1, 0, 1, 0], group_ids=[9] * 5,
          anchors=["s0", "s0", "s1", "s1", "s2"], valid=[1, 1, 1, 0, 1])
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


def test_compute_advantages_gigpo_by_hand():
    out = G.compute_advantages(**EX, **EX_KW)
    # A = A^E + A^S = [1.436028, -1.713712, 1.436028, -1.887264, .728921]
    close(out, [a + s for a, s in zip(AE, AS)])
    close(out, [1.436028, -1.713712, 1.436028, -1.887264, 0.728921])
    assert out.shape == (5,)


def test_compute_advantages_tied_step_ablation():
    # the example's group (scores differ) keeps its A^S; a second group where both walks win, one in
    # 1 step (return 1) and one in 2 (returns .5, 1) from the shared start t0, ties at score 1:
    # A^E = 0 there, A^S on t0 = (1 - .75) / std(1, .5) = +-.707107, zeroed by tied_step=False
    ex = {k: v + extra for (k, v), extra in zip(EX.items(), ([1, 0, 1], [2, 3, 3], [8] * 3, ["t0", "t0", "t1"],
                                                               [1, 1, 1]))}
    full = G.compute_advantages(**ex, **EX_KW)
    close(full, [a + s for a, s in zip(AE, AS)] + [1 / SQ2, -1 / SQ2, 0.0])
    ablated = G.compute_advantages(**ex, **EX_KW, tied_step=False)
    close(ablated, [a + s for a, s in zip(AE, AS)] + [0.0, 0.0, 0.0])


def test_compute_advantages_grpo_is_gigpo_omega_zero():
    grpo = G.compute_advantages(**EX, **EX_KW, algo="grpo")
    close(grpo, AE)
    zero = G.compute_advantages(**EX, gamma=0.5, omega=0.0, penalty=0.1)
    np.testing.assert_array_equal(grpo, zero)


def test_compute_advantages_rloo():
    # scores [1, 0, 1, -.1, 1], n = 5, sum 2.9
    # a "1": 1 - (2.9 - 1)/4 = 1 - .475 = .525 ; the 0: 0 - 2.9/4 = -.725 ; -.1 - 3/4 = -.85
    out = G.compute_advantages(**EX, **EX_KW, algo="rloo")
    close(out, [.525, -.725, .525, -.85, .525])


def test_compute_advantages_bad_inputs():
    bad = dict(EX, rewards=[0, float("nan"), 0, 0, 1])
    with pytest.raises(ValueError, match="NaN/inf reward at sample 1"):
        G.compute_advantages(**bad)
    with pytest.raises(ValueError, match="NaN/inf reward at sample 4"):
        G.compute_advantages(**dict(EX, rewards=[0, 0, 0, 0, float("inf")]))
    with pytest.raises(ValueError, match="same length"):
        G.compute_advantages(**dict(EX, valid=[1, 1, 1]))
    with pytest.raises(ValueError, match="gigpo"):
        G.compute_advantages(**EX, algo="dqn")
    with pytest.raises(ValueError, match="ppo needs one critic value per sample"):
        G.compute_advantages(**EX, algo="ppo")
    with pytest.raises(ValueError, match="episode groups"):
        G.compute_advantages(**dict(EX, group_ids=[9, 9, 8, 9, 9]))


def test_compute_advantages_empty():
    out = G.compute_advantages([], [], [], [], [])
    assert isinstance(out, np.ndarray) and out.shape == (0,)


def test_advantage_stats():
    # groups: 0 -> scores 1,1,0,0 (varies), 1 -> 2,2 (all equal) -> zero_var 1/2
    # step groups sizes: id0: 2, id1: 1, id2: 1, id3: 2 -> hist {1: 2, 2: 2}
    # singleton 2/4 = .5 ; mean size 6/4 = 1.5
    st = G.advantage_stats([1, 1, 0, 0, 2, 2], [0, 0, 0, 0, 1, 1], [0, 0, 1, 2, 3, 3])
    assert st == {"zero_var_group_frac": 0.5, "step_group_size_hist": {1: 2, 2: 2},
                  "singleton_step_group_frac": 0.5, "mean_step_group_size": 1.5}


# ------------------------------------------------------------------ critic, REINFORCE++, DAPO
# traj A = samples 0, 2, 4: r = 0, 0, 1, V = .5, .6, .8 ; traj B = samples 1, 3: r = 1, 0, V = .2, .4
GAE = dict(rewards=[0, 1, 0, 0, 1], values=[.5, .2, .6, .4, .8], traj_ids=[0, 1, 0, 1, 0], gamma=0.5)


def test_gae_lambda_one_is_discounted_return_minus_value():
    # A: returns R4 = 1, R2 = .5 * 1 = .5, R0 = .5 * .5 = .25 -> minus V: -.25, -.1, .2
    # B: returns R3 = 0, R1 = 1 + .5 * 0 = 1 -> minus V: .8, -.4
    out = G.gae_advantage(**GAE, lam=1.0)
    close(out, [-.25, .8, -.1, -.4, .2])
    close(out, G.discounted_returns(GAE["rewards"], GAE["traj_ids"], .5) - np.array(GAE["values"]))


def test_gae_lambda_zero_is_td_error_and_targets():
    # delta_t = r_t + .5 V_{t+1} - V_t, V = 0 after a trajectory's last step
    # A: d0 = 0 + .3 - .5 = -.2, d2 = 0 + .4 - .6 = -.2, d4 = 1 + 0 - .8 = .2
    # B: d1 = 1 + .2 - .2 = 1, d3 = 0 + 0 - .4 = -.4
    close(G.gae_advantage(**GAE, lam=0.0), [-.2, 1, -.2, -.4, .2])
    # lam = .5 (gamma lam = .25): A4 = .2, A2 = -.2 + .25 * .2 = -.15, A0 = -.2 + .25 * -.15 = -.2375
    #                             A3 = -.4, A1 = 1 + .25 * -.4 = .9
    close(G.gae_advantage(**GAE, lam=0.5), [-.2375, .9, -.15, -.4, .2])
    # lam = 0 targets: r_t + .5 V_{t+1}: .3, 1 + .2 = 1.2, .4, 0, 1 (= A + V)
    close(G.value_targets(**GAE, lam=0.0), [.3, 1.2, .4, 0, 1])
    with pytest.raises(ValueError, match="one length"):
        G.gae_advantage([0, 1], [.5], [0, 0], .5, 1.0)


def test_batch_whiten_by_hand():
    # mean 3, deviations -2, -1, 0, 3, var (4 + 1 + 0 + 9) / 3 = 14/3, std 2.160247
    close(G.batch_whiten([1, 2, 3, 6], eps=0.0), [-.925820, -.462910, 0, 1.388730])
    close(G.batch_whiten([2, 2, 2]), [0, 0, 0], tol=0)       # tied: nothing to rank
    close(G.batch_whiten([5]), [0], tol=0)                   # one sample


def test_reinforce_pp_is_global_not_per_group():
    # one-step trajectories a, b (group 0) return 2, 0 ; c, d (group 1) return 4, 2
    # global mean 2: deviations 0, -2, 2, 0, var 8/3, std 1.632993 -> 0, -1.224745, 1.224745, 0
    # (a group baseline would give 1, -1, 1, -1)
    out = G.compute_advantages([2, 0, 4, 2], ["a", "b", "c", "d"], [0, 0, 1, 1], ["s"] * 4, [1] * 4,
                               algo="reinforce_pp", gamma=0.5)
    close(out, [0, -1.224745, 1.224745, 0])


def test_compute_advantages_reinforce_pp_on_the_example():
    # step returns (the GiGPO example below): [.25, 0, .5, -.1, 1], mean .33
    # deviations -.08, -.33, .17, -.43, .67; squares sum .778, var .1945, std .441022
    out = G.compute_advantages(**EX, **EX_KW, algo="reinforce_pp")
    close(out, [-.181397, -.748263, .385469, -.975009, 1.519200])


def test_compute_advantages_ppo_by_hand():
    # the example below, V = .5, .2, .6, .4, .8, gamma .5, lam 1: GAE = return - V
    #   traj 0 (samples 0, 2, 4): returns .25, .5, 1 -> -.25, -.1, .2 ; traj 1: 0, 0 -> -.2, -.4
    #   invalid sample 3: -.4 - .1 = -.5 -> raw [-.25, -.2, -.1, -.5, .2], mean -.17
    #   deviations -.08, -.03, .07, -.33, .37; squares sum .258, var .0645, std .253969
    out = G.compute_advantages(**EX, **EX_KW, algo="ppo", values=[.5, .2, .6, .4, .8], gae_lambda=1.0)
    close(out, [-.315000, -.118125, .275625, -1.299374, 1.456874])


def test_tied_groups():
    # group 0 all 1 (tied), group 1 = 0, 1 (kept), group 2 one sample (tied), group 3 = 3, 3 (tied)
    out = G.tied_groups([1, 1, 1, 0, 1, 2, 3, 3], [0, 0, 0, 1, 1, 2, 3, 3])
    assert out.tolist() == [True, True, True, False, False, True, True, True]
    # GiGPO's advantages: group 3 ties but its A^S ranks its two steps (kept); group 0's 1e-12 is rounding
    out = G.tied_groups([1, 1, 1, 0, 1, 2, 3, 3], [0, 0, 0, 1, 1, 2, 3, 3], adv=[0, 0, 1e-12, .5, -.5, 0, .2, -.2])
    assert out.tolist() == [True, True, True, False, False, True, False, False]
    # the same groups advantage_stats counts: 3 of 4 tied
    assert G.advantage_stats([1, 1, 1, 0, 1, 2, 3, 3], [0, 0, 0, 1, 1, 2, 3, 3], range(8))[
        "zero_var_group_frac"] == 3 / 4


def test_overlong_rewards_only_where_cut():
    # cap 4: reply 0 is 4 tokens, no EOS -> 1 - .5 ; reply 1 ends on EOS at 4 -> kept ;
    # reply 2 is short -> kept ; reply 3 is cut -> .5 - .5 = 0
    out = G.overlong_rewards([1, 1, 0, .5], [4, 4, 2, 4], [False, True, False, False], 4, 0.5)
    close(out, [.5, 1, 0, 0])


# ------------------------------------------------------------------ torch losses
def _t(x):
    return torch.tensor(x, dtype=torch.float64)


def test_policy_loss_ratio_one_is_minus_mean_adv():
    logp = _t([[-1.0, -2.0, -3.0], [-0.5, -0.7, -0.9]])
    mask = _t([[1, 1, 0], [1, 0, 0]])
    # tokens: A = 1, 1 (row 0), A = -.5 (row 1) -> pg = -A -> (-1 - 1 + .5) / 3 = -.5
    loss, st = G.policy_loss(logp, logp.clone(), _t([1.0, -0.5]), mask)
    assert loss.item() == pytest.approx(-0.5)
    assert st["clip_frac"].item() == 0.0 and st["approx_kl"].item() == 0.0
    assert not st["approx_kl"].requires_grad


def test_policy_loss_clip_binds():
    # A = 1, ratio 1.5: max(-1.5, -1.2) = -1.2 ; the clipped branch has zero gradient
    logp = torch.tensor([[math.log(1.5)]], dtype=torch.float64, requires_grad=True)
    loss, st = G.policy_loss(logp, _t([[0.0]]), _t([1.0]), _t([[1.0]]))
    assert loss.item() == pytest.approx(-1.2)
    assert st["clip_frac"].item() == 1.0
    loss.backward()
    assert logp.grad.item() == 0.0
    # A = 1, ratio .5: max(-.5, -.8) = -.5 (the pessimistic, unclipped term)
    loss, _ = G.policy_loss(_t([[math.log(0.5)]]), _t([[0.0]]), _t([1.0]), _t([[1.0]]))
    assert loss.item() == pytest.approx(-0.5)


def test_policy_loss_dual_clip_binds():
    # A = -1, ratio 5: max(5, 1.2) = 5 ; dual clip min(5, -A*3 = 3) = 3
    args = (_t([[math.log(5.0)]]), _t([[0.0]]), _t([[-1.0]]), _t([[1.0]]))
    loss, st = G.policy_loss(*args)
    assert loss.item() == pytest.approx(3.0)
    assert st["dual_clip_frac"].item() == 1.0
    loss, _ = G.policy_loss(*args, dual_clip=None)  # off -> 5
    assert loss.item() == pytest.approx(5.0)


def test_policy_loss_token_count_microbatches():
    logp = _t([[-1.0, -2.0, -3.0], [-0.5, -0.7, -0.9]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    adv = _t([1.0, -0.5])
    # ratio 1, global count 3: row 0 -> (-1 - 1)/3 = -2/3 ; row 1 -> .5/3 ; sum -.5 = full batch
    l0, _ = G.policy_loss(logp[:1], logp[:1], adv[:1], mask[:1], token_count=3)
    l1, _ = G.policy_loss(logp[1:], logp[1:], adv[1:], mask[1:], token_count=3)
    full, _ = G.policy_loss(logp, logp, adv, mask)
    assert l0.item() == pytest.approx(-2 / 3) and l1.item() == pytest.approx(0.5 / 3)
    assert (l0 + l1).item() == pytest.approx(full.item()) == pytest.approx(-0.5)


def test_policy_loss_clip_high():
    # A = 1, ratio 1.5: clip-higher .28 -> max(-1.5, -1.28) = -1.28 (symmetric .2: -1.2)
    args = (_t([[math.log(1.5)]]), _t([[0.0]]), _t([1.0]), _t([[1.0]]))
    assert G.policy_loss(*args, clip_high=0.28)[0].item() == pytest.approx(-1.28)
    assert G.policy_loss(*args)[0].item() == pytest.approx(-1.2)
    # A = -1, ratio .5: the low side stays at 1 - .2 -> max(.5, .8) = .8 either way
    args = (_t([[math.log(0.5)]]), _t([[0.0]]), _t([-1.0]), _t([[1.0]]))
    assert G.policy_loss(*args, clip_high=0.28)[0].item() == pytest.approx(0.8)


def test_gspo_sequence_ratio_by_hand():
    # seq 0: log-ratios ln 2, 0 -> s = exp(ln 2 / 2) = sqrt 2 = 1.414, A = 1:
    #        max(-1.414, -clip(1.414, .8, 1.2)) = -1.2 (clipped: no gradient)
    # seq 1: one token (ln .9; its padded slot is masked out), s = .9, A = -1: max(.9, .9) = .9
    # sequence mean (-1.2 + .9) / 2 = -.15 (a token mean would be (-1.2 - 1 + .9) / 3 = -.433)
    logp = torch.tensor([[math.log(2.0), 0.0], [math.log(0.9), 5.0]], dtype=torch.float64, requires_grad=True)
    mask = _t([[1, 1], [1, 0]])
    loss, st = G.gspo_loss(logp, torch.zeros(2, 2, dtype=torch.float64), _t([1.0, -1.0]), mask, 0.2, 0.2)
    assert loss.item() == pytest.approx(-0.15)
    assert st["clip_frac"].item() == pytest.approx(0.5)
    loss.backward()
    # d(pg_1)/d logp_10 = -A * s / |y_1| = .9, over 2 sequences = .45 ; seq 0 clipped, padding: 0
    close(logp.grad.numpy(), [[0, 0], [.45, 0]])
    # GSPO's own ranges: s = 1.414 is far outside [1 - 3e-4, 1 + 4e-4]
    loss, _ = G.gspo_loss(logp.detach()[:1], torch.zeros(1, 2, dtype=torch.float64), _t([1.0]), mask[:1])
    assert loss.item() == pytest.approx(-(1 + 4e-4))


def test_value_loss_by_hand():
    # sample 0: V .1, V_old .5, R 0: plain .01 ; V_clip = .5 - .2 = .3 -> .09 (active)
    # sample 1: V 1.2, V_old 1, R 0: plain 1.44 ; V_clip = 1.2 (inside) -> 1.44 (not active)
    # loss = .5 * (.09 + 1.44) / 2 = .3825 ; unclipped .5 * (.01 + 1.44) / 2 = .3625
    v = torch.tensor([0.1, 1.2], dtype=torch.float64, requires_grad=True)
    loss, frac = G.value_loss(v, [0.5, 1.0], [0.0, 0.0], clip=0.2)
    assert loss.item() == pytest.approx(0.3825) and frac.item() == pytest.approx(0.5)
    loss.backward()   # clipped sample 0: no gradient ; sample 1: .5 * 2 * 1.2 / 2 = .6
    close(v.grad.numpy(), [0, 0.6])
    assert G.value_loss(v, [0.5, 1.0], [0.0, 0.0], clip=0)[0].item() == pytest.approx(0.3625)


def test_value_loss_falls_on_a_fixed_batch():
    """A linear value head on fixed features, trained on its clipped loss toward fixed targets:
    the loss falls (it would rise with the sign of V - R flipped)."""
    torch.manual_seed(0)
    feats, targets = torch.randn(16, 8), torch.randn(16)
    head = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(head.parameters(), lr=0.1)
    losses = []
    for _ in range(30):
        old = head(feats).squeeze(-1).detach()
        loss, _ = G.value_loss(head(feats).squeeze(-1), old, targets, clip=0.5)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


def test_tis_weights_truncate_and_scale_the_loss():
    # trainer vs rollout log-probs: ratios e^0 = 1, e^1 = 2.72 (capped at 2), e^-1 = .37
    w, trunc = G.tis_weights(_t([[-1.0, -1.0, -2.0]]), _t([[-1.0, -2.0, -1.0]]), cap=2.0)
    close(w.numpy(), [[1.0, 2.0, math.exp(-1)]])
    assert trunc.item() == pytest.approx(1 / 3) and not w.requires_grad
    # ratio 1 (logp = old), A = 1: pg = -1 per token -> weighted mean -(1 + 2 + .37) / 3
    logp, mask = _t([[-1.0, -1.0, -2.0]]), _t([[1.0, 1.0, 1.0]])
    loss, _ = G.policy_loss(logp, logp, _t([1.0]), mask, weights=w)
    assert loss.item() == pytest.approx(-(3 + math.exp(-1)) / 3)


def test_kl_k3():
    logp = _t([-1.0, -2.0, -0.3])
    assert torch.all(G.kl_k3(logp, logp) == 0)
    # d = ref - logp = 1: e - 1 - 1 = .718282 ; d = -1: e^-1 + 1 - 1 = .367879
    # d = 30 -> clamped to 20 -> e^20 - 21 is huge -> clamped to 10
    out = G.kl_k3(_t([0.0, 0.0, 0.0]), _t([1.0, -1.0, 30.0]))
    close(out.numpy(), [0.718282, 0.367879, 10.0])
    assert torch.all(out >= 0)


def test_masked_mean_empty_mask_is_zero():
    assert G.masked_mean(_t([1.0, 2.0]), _t([0.0, 0.0])).item() == 0.0
