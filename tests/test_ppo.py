"""Tests for ppo.py's torch losses (the clipped surrogate, GSPO, the value loss, TIS weights, k3 KL).
Every expected number is worked out by hand in a comment."""

import math
import os
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ppo as P  # noqa: E402


def close(a, b, tol=1e-5):
    np.testing.assert_allclose(np.asarray(a, dtype=np.float64), b, rtol=tol, atol=tol)


def _t(x):
    return torch.tensor(x, dtype=torch.float64)


def test_policy_loss_ratio_one_is_minus_mean_adv():
    logp = _t([[-1.0, -2.0, -3.0], [-0.5, -0.7, -0.9]])
    mask = _t([[1, 1, 0], [1, 0, 0]])
    # tokens: A = 1, 1 (row 0), A = -.5 (row 1) -> pg = -A -> (-1 - 1 + .5) / 3 = -.5
    loss, st = P.policy_loss(logp, logp.clone(), _t([1.0, -0.5]), mask)
    assert loss.item() == pytest.approx(-0.5)
    assert st["clip_frac"].item() == 0.0 and st["approx_kl"].item() == 0.0
    assert not st["approx_kl"].requires_grad


def test_policy_loss_clip_binds():
    # A = 1, ratio 1.5: max(-1.5, -1.2) = -1.2 ; the clipped branch has zero gradient
    logp = torch.tensor([[math.log(1.5)]], dtype=torch.float64, requires_grad=True)
    loss, st = P.policy_loss(logp, _t([[0.0]]), _t([1.0]), _t([[1.0]]))
    assert loss.item() == pytest.approx(-1.2)
    assert st["clip_frac"].item() == 1.0
    loss.backward()
    assert logp.grad.item() == 0.0
    # A = 1, ratio .5: max(-.5, -.8) = -.5 (the pessimistic, unclipped term)
    loss, _ = P.policy_loss(_t([[math.log(0.5)]]), _t([[0.0]]), _t([1.0]), _t([[1.0]]))
    assert loss.item() == pytest.approx(-0.5)


def test_policy_loss_dual_clip_binds():
    # A = -1, ratio 5: max(5, 1.2) = 5 ; dual clip min(5, -A*3 = 3) = 3
    args = (_t([[math.log(5.0)]]), _t([[0.0]]), _t([[-1.0]]), _t([[1.0]]))
    loss, st = P.policy_loss(*args)
    assert loss.item() == pytest.approx(3.0)
    assert st["dual_clip_frac"].item() == 1.0
    loss, _ = P.policy_loss(*args, dual_clip=None)  # off -> 5
    assert loss.item() == pytest.approx(5.0)


