"""GiGPO advantages and PPO-style losses, on flat per-step arrays.

GiGPO = "Group-in-Group Policy Optimization for LLM Agent Training" (Feng et al.
2025, arXiv 2505.10978). One *sample* is one env step of one trajectory. Every
function below takes flat arrays of length N (one entry per sample), in time
order inside each trajectory; samples of different trajectories may interleave.

    group_ids  episode group: trajectories that start from the same task/state
    traj_ids   which trajectory a sample belongs to
    anchors    hashable key of the env state the step acted on (usually a str)

Advantage = A^E (episode level, Sec. 4.1) + omega * A^S (step level, Sec. 4.2).
Numpy functions compute in float64 and return float64 arrays.

Choices and departures from the paper's text:
  * Episode-level statistics are taken over step *samples* by default
    (stats="step", as the reference code does: a long trajectory weighs more);
    stats="traj" takes them over trajectories, as the paper's text reads.
  * std is the unbiased sample std (ddof=1, like torch.std).
  * An episode group with one member uses mean 0 and std 1 (A^E = score, or
    score/(1+eps)), as the reference code does; the paper does not say.
  * A step group with one member gets A^S = 0 (nothing to compare against).
  * mean_std_norm: a group whose members all tie (std <= eps) gets 0, also
    with stats="traj" where its samples still differ by the invalid-action
    penalty (dividing that by eps gave advantages of 5e4).
  * An invalid action costs `penalty` on that sample's score / step return
    only; the penalty is not discounted back to earlier steps.
"""
import difflib
from collections import Counter, defaultdict

import numpy as np
import torch

NORMS = ("mean_norm", "mean_std_norm")
STATS = ("step", "traj")
ALGOS = ("gigpo", "grpo", "rloo")


def _f64(x):
    return np.asarray(x, dtype=np.float64).reshape(-1)


def _check(name, value, options):
    if value not in options:
        raise ValueError(f"{name} must be one of {options}, got {value!r}")


def _members(group_ids, unit_ids=None):
    """Map group -> list of member keys, and sample -> its member key.

    A member is a sample (unit_ids None) or a (group, unit) pair."""
    keys = list(range(len(group_ids))) if unit_ids is None else list(zip(group_ids, unit_ids))
    group_members = defaultdict(dict)  # group -> ordered set of member keys
    for g, k in zip(group_ids, keys):
        group_members[g][k] = None
    return group_members, keys


# --------------------------------------------------------------------------- returns
def discounted_returns(rewards, traj_ids, gamma):
    """Step return R_t = r_t + gamma * R_{t+1}, i.e. sum_k gamma^k r_{t+k} (Sec. 4.2).

    rewards: (N,) floats; traj_ids: (N,) hashable. Returns (N,) float64.
    Computed backwards per trajectory; a trajectory's last step has R = r.
    """
    r = _f64(rewards)
    out = np.zeros_like(r)
    running = {}  # traj -> return of the step after the current one
    for i in range(len(r) - 1, -1, -1):
        t = traj_ids[i]
        out[i] = r[i] + gamma * running.get(t, 0.0)
        running[t] = out[i]
    return out


def episode_scores(rewards, traj_ids, valid, penalty):
    """score_i = sum_{j in traj(i)} r_j - penalty * (1 - v_i)   (R(tau) of Sec. 4.1).

    The episode return is the undiscounted reward sum of sample i's trajectory;
    the invalid-action penalty is per sample. valid: (N,) bool or 0/1.
    Returns (N,) float64.
    """
    r, v = _f64(rewards), _f64(valid)
    total = defaultdict(float)
    for t, x in zip(traj_ids, r):
        total[t] += x
    ret = np.array([total[t] for t in traj_ids], dtype=np.float64)
    return ret - penalty * (1.0 - v)


def step_returns(rewards, traj_ids, valid, gamma, penalty):
    """R_i - penalty * (1 - v_i), R = discounted_returns (Sec. 4.2).

    The penalty is applied to the sample itself and not discounted back.
    Returns (N,) float64.
    """
    return discounted_returns(rewards, traj_ids, gamma) - penalty * (1.0 - _f64(valid))


