"""GiGPO's advantages on flat per-step arrays, and the estimator registry: one call (`advantages`)
returns every estimator's advantage per sample and the parts it is made of.

GiGPO = "Group-in-Group Policy Optimization for LLM Agent Training" (Feng et al.
2025, arXiv 2505.10978). The baselines' equations (RLOO, PPO's GAE, REINFORCE++,
DAPO's pieces) live in baselines.py, the torch losses with the update in ppo.py.
One *sample* is one env step of one trajectory. Every function below takes flat
arrays of length N (one entry per sample), in time order inside each trajectory;
samples of different trajectories may interleave.

    group_ids  episode group: trajectories that start from the same task/state
    traj_ids   which trajectory a sample belongs to
    anchors    hashable key of the env state the step acted on (usually a str)

Advantage = A^E (episode level, Sec. 4.1) + omega * A^S (step level, Sec. 4.2).
Computed in float64; functions return float64 arrays.

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
from types import SimpleNamespace

import numpy as np

from baselines import batch_whiten, gae_advantage, rloo_advantage, tied_groups, value_targets

NORMS = ("mean_norm", "mean_std_norm")
STATS = ("step", "traj")


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
    unit = {}  # a unit's value: its largest sample value (a sample is its own unit by default)
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


# --------------------------------------------------------------------------- the estimators
# An estimator takes the batch `b` (advantages' inputs and options as attributes, and the shared
# quantities: b.score = episode_scores, b.step_return = step_returns, b.step_group = step_groups)
# and returns its parts: {"adv_episode": (N,) or 0, "adv_step": (N,) or 0 (default 0), "step_weight":
# w (default 1), anything else to pass on (ppo: "value_target")}; its advantage is
# A = adv_episode + w * adv_step, summed in `advantages`, so what the log shows is what trains.
def gigpo_estimator(b):
    """GiGPO (Sec. 4.2, the combined advantage): A = A^E + omega * A^S, A^E = episode_advantage on
    the episode scores, A^S = step_advantage on the step returns within the anchor-state step
    groups. tied_step=False, an ablation: A^S = 0 in episode groups whose scores all tie (all won,
    all lost), so A^S acts only where A^E does. adv_step is A^S before the weight omega."""
    a_s = step_advantage(b.step_return, b.step_group, b.norm)
    if not b.tied_step:
        a_s = np.where(tied_groups(b.score, b.group_ids), 0.0, a_s)
    return {"adv_episode": grpo_estimator(b)["adv_episode"], "adv_step": a_s, "step_weight": b.omega}


def grpo_estimator(b):
    """GRPO: A = A^E (= GiGPO with omega = 0; paper Sec. 4.1)."""
    return {"adv_episode": episode_advantage(b.score, b.group_ids, b.traj_ids, norm=b.norm, stats=b.stats)}


def rloo_estimator(b):
    """RLOO: A = the leave-one-out baseline on the episode scores (baselines.rloo_advantage)."""
    return {"adv_episode": rloo_advantage(b.score, b.group_ids, b.traj_ids, stats=b.stats)}


def ppo_estimator(b):
    """PPO with a learned critic: A = batch_whiten(GAE(values) - penalty * (1 - v)), all of it per
    step (no episode term, weight 1); value_target: the critic's lambda-returns on the rewards
    without the invalid-action penalty, which shapes the advantage only (baselines.py).
    Needs b.values, the critic's V(s) per sample; raises ValueError without them."""
    if b.values is None or len(b.values) != len(b.rewards):
        got = b.values is not None and len(b.values)
        raise ValueError(f"algo ppo needs one critic value per sample, got {got}")
    gae = gae_advantage(b.rewards, b.values, b.traj_ids, b.gamma, b.gae_lambda)
    return {
        "adv_episode": 0.0,
        "adv_step": batch_whiten(gae - b.penalty * (1.0 - b.valid)),
        "value_target": value_targets(b.rewards, b.values, b.traj_ids, b.gamma, b.gae_lambda),
    }


def reinforce_pp_estimator(b):
    """REINFORCE++: A = batch_whiten(step returns), no group baseline; all of it per step."""
    return {"adv_episode": 0.0, "adv_step": batch_whiten(b.step_return)}