def test_policy_loss_token_count_microbatches():
    logp = _t([[-1.0, -2.0, -3.0], [-0.5, -0.7, -0.9]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    adv = _t([1.0, -0.5])
    # ratio 1, global count 3: row 0 -> (-1 - 1)/3 = -2/3 ; row 1 -> .5/3 ; sum -.5 = full batch
    l0, _ = P.policy_loss(logp[:1], logp[:1], adv[:1], mask[:1], token_count=3)
    l1, _ = P.policy_loss(logp[1:], logp[1:], adv[1:], mask[1:], token_count=3)
    full, _ = P.policy_loss(logp, logp, adv, mask)
    assert l0.item() == pytest.approx(-2 / 3) and l1.item() == pytest.approx(0.5 / 3)
    assert (l0 + l1).item() == pytest.approx(full.item()) == pytest.approx(-0.5)


def test_policy_loss_clip_high():
    # A = 1, ratio 1.5: clip-higher .28 -> max(-1.5, -1.28) = -1.28 (symmetric .2: -1.2)
    args = (_t([[math.log(1.5)]]), _t([[0.0]]), _t([1.0]), _t([[1.0]]))
    assert P.policy_loss(*args, clip_high=0.28)[0].item() == pytest.approx(-1.28)
    assert P.policy_loss(*args)[0].item() == pytest.approx(-1.2)
    # A = -1, ratio .5: the low side stays at 1 - .2 -> max(.5, .8) = .8 either way
    args = (_t([[math.log(0.5)]]), _t([[0.0]]), _t([-1.0]), _t([[1.0]]))
    assert P.policy_loss(*args, clip_high=0.28)[0].item() == pytest.approx(0.8)


def test_gspo_sequence_ratio_by_hand():
    # seq 0: log-ratios ln 2, 0 -> s = exp(ln 2 / 2) = sqrt 2 = 1.414, A = 1:
    #        max(-1.414, -clip(1.414, .8, 1.2)) = -1.2 (clipped: no gradient)
    # seq 1: one token (ln .9; its padded slot is masked out), s = .9, A = -1: max(.9, .9) = .9
    # sequence mean (-1.2 + .9) / 2 = -.15 (a token mean would be (-1.2 - 1 + .9) / 3 = -.433)
    logp = torch.tensor([[math.log(2.0), 0.0], [math.log(0.9), 5.0]], dtype=torch.float64, requires_grad=True)
    mask = _t([[1, 1], [1, 0]])
    loss, st = P.gspo_loss(logp, torch.zeros(2, 2, dtype=torch.float64), _t([1.0, -1.0]), mask, 0.2, 0.2)
    assert loss.item() == pytest.approx(-0.15)
    assert st["clip_frac"].item() == pytest.approx(0.5)
    loss.backward()
    # d(pg_1)/d logp_10 = -A * s / |y_1| = .9, over 2 sequences = .45 ; seq 0 clipped, padding: 0
    close(logp.grad.numpy(), [[0, 0], [0.45, 0]])
    # GSPO's own ranges: s = 1.414 is far outside [1 - 3e-4, 1 + 4e-4]
    loss, _ = P.gspo_loss(logp.detach()[:1], torch.zeros(1, 2, dtype=torch.float64), _t([1.0]), mask[:1])
    assert loss.item() == pytest.approx(-(1 + 4e-4))


def test_value_loss_by_hand():
    # sample 0: V .1, V_old .5, R 0: plain .01 ; V_clip = .5 - .2 = .3 -> .09 (active)
    # sample 1: V 1.2, V_old 1, R 0: plain 1.44 ; V_clip = 1.2 (inside) -> 1.44 (not active)
    # loss = .5 * (.09 + 1.44) / 2 = .3825 ; unclipped .5 * (.01 + 1.44) / 2 = .3625
    v = torch.tensor([0.1, 1.2], dtype=torch.float64, requires_grad=True)
    loss, frac = P.value_loss(v, [0.5, 1.0], [0.0, 0.0], clip=0.2)
    assert loss.item() == pytest.approx(0.3825) and frac.item() == pytest.approx(0.5)
    loss.backward()  # clipped sample 0: no gradient ; sample 1: .5 * 2 * 1.2 / 2 = .6
    close(v.grad.numpy(), [0, 0.6])
    assert P.value_loss(v, [0.5, 1.0], [0.0, 0.0], clip=0)[0].item() == pytest.approx(0.3625)


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
        loss, _ = P.value_loss(head(feats).squeeze(-1), old, targets, clip=0.5)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


def test_tis_weights_truncate_and_scale_the_loss():
    # trainer vs rollout log-probs: ratios e^0 = 1, e^1 = 2.72 (capped at 2), e^-1 = .37
    w, trunc = P.tis_weights(_t([[-1.0, -1.0, -2.0]]), _t([[-1.0, -2.0, -1.0]]), cap=2.0)
    close(w.numpy(), [[1.0, 2.0, math.exp(-1)]])
    assert trunc.item() == pytest.approx(1 / 3) and not w.requires_grad
    # ratio 1 (logp = old), A = 1: pg = -1 per token -> weighted mean -(1 + 2 + .37) / 3
    logp, mask = _t([[-1.0, -1.0, -2.0]]), _t([[1.0, 1.0, 1.0]])
    loss, _ = P.policy_loss(logp, logp, _t([1.0]), mask, weights=w)
    assert loss.item() == pytest.approx(-(3 + math.exp(-1)) / 3)


def test_kl_k3():
    logp = _t([-1.0, -2.0, -0.3])
    assert torch.all(P.kl_k3(logp, logp) == 0)
    # d = ref - logp = 1: e - 1 - 1 = .718282 ; d = -1: e^-1 + 1 - 1 = .367879
    # d = 30 -> clamped to 20 -> e^20 - 21 is huge -> clamped to 10
    out = P.kl_k3(_t([0.0, 0.0, 0.0]), _t([1.0, -1.0, 30.0]))
    close(out.numpy(), [0.718282, 0.367879, 10.0])
    assert torch.all(out >= 0)


def test_masked_mean_empty_mask_is_zero():
    assert P.masked_mean(_t([1.0, 2.0]), _t([0.0, 0.0])).item() == 0.0
