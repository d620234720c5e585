"""The baselines' equations beside GiGPO (gigpo.py registers them as estimators), numpy only.

RLOO's leave-one-out baseline (Ahmadian et al. 2024, arXiv 2402.14740), PPO with a learned critic
and GAE (Schulman et al. 2017, arXiv 1707.06347; 2016, arXiv 1506.02438), REINFORCE++'s batch
normalisation (Hu 2025, arXiv 2501.03262), and DAPO's batch shaping (Yu et al. 2025, arXiv
2503.14476): the overlong penalty and dynamic sampling. Flat arrays of length N, one entry per
step sample, each trajectory's samples in time order (trajectories may interleave), as in gigpo.py.
Computed in float64. This file imports nothing of the project: gigpo.py imports it.
"""

from collections import defaultdict

import numpy as np


def _f64(x):
    return np.asarray(x, dtype=np.float64).reshape(-1)


# --------------------------------------------------------------------------- RLOO
def rloo_advantage(scores, group_ids, traj_ids, stats="step"):
    """Leave-one-out: A_i = (x_i - mean_g) * n / (n - 1)  (= x_i - mean of the others).

    n = number of members of group g (samples, or trajectories for stats="traj",
    a trajectory's value being R(tau), the largest of its samples' scores, as in
    gigpo.episode_advantage). Groups with n == 1 get A = 0. Returns (N,) float64.
    """
    if stats not in ("step", "traj"):
        raise ValueError(f"stats must be one of ('step', 'traj'), got {stats!r}")
    x = _f64(scores)
    keys = list(range(len(x))) if stats == "step" else list(zip(group_ids, traj_ids))
    value, home = {}, {}  # a member's value (its largest sample score) and its group
    for k, g, xi in zip(keys, group_ids, x):
        value[k], home[k] = max(value.get(k, xi), xi), g
    members = defaultdict(list)
    for k, v in value.items():
        members[home[k]].append(v)
    n = np.array([len(members[g]) for g in group_ids], dtype=np.float64)
    mean = np.array([np.mean(members[g]) if len(members[g]) > 1 else 0.0 for g in group_ids])
    return np.where(n > 1, (x - mean) * n / np.maximum(n - 1.0, 1.0), 0.0)


# --------------------------------------------------------------------------- a critic; batch statistics
def gae_advantage(rewards, values, traj_ids, gamma, lam):
    """Generalized advantage estimation over the env steps of each trajectory (Schulman et al. 2016,
    arXiv 1506.02438, eq. 16; PPO, Schulman et al. 2017, eq. 11-12):

      delta_t = r_t + gamma * V(s_{t+1}) - V(s_t)
      A_t     = delta_t + gamma * lam * A_{t+1}          (= sum_k (gamma lam)^k delta_{t+k})

    rewards, values, traj_ids: (N,), each trajectory's samples in time order (trajectories may
    interleave). lam = 1: A_t = discounted_returns - V(s_t); lam = 0: A_t = delta_t. A trajectory's
    last step bootstraps from V = 0 whether it terminated or was cut at max_steps: the other
    estimators' returns end there too (the treasure hunt shows no step counter, so a cut is a small
    bias either way). Raises ValueError on unequal lengths. Returns (N,) float64.
    """
    r, v = _f64(rewards), _f64(values)
    if len(v) != len(r) or len(traj_ids) != len(r):
        raise ValueError(
            f"rewards, values and traj_ids must have one length, got {len(r)}, {len(v)}, {len(traj_ids)}"
        )
    out = np.zeros_like(r)
    after = {}  # traj -> (V, A) of the step after the current one
    for i in range(len(r) - 1, -1, -1):
        v_next, a_next = after.get(traj_ids[i], (0.0, 0.0))
        out[i] = r[i] + gamma * v_next - v[i] + gamma * lam * a_next
        after[traj_ids[i]] = (v[i], out[i])
    return out


