"""Tests for baselines.py (RLOO, GAE, REINFORCE++'s whitening, DAPO's pieces). Every expected number
is worked out by hand in a comment."""

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import baselines as B  # noqa: E402
import gigpo as G  # noqa: E402


def close(a, b, tol=1e-5):
    np.testing.assert_allclose(np.asarray(a, dtype=np.float64), b, rtol=tol, atol=tol)


def test_rloo_by_hand():
    scores, gids, tids = [1, 1, 1, 0, 5], [0, 0, 0, 0, 1], ["A", "A", "A", "B", "C"]
    # step: group 0 members 1,1,1,0 (n = 4).
    #   a "1" sample: 1 - mean(1, 1, 0) = 1 - 2/3 = 1/3 ; the "0": 0 - mean(1, 1, 1) = -1
    #   group 1 has n = 1 -> 0
    close(B.rloo_advantage(scores, gids, tids), [1 / 3] * 3 + [-1, 0])
    # traj: units A = 1, B = 0 (n = 2): A: 1 - 0 = 1 ; B: 0 - 1 = -1 ; C alone -> 0
    close(B.rloo_advantage(scores, gids, tids, stats="traj"), [1, 1, 1, -1, 0])


# traj A = samples 0, 2, 4: r = 0, 0, 1, V = .5, .6, .8 ; traj B = samples 1, 3: r = 1, 0, V = .2, .4
GAE = dict(rewards=[0, 1, 0, 0, 1], values=[0.5, 0.2, 0.6, 0.4, 0.8], traj_ids=[0, 1, 0, 1, 0], gamma=0.5)


def test_gae_lambda_one_is_discounted_return_minus_value():
    # A: returns R4 = 1, R2 = .5 * 1 = .5, R0 = .5 * .5 = .25 -> minus V: -.25, -.1, .2
    # B: returns R3 = 0, R1 = 1 + .5 * 0 = 1 -> minus V: .8, -.4
    out = B.gae_advantage(**GAE, lam=1.0)
    close(out, [-0.25, 0.8, -0.1, -0.4, 0.2])
    close(out, G.discounted_returns(GAE["rewards"], GAE["traj_ids"], 0.5) - np.array(GAE["values"]))


def test_gae_lambda_zero_is_td_error_and_targets():
    # delta_t = r_t + .5 V_{t+1} - V_t, V = 0 after a trajectory's last step
    # A: d0 = 0 + .3 - .5 = -.2, d2 = 0 + .4 - .6 = -.2, d4 = 1 + 0 - .8 = .2
    # B: d1 = 1 + .2 - .2 = 1, d3 = 0 + 0 - .4 = -.4
    close(B.gae_advantage(**GAE, lam=0.0), [-0.2, 1, -0.2, -0.4, 0.2])
    # lam = .5 (gamma lam = .25): A4 = .2, A2 = -.2 + .25 * .2 = -.15, A0 = -.2 + .25 * -.15 = -.2375
    #                             A3 = -.4, A1 = 1 + .25 * -.4 = .9
    close(B.gae_advantage(**GAE, lam=0.5), [-0.2375, 0.9, -0.15, -0.4, 0.2])
    # lam = 0 targets: r_t + .5 V_{t+1}: .3, 1 + .2 = 1.2, .4, 0, 1 (= A + V)
    close(B.value_targets(**GAE, lam=0.0), [0.3, 1.2, 0.4, 0, 1])
    with pytest.raises(ValueError, match="one length"):
        B.gae_advantage([0, 1], [0.5], [0, 0], 0.5, 1.0)


def test_batch_whiten_by_hand():
    # mean 3, deviations -2, -1, 0, 3, var (4 + 1 + 0 + 9) / 3 = 14/3, std 2.160247
    close(B.batch_whiten([1, 2, 3, 6], eps=0.0), [-0.925820, -0.462910, 0, 1.388730])
    close(B.batch_whiten([2, 2, 2]), [0, 0, 0], tol=0)  # tied: nothing to rank
    close(B.batch_whiten([5]), [0], tol=0)  # one sample


def test_tied_groups():
    # group 0 all 1 (tied), group 1 = 0, 1 (kept), group 2 one sample (tied), group 3 = 3, 3 (tied)
    out = B.tied_groups([1, 1, 1, 0, 1, 2, 3, 3], [0, 0, 0, 1, 1, 2, 3, 3])
    assert out.tolist() == [True, True, True, False, False, True, True, True]
    # dynamic sampling drops a group only where its advantages are all 0: with GiGPO's advantages group 3
    # ties but its A^S ranks its two steps (kept); group 0's 1e-12 is rounding (dropped)
    out = B.silent_groups([0, 0, 1e-12, 0.5, -0.5, 0, 0.2, -0.2], [0, 0, 0, 1, 1, 2, 3, 3])
    assert out.tolist() == [True, True, True, False, False, True, False, False]
    # the same groups advantage_stats counts: 3 of 4 tied
    assert (
        G.advantage_stats([1, 1, 1, 0, 1, 2, 3, 3], [0, 0, 0, 1, 1, 2, 3, 3], range(8))["zero_var_group_frac"]
        == 3 / 4
    )


def test_overlong_rewards_only_where_cut():
    # cap 4: reply 0 is 4 tokens, no EOS -> 1 - .5 ; reply 1 ends on EOS at 4 -> kept ;
    # reply 2 is short -> kept ; reply 3 is cut -> .5 - .5 = 0
    out = B.overlong_rewards([1, 1, 0, 0.5], [4, 4, 2, 4], [False, True, False, False], 4, 0.5)
    close(out, [0.5, 1, 0, 0])