ESTIMATORS = {
    "gigpo": gigpo_estimator,
    "grpo": grpo_estimator,
    "rloo": rloo_estimator,
    "ppo": ppo_estimator,
    "reinforce_pp": reinforce_pp_estimator,
}
ALGOS = tuple(ESTIMATORS)
BATCH_ALGOS = ("ppo", "reinforce_pp")  # statistics over the whole batch (train.py: every rank's samples)


# --------------------------------------------------------------------------- the one call
# the paper's hyperparameters read better on three lines than one per line: the formatter skips this header
def advantages(rewards, traj_ids, group_ids, anchors, valid, *, algo="gigpo", gamma=0.95, omega=1.0,
               penalty=0.1, norm="mean_std_norm", stats="step", similarity=None, values=None,
               gae_lambda=0.95, tied_step=True):  # fmt: skip
    """One advantage per sample, and its parts, for the estimator ESTIMATORS[algo]:

      gigpo:        A = A^E + omega * A^S   (Sec. 4.2); tied_step=False: an ablation (gigpo_estimator)
      grpo:         A = A^E                 (= gigpo with omega = 0)
      rloo:         A = leave-one-out on the episode scores
      ppo:          A = batch_whiten(gae_advantage(values) - penalty * (1 - v))   (a learned critic)
      reinforce_pp: A = batch_whiten(step_returns)   (REINFORCE++: no group baseline)

    All inputs (N,); values (N,): the critic's V(s) per sample, ppo only. A^E uses
    episode_scores, A^S uses step_returns and step_groups; under mean_std_norm a group
    whose members all tie adds 0 (group_stats_normalize). ppo and reinforce_pp (BATCH_ALGOS)
    ignore the episode groups and norm/stats; their statistics are over all N samples.
    Returns a dict: adv (N,) float64, always finite, = adv_episode + step_weight * adv_step (each
    (N,); step_weight a float: omega for gigpo, 1 for ppo/reinforce_pp, whose whole A is per step),
    score (episode_scores), step_return (step_returns), step_group (step_groups: (N,) int64), and
    what the estimator adds (ppo: value_target). Empty input -> empty arrays. Raises ValueError on
    unequal lengths, a NaN/inf reward, a trajectory spread over two episode groups, ppo without
    values, or an unknown algo/norm/stats.
    """
    arrays = dict(rewards=rewards, traj_ids=traj_ids, group_ids=group_ids, anchors=anchors, valid=valid)
    lengths = {k: len(v) for k, v in arrays.items()}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"all inputs must have the same length, got {lengths}")
    _check("algo", algo, ALGOS)
    _check("norm", norm, NORMS)
    _check("stats", stats, STATS)
    r = _f64(rewards)
    bad = np.flatnonzero(~np.isfinite(r))
    if bad.size:
        raise ValueError(f"NaN/inf reward at sample {bad[0]} (value {r[bad[0]]}); {bad.size} bad in total")
    home = {}
    for t, g in zip(traj_ids, group_ids):
        if home.setdefault(t, g) != g:
            raise ValueError(f"trajectory {t!r} appears in episode groups {home[t]!r} and {g!r}")
    n = len(r)
    if n == 0:
        empty = {k: np.zeros(0) for k in ("adv", "adv_episode", "adv_step", "score", "step_return")}
        return empty | {"step_group": np.zeros(0, dtype=np.int64), "step_weight": 0.0}
    flags = dict(gamma=gamma, omega=omega, penalty=penalty, norm=norm, stats=stats, gae_lambda=gae_lambda)
    b = SimpleNamespace(**arrays, **flags, tied_step=tied_step, values=values)
    b.rewards, b.valid = r, _f64(valid)
    b.score = episode_scores(r, traj_ids, valid, penalty)
    b.step_return = step_returns(r, traj_ids, valid, gamma, penalty)
    b.step_group = step_groups(anchors, group_ids, similarity)
    parts = ESTIMATORS[algo](b)
    a_e, a_s = (np.broadcast_to(_f64(parts.pop(k, 0.0)), (n,)).copy() for k in ("adv_episode", "adv_step"))
    w = float(parts.pop("step_weight", 1.0))
    out = {"adv": a_e + w * a_s, "adv_episode": a_e, "adv_step": a_s, "step_weight": w, "score": b.score}
    return out | {"step_return": b.step_return, "step_group": b.step_group, **parts}


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