# --------------------------------------------------------------------------- group statistics
def group_stats_normalize(values, group_ids, norm, unit_ids=None, eps=1e-6):
    """A_i = x_i - mean_g                 (norm="mean_norm")
       A_i = (x_i - mean_g) / (std_g + eps) (norm="mean_std_norm")

    values, group_ids: (N,). mean_g / std_g are over the members of group g:
      * unit_ids None: each sample is a member;
      * unit_ids given (e.g. traj_ids): each unit counts once with value = the
        mean of its samples' values; sample i still uses its own x_i.
    std is unbiased (ddof=1). A group with a single member uses mean 0, std 1
    (A = x, or x / (1 + eps)). A group whose members all tie (std_g <= eps)
    gives A = 0 under mean_std_norm: nothing ranks them, and with unit_ids a
    sample may still differ from its tied unit's mean (by the invalid-action
    penalty), which (x - mean_g) / eps would blow up. mean_norm keeps x - mean_g.
    Returns (N,) float64. Raises ValueError on an unknown norm.
    """
    _check("norm", norm, NORMS)
    x = _f64(values)
    group_members, keys = _members(group_ids, unit_ids)
    sums, counts = defaultdict(float), Counter()
    for k, xi in zip(keys, x):
        sums[k] += xi
        counts[k] += 1
    mean, std = {}, {}
    for g, members in group_members.items():
        u = np.array([sums[k] / counts[k] for k in members])
        if len(u) == 1:
            mean[g], std[g] = 0.0, 1.0
        else:
            mean[g], std[g] = u.mean(), u.std(ddof=1)
    m = np.array([mean[g] for g in group_ids], dtype=np.float64)
    if norm == "mean_norm":
        return x - m
    s = np.array([std[g] for g in group_ids], dtype=np.float64)
    tied = s <= eps
    return np.where(tied, 0.0, (x - m) / np.where(tied, 1.0, s + eps))


def episode_advantage(scores, group_ids, traj_ids, norm="mean_std_norm", stats="step"):
    """Episode relative advantage (Sec. 4.1):
       A^E(tau_i) = (R(tau_i) - mean_g) / F_norm,  F_norm = std_g or 1.

    scores, group_ids, traj_ids: (N,). stats="step": statistics over all step
    samples of the group; stats="traj": over trajectories (one value each).
    Edge cases as group_stats_normalize. Returns (N,) float64.
    """
    _check("stats", stats, STATS)
    units = traj_ids if stats == "traj" else None
    return group_stats_normalize(scores, group_ids, norm, unit_ids=units)


def rloo_advantage(scores, group_ids, traj_ids, stats="step"):
    """Leave-one-out: A_i = (x_i - mean_g) * n / (n - 1)  (= x_i - mean of the others).

    n = number of members of group g (samples, or trajectories for stats="traj",
    a trajectory's value being the mean of its samples). Groups with n == 1
    get A = 0. Returns (N,) float64.
    """
    _check("stats", stats, STATS)
    units = traj_ids if stats == "traj" else None
    group_members, _ = _members(group_ids, units)
    n = np.array([len(group_members[g]) for g in group_ids], dtype=np.float64)
    centred = group_stats_normalize(scores, group_ids, "mean_norm", unit_ids=units)
    return np.where(n > 1, centred * n / np.maximum(n - 1.0, 1.0), 0.0)


# --------------------------------------------------------------------------- step groups
def step_groups(anchors, group_ids, similarity=None):
    """Anchor-state step groups (Sec. 4.2):
       G^S(s~) = {i : group(i) = g, anchor_i = s~}, one group per (g, s~).

    anchors: (N,) hashable; group_ids: (N,). Equal anchors inside one episode
    group share a step group, repeat visits inside one trajectory included;
    equal anchors in different episode groups stay apart.
    similarity in (0, 1] (optional, anchors must be str): a sample joins the
    first step group of its episode group whose first member's anchor has
    difflib.SequenceMatcher(None, a, b).ratio() >= similarity, else opens a
    new one. Cost O(N * step groups); exact matching (None) is O(N).
    Returns (N,) int64 dense ids 0..K-1 in first-appearance order.
    """
    ids = np.zeros(len(anchors), dtype=np.int64)
    if similarity is None:
        seen = {}
        for i, (g, a) in enumerate(zip(group_ids, anchors)):
            ids[i] = seen.setdefault((g, a), len(seen))
        return ids
    if not 0.0 < similarity <= 1.0:
        raise ValueError(f"similarity must be in (0, 1], got {similarity}")
    reps = defaultdict(list)  # episode group -> [(representative anchor, id)]
    n_groups = 0
    for i, (g, a) in enumerate(zip(group_ids, anchors)):
        if not isinstance(a, str):
            raise TypeError(f"similarity grouping needs str anchors, sample {i} is {type(a)}")
        for rep, k in reps[g]:
            if rep == a or difflib.SequenceMatcher(None, a, rep).ratio() >= similarity:
                ids[i] = k
                break
        else:
            reps[g].append((a, n_groups))
            ids[i] = n_groups
            n_groups += 1
    return ids


