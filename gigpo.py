"""GiGPO advantages, its baselines' advantages, and PPO-style losses, on flat per-step arrays.

GiGPO = "Group-in-Group Policy Optimization for LLM Agent Training" (Feng et al.
2025, arXiv 2505.10978). Its baselines and verl-agent's other estimators: PPO
with a learned critic and GAE (Schulman et al. 2017, arXiv 1707.06347; 2016,
arXiv 1506.02438), REINFORCE++ (Hu 2025, arXiv 2501.03262), DAPO's pieces (Yu
et al. 2025, arXiv 2503.14476), GSPO's sequence ratio (Zheng et al. 2025, arXiv
2507.18071). One *sample* is one env step of one trajectory. Every
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
  * mean_std_norm: a group whose members all tie (std <= eps) gets 0.
  * stats="traj": a trajectory's value is R(tau), the largest of its samples'
    scores (the penalty only lowers invalid samples'; R - penalty where every
    step was invalid). With the mean of its samples instead, two lost walks of
    49 and 50 steps with one invalid action each nearly tie (std 3e-5), and
    their samples got advantages of -3281.
  * An invalid action costs `penalty` on that sample's score / step return
    only; the penalty is not discounted back to earlier steps.
"""
import difflib
from collections import Counter, defaultdict

import numpy as np
import torch

NORMS = ("mean_norm", "mean_std_norm")
STATS = ("step", "traj")
ALGOS = ("gigpo", "grpo", "rloo", "ppo", "reinforce_pp")
BATCH_ALGOS = ("ppo", "reinforce_pp")   # statistics over the whole batch, no episode groups
LOSSES = ("ppo", "gspo")                # token ratio (policy_loss) | sequence ratio (gspo_loss)


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