def value_targets(rewards, values, traj_ids, gamma, lam):
    """The critic's regression targets, the lambda-returns (Schulman et al. 2016, Sec. 5):

      R_t = A^GAE_t + V(s_t)      (lam = 1: the discounted return; lam = 0: r_t + gamma V(s_{t+1}))

    (N,) -> (N,) float64. The ppo estimator (gigpo.py) passes the env rewards (with DAPO's overlong
    penalty, if on) but not the invalid-action penalty, which shapes the sample's advantage only.
    """
    return gae_advantage(rewards, values, traj_ids, gamma, lam) + _f64(values)


def batch_whiten(x, eps=1e-6):
    """Normalisation over the whole batch, no per-group baseline:

      A_i = (x_i - mean) / (std + eps),   mean, std (unbiased) over all N samples

    REINFORCE++ (Hu 2025, arXiv 2501.03262, Sec. 3: the discounted returns, normalised over the
    global batch) and PPO's advantage normalisation (Schulman et al. 2017; OpenAI baselines and
    verl whiten the GAE advantages). Each step sample counts once (verl whitens over response
    tokens: the same with one-token replies). N <= 1, or all values tied (std <= eps): zeros,
    as a tied group under mean_std_norm. (N,) -> (N,) float64.
    """
    x = _f64(x)
    if len(x) < 2 or x.std(ddof=1) <= eps:
        return np.zeros_like(x)
    return (x - x.mean()) / (x.std(ddof=1) + eps)


# --------------------------------------------------------------------------- DAPO's batch shaping
def tied_groups(scores, group_ids):
    """Episode groups whose outcomes do not differ, the complement of DAPO's keep rule (Yu et al.
    2025, arXiv 2503.14476, eq. 11):  0 < |{i in g : o_i correct}| < G,  i.e. std_g > 0.

    scores, group_ids: (N,). Returns (N,) bool: True for every sample of a group whose scores all
    tie (max == min; a one-sample group ties): the groups gigpo.advantage_stats' zero_var_group_frac
    counts.
    """
    x = _f64(scores)
    lo, hi = {}, {}
    for g, xi in zip(group_ids, x):
        lo[g], hi[g] = min(lo.get(g, xi), xi), max(hi.get(g, xi), xi)
    return np.array([lo[g] == hi[g] for g in group_ids], dtype=bool)


def silent_groups(adv, group_ids, tol=1e-9):
    """DAPO's dynamic sampling (Yu et al. 2025, eq. 11) drops the groups that give no gradient:

      drop g  iff  |A_i| <= tol  for every sample i of g

    adv, group_ids: (N,); returns (N,) bool, True for every sample of a dropped group. DAPO states
    the rule on outcomes (a group whose outcomes all tie), which is the same thing for a group
    baseline that only ranks the group's scores (GRPO, RLOO). It is not for the others, so the rule
    reads the advantages themselves: GiGPO's A^S still ranks the steps of a tied group (all won, some
    faster); ppo and reinforce_pp have no group baseline, and a tied group's samples get non-zero
    (whitened) advantages. tol absorbs rounding (a tied group's x - mean can be 1e-17). DAPO then
    samples more groups until the batch is full; train.py only drops them.
    """
    a = np.abs(_f64(adv))
    speaks = {g for g, x in zip(group_ids, a) if x > tol}
    return np.array([g not in speaks for g in group_ids], dtype=bool)


def overlong_rewards(rewards, response_lengths, ended, max_tokens, penalty):
    """DAPO's overlong punishment (Yu et al. 2025, arXiv 2503.14476, eq. 13), its hard form, only
    where a reply hits the length cap:

      r_i - penalty   if len_i >= max_tokens and reply i did not end (no EOS): cut at the cap
      r_i             otherwise (a reply ending on EOS at exactly max_tokens is not cut)

    DAPO's soft ramp (a penalty growing over the last L_cache tokens before the cap) is not
    implemented. It enters the step's reward, so episode scores and step returns see it. The tiny
    model's one-token replies never reach EOS: every one counts as cut (leave train.OVERLONG_PENALTY 0).
    rewards, response_lengths, ended: (N,). Returns (N,) float64.
    """
    cut = (np.asarray(response_lengths) >= max_tokens) & ~np.asarray(ended, dtype=bool)
    return _f64(rewards) - penalty * cut