def step_advantage(step_rets, step_group_ids, norm="mean_std_norm", eps=1e-6):
    """Step relative advantage (Sec. 4.2):
       A^S_i = (R_i - mean_s) / F_norm,  F_norm = std_s (ddof=1) + eps or 1,

    over the members of sample i's step group s. step_rets, step_group_ids: (N,).
    A step group of size 1 gets A^S = 0 (unlike episode groups).
    Returns (N,) float64.
    """
    adv = group_stats_normalize(step_rets, step_group_ids, norm, eps=eps)
    size = Counter(list(step_group_ids))
    return np.where([size[s] > 1 for s in step_group_ids], adv, 0.0)


# --------------------------------------------------------------------------- the one call
def compute_advantages(rewards, traj_ids, group_ids, anchors, valid, *, algo="gigpo",
                       gamma=0.95, omega=1.0, penalty=0.1, norm="mean_std_norm",
                       stats="step", similarity=None):
    """One advantage per sample.

      gigpo: A = A^E + omega * A^S   (Sec. 4.2, combined advantage)
      grpo:  A = A^E                 (= gigpo with omega = 0)
      rloo:  A = leave-one-out on the episode scores

    All inputs (N,). A^E uses episode_scores, A^S uses step_returns and
    step_groups; under mean_std_norm a group whose members all tie adds 0
    (group_stats_normalize). Empty input -> empty array. Raises ValueError on unequal
    lengths, a NaN/inf reward, a trajectory spread over two episode groups,
    or an unknown algo/norm/stats. Returns (N,) float64, always finite.
    """
    arrays = dict(rewards=rewards, traj_ids=traj_ids, group_ids=group_ids,
                  anchors=anchors, valid=valid)
    lengths = {k: len(v) for k, v in arrays.items()}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"all inputs must have the same length, got {lengths}")
    _check("algo", algo, ALGOS)
    _check("norm", norm, NORMS)
    _check("stats", stats, STATS)
    r = _f64(rewards)
    bad = np.flatnonzero(~np.isfinite(r))
    if bad.size:
        raise ValueError(f"NaN/inf reward at sample {bad[0]} (value {r[bad[0]]}); "
                         f"{bad.size} bad sample(s) in total")
    if len(r) == 0:
        return np.zeros(0, dtype=np.float64)
    home = {}
    for t, g in zip(traj_ids, group_ids):
        if home.setdefault(t, g) != g:
            raise ValueError(f"trajectory {t!r} appears in episode groups {home[t]!r} and {g!r}")

    scores = episode_scores(r, traj_ids, valid, penalty)
    if algo == "rloo":
        return rloo_advantage(scores, group_ids, traj_ids, stats=stats)
    adv = episode_advantage(scores, group_ids, traj_ids, norm=norm, stats=stats)
    if algo == "gigpo" and omega != 0:
        rets = step_returns(r, traj_ids, valid, gamma, penalty)
        adv = adv + omega * step_advantage(rets, step_groups(anchors, group_ids, similarity), norm)
    return adv


def advantage_stats(scores, group_ids, step_group_ids):
    """Diagnostics of the grouping, as plain python numbers:

      zero_var_group_frac       share of episode groups whose scores are all equal
      step_group_size_hist      {size: number of step groups of that size}
      singleton_step_group_frac share of step groups of size 1
      mean_step_group_size      N / number of step groups

    Empty input gives zeros and an empty histogram.
    """
    x = _f64(scores)
    by_group = defaultdict(list)
    for g, xi in zip(group_ids, x):
        by_group[g].append(xi)
    sizes = list(Counter(list(step_group_ids)).values())
    n_groups, n_steps = len(by_group), len(sizes)
    zero_var = sum(max(v) == min(v) for v in by_group.values())
    return {
        "zero_var_group_frac": zero_var / n_groups if n_groups else 0.0,
        "step_group_size_hist": dict(sorted(Counter(sizes).items())),
        "singleton_step_group_frac": sizes.count(1) / n_steps if n_steps else 0.0,
        "mean_step_group_size": len(x) / n_steps if n_steps else 0.0,
    }