# --------------------------------------------------------------------------- a learned critic, whole-batch statistics
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
        raise ValueError(f"rewards, values and traj_ids must have one length, got {len(r)}, {len(v)}, "
                         f"{len(traj_ids)}")
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

    (N,) -> (N,) float64. train.py passes the env rewards (with DAPO's overlong penalty, if on)
    but not the invalid-action penalty, which shapes the sample's advantage only (compute_advantages).
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


# --------------------------------------------------------------------------- group statistics
def group_stats_normalize(values, group_ids, norm, unit_ids=None, eps=1e-6):
    """A_i = x_i - mean_g                 (norm="mean_norm")
       A_i = (x_i - mean_g) / (std_g + eps) (norm="mean_std_norm")

    values, group_ids: (N,). mean_g / std_g are over the members of group g:
      * unit_ids None: each sample is a member;
      * unit_ids given (e.g. traj_ids): each unit counts once with value = the
        largest of its samples' values (for episode scores R(tau): the penalty
        only lowers a sample's); sample i still uses its own x_i.
    std is unbiased (ddof=1). A group with a single member uses mean 0, std 1
    (A = x, or x / (1 + eps)). A group whose members all tie (std_g <= eps)
    gives A = 0 under mean_std_norm: nothing ranks them, and with unit_ids a
    sample may still differ from its tied unit's value (by the invalid-action
    penalty), which (x - mean_g) / eps would blow up. mean_norm keeps x - mean_g.
    Returns (N,) float64. Raises ValueError on an unknown norm.
    """
    _check("norm", norm, NORMS)
    x = _f64(values)
    group_members, keys = _members(group_ids, unit_ids)
    unit = {}   # a unit's value: its largest sample value (a sample is its own unit by default)
    for k, xi in zip(keys, x):
        unit[k] = max(unit.get(k, xi), xi)
    mean, std = {}, {}
    for g, members in group_members.items():
        u = np.array([unit[k] for k in members])
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
    a trajectory's value being R(tau), as in episode_advantage). Groups with n == 1
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


def step_parts(rewards, traj_ids, group_ids, anchors, valid, *, gamma, penalty, norm, similarity=None,
               tied_step=True):
    """GiGPO's step term, for compute_advantages and for the log (records.advantage_parts):
    -> (step returns, step group ids, A^S). tied_step=False, an ablation: A^S = 0 in episode
    groups whose scores all tie (tied_groups: all won, all lost), so A^S acts only where A^E does."""
    rets = step_returns(rewards, traj_ids, valid, gamma, penalty)
    sg = step_groups(anchors, group_ids, similarity)
    a_s = step_advantage(rets, sg, norm)
    if not tied_step:
        a_s = np.where(tied_groups(episode_scores(rewards, traj_ids, valid, penalty), group_ids), 0.0, a_s)
    return rets, sg, a_s


# --------------------------------------------------------------------------- DAPO's batch shaping
def tied_groups(scores, group_ids, adv=None):
    """DAPO's dynamic sampling (Yu et al. 2025, arXiv 2503.14476, eq. 11) keeps an episode group
    only where its outcomes differ:  0 < |{i in g : o_i correct}| < G,  i.e. std_g > 0.

    scores, group_ids: (N,). Returns (N,) bool: True for every sample of a group whose scores all
    tie (max == min: the groups advantage_stats' zero_var_group_frac counts); a one-sample group
    ties. DAPO then samples more groups until the batch is full; train.py only drops them.
    adv (N,), GiGPO's final advantages: a tied group where any |A| > 1e-9 is kept, not dropped (its
    A^E is 0 but A^S still ranks its steps: all won, some faster), as DAPO drops only what gives no
    gradient.
    """
    x = _f64(scores)
    lo, hi = {}, {}
    for g, xi in zip(group_ids, x):
        lo[g], hi[g] = min(lo.get(g, xi), xi), max(hi.get(g, xi), xi)
    speaks = set() if adv is None else {g for g, a in zip(group_ids, np.abs(_f64(adv))) if a > 1e-9}
    return np.array([lo[g] == hi[g] and g not in speaks for g in group_ids], dtype=bool)


def overlong_rewards(rewards, response_lengths, ended, max_tokens, penalty):
    """DAPO's overlong punishment (Yu et al. 2025, arXiv 2503.14476, eq. 13), its hard form, only
    where a reply hits the length cap:

      r_i - penalty   if len_i >= max_tokens and reply i did not end (no EOS): cut at the cap
      r_i             otherwise (a reply ending on EOS at exactly max_tokens is not cut)

    DAPO's soft ramp (a penalty growing over the last L_cache tokens before the cap) is not
    implemented. It enters the step's reward, so episode scores and step returns see it. The tiny
    model's one-token replies never reach EOS: every one counts as cut (leave --overlong_penalty 0).
    rewards, response_lengths, ended: (N,). Returns (N,) float64.
    """
    cut = (np.asarray(response_lengths) >= max_tokens) & ~np.asarray(ended, dtype=bool)
    return _f64(rewards) - penalty * cut


# --------------------------------------------------------------------------- the one call
def compute_advantages(rewards, traj_ids, group_ids, anchors, valid, *, algo="gigpo",
                       gamma=0.95, omega=1.0, penalty=0.1, norm="mean_std_norm",
                       stats="step", similarity=None, values=None, gae_lambda=0.95, tied_step=True):
    """One advantage per sample.

      gigpo:        A = A^E + omega * A^S   (Sec. 4.2, combined advantage); tied_step=False: an
                    ablation (step_parts)
      grpo:         A = A^E                 (= gigpo with omega = 0)
      rloo:         A = leave-one-out on the episode scores
      ppo:          A = batch_whiten(gae_advantage(values) - penalty * (1 - v))   (a learned critic)
      reinforce_pp: A = batch_whiten(step_returns)   (REINFORCE++: no group baseline)

    All inputs (N,); values (N,): the critic's V(s) per sample, ppo only. A^E uses
    episode_scores, A^S uses step_returns and step_groups; under mean_std_norm a group
    whose members all tie adds 0 (group_stats_normalize). ppo and reinforce_pp (BATCH_ALGOS)
    ignore the episode groups and norm/stats; their statistics are over all N samples.
    Empty input -> empty array. Raises ValueError on unequal lengths, a NaN/inf reward,
    a trajectory spread over two episode groups, ppo without values, or an unknown
    algo/norm/stats. Returns (N,) float64, always finite.
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

    if algo == "ppo":
        if values is None or len(values) != len(r):
            raise ValueError(f"algo ppo needs one critic value per sample, got {values is not None and len(values)}")
        adv = gae_advantage(r, values, traj_ids, gamma, gae_lambda) - penalty * (1.0 - _f64(valid))
        return batch_whiten(adv)
    if algo == "reinforce_pp":
        return batch_whiten(step_returns(r, traj_ids, valid, gamma, penalty))
    scores = episode_scores(r, traj_ids, valid, penalty)
    if algo == "rloo":
        return rloo_advantage(scores, group_ids, traj_ids, stats=stats)
    adv = episode_advantage(scores, group_ids, traj_ids, norm=norm, stats=stats)
    if algo == "gigpo" and omega != 0:
        adv = adv + omega * step_parts(r, traj_ids, group_ids, anchors, valid, gamma=gamma, penalty=penalty,
                                       norm=norm, similarity=similarity, tied_step=tied_step)[2]
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
    sizes = list(Counter(list(step_group_ids)).values())
    n_groups, n_steps = len(set(group_ids)), len(sizes)
    zero_var = len({g for g, tied in zip(group_ids, tied_groups(x, group_ids)) if tied})
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


def policy_loss(logp, old_logp, adv, mask, clip=0.2, dual_clip=3.0, token_count=None, weights=None,
                clip_high=None):
    """PPO clipped surrogate with dual clip, token-mean (paper's objective, Sec. 4.2):

      ratio = exp(logp - old_logp)        (log-ratio clamped to [-20, 20])
      pg    = max(-A * ratio, -A * clip(ratio, 1 - clip, 1 + clip_high))
      pg    = min(pg, -A * dual_clip)      where A < 0 (dual_clip None: off)
      loss  = sum(w * pg * mask) / token_count (default mask.sum())

    clip_high (None: = clip): DAPO's clip-higher (Yu et al. 2025, arXiv 2503.14476, eq. 10; DAPO:
    clip 0.2, clip_high 0.28), more room for a low-probability token's ratio to rise. The mean over
    all tokens of the mini-batch is DAPO's token-level aggregation (its eq. 12), this code's default.
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
    pg_clip = -adv * ratio.clamp(1.0 - clip, 1.0 + (clip if clip_high is None else clip_high))
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


def gspo_loss(logp, old_logp, adv, mask, clip=3e-4, clip_high=4e-4, seq_count=None):
    """GSPO's sequence-level clipped objective (Zheng et al. 2025, arXiv 2507.18071, eqs. 5-7):

      s_i  = exp(sum_t mask * (logp - old_logp) / |y_i|)      (log-ratio clamped to [-20, 20])
      pg_i = max(-A_i * s_i, -A_i * clip(s_i, 1 - clip, 1 + clip_high))
      loss = sum_i pg_i / seq_count   (default: the rows with at least one token)

    One importance ratio per response, the geometric mean of its token ratios, clipped as a whole
    (a sequence is in or out). Its ranges are small since s_i is length-normalised (paper: 3e-4 and
    4e-4). A mean over sequences (GSPO's 1/G sum_i; the same as a token mean for one-token replies).
    No dual clip, no per-token weights. logp, old_logp, mask: (B, T); adv: (B,). Pass a global
    seq_count so that micro-batch losses add up to the mini-batch mean. Returns (loss, stats): detached
    clip_frac (share of sequences whose clipped term is active) and approx_kl (token mean of old - new).
    """
    adv = torch.as_tensor(adv, dtype=logp.dtype, device=logp.device).reshape(-1)
    m = mask.to(logp.dtype)
    n_tok = m.sum(-1)                                                       # (B,)
    log_s = (((logp - old_logp) * m).sum(-1) / n_tok.clamp(min=1.0)).clamp(-20.0, 20.0)
    s = torch.exp(log_s)                                                    # (B,)
    pg_plain, pg_clip = -adv * s, -adv * s.clamp(1.0 - clip, 1.0 + clip_high)
    pg = torch.maximum(pg_plain, pg_clip)
    rows = (n_tok > 0).to(logp.dtype)
    loss = masked_mean(pg, rows, seq_count)
    with torch.no_grad():
        stats = {"clip_frac": masked_mean((pg_clip > pg_plain).to(logp.dtype), rows),
                 "approx_kl": masked_mean(old_logp - logp, mask)}
    return loss, {k: v.detach() for k, v in stats.items()}


def value_loss(values, old_values, returns, clip=0.5, count=None):
    """PPO's clipped value loss (Schulman et al. 2017, eq. 9, L^VF; clipped around the old value
    as in OpenAI baselines and verl's compute_value_loss):

      V_clip = V_old + clip(V - V_old, -clip, clip)
      loss   = 0.5 * sum_i max((V_i - R_i)^2, (V_clip,i - R_i)^2) / count   (default B)

    values (with grad), old_values (the critic's before this update), returns (value_targets): (B,).
    clip None or 0: the plain 0.5 (V - R)^2. Pass a global count so that micro-batch losses add up
    to the mini-batch mean. Returns (loss, clip_frac: detached share of samples where the clipped
    term is the larger one).
    """
    old_values = torch.as_tensor(old_values, dtype=values.dtype, device=values.device)
    returns = torch.as_tensor(returns, dtype=values.dtype, device=values.device)
    n = count or max(len(values), 1)
    plain = (values - returns) ** 2
    if not clip:
        return 0.5 * plain.sum() / n, torch.zeros((), dtype=values.dtype, device=values.device)
    clipped = (old_values + (values - old_values).clamp(-clip, clip) - returns) ** 2
    frac = masked_mean((clipped > plain).to(values.dtype), torch.ones_like(plain)).detach()
    return 0.5 * torch.maximum(plain, clipped).sum() / n, frac


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