# --------------------------------------------------------------------------- torch losses
def masked_mean(x, mask, count=None):
    """sum(x * mask) / count, count defaulting to mask.sum() (clamped to >= 1,
    so an all-zero mask gives 0, not NaN). x, mask: same shape; returns a 0-d tensor."""
    mask = mask.to(x.dtype)
    if count is None:
        count = mask.sum().clamp(min=1.0)
    return (x * mask).sum() / count


def policy_loss(logp, old_logp, adv, mask, clip=0.2, dual_clip=3.0, token_count=None, weights=None):
    """PPO clipped surrogate with dual clip, token-mean (paper's objective, Sec. 4.2):

      ratio = exp(logp - old_logp)        (log-ratio clamped to [-20, 20])
      pg    = max(-A * ratio, -A * clip(ratio, 1 - clip, 1 + clip))
      pg    = min(pg, -A * dual_clip)      where A < 0 (dual_clip None: off)
      loss  = sum(w * pg * mask) / token_count (default mask.sum())

    w: per-token weights (e.g. tis_weights), 1 by default.

    logp, old_logp, mask: (B, T); adv: (B,) broadcast over tokens, or (B, T).
    Pass a global token_count so that micro-batch losses add up to the
    mini-batch token mean. Returns (loss, stats) with stats detached 0-d
    tensors over this call's tokens: clip_frac (clipped term is the active
    one), dual_clip_frac, approx_kl = mean(old_logp - logp).
    """
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 or None, got {dual_clip}")
    adv = torch.as_tensor(adv, dtype=logp.dtype, device=logp.device)
    if adv.dim() == 1:
        adv = adv.unsqueeze(-1)
    log_ratio = (logp - old_logp).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    pg_plain = -adv * ratio
    pg_clip = -adv * ratio.clamp(1.0 - clip, 1.0 + clip)
    pg = torch.maximum(pg_plain, pg_clip)
    dual = torch.zeros_like(pg, dtype=torch.bool)
    if dual_clip is not None:
        cap = -adv * dual_clip
        dual = (adv < 0) & (pg > cap)
        pg = torch.where(dual, cap.expand_as(pg), pg)
    loss = masked_mean(pg if weights is None else weights * pg, mask, token_count)
    with torch.no_grad():
        stats = {
            "clip_frac": masked_mean((pg_clip > pg_plain).to(logp.dtype), mask),
            "dual_clip_frac": masked_mean(dual.to(logp.dtype), mask),
            "approx_kl": masked_mean(old_logp - logp, mask),
        }
    return loss, {k: v.detach() for k, v in stats.items()}


def tis_weights(old_logp, rollout_logp, cap):
    """Truncated importance sampling (Yao et al. 2025, "off-policy" rollouts of a fast engine):

      w = min(exp(old_logp - rollout_logp), cap)      per token, no gradient

    The engine samples from pi_rollout, which differs from the trainer's pi_old by kernel and
    precision noise (logp_gap); multiplying each token's policy-gradient term by w corrects the
    mismatch, and the cap bounds the variance a rare large ratio would add. Returns (w, share of
    tokens where the cap bit)."""
    ratio = torch.exp((old_logp - rollout_logp).clamp(-20.0, 20.0))
    return ratio.clamp(max=cap).detach(), (ratio > cap).float().mean()


def kl_k3(logp, ref_logp):
    """Per-token k3 ("low_var_kl") estimate of KL(pi || pi_ref):

      d = clamp(ref_logp - logp, -20, 20);  k3 = clamp(exp(d) - d - 1, -10, 10)

    Same shape as the inputs; always >= 0 (exp(d) >= 1 + d).
    """
    d = (ref_logp - logp).clamp(-20.0, 20.0)
    return (torch.exp(d) - d - 1.0).clamp(-10.0, 10.0)
