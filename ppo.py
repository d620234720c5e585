"""The PPO-style update of train.py: the torch losses (the clipped surrogate, GSPO's sequence ratio,
the critic's clipped value loss, truncated importance weights, k3 KL), token-budget micro-batches,
response log-probs, the clipped step, and --algo ppo's learned critic (Critic, state_values).

Each step sample is (prompt ids, response ids); only response tokens are scored and trained. Micro-
batches hold at most `micro_batch_tokens` tokens: left-padded rows (SDPA) or one packed row (varlen
attention). Under FSDP2 every rank runs the same number of micro-batches (dummy passes fill in).
"""

import math

import numpy as np
import torch
import torch.distributed as dist

from fsdp import all_reduce, dist_on

LOSSES = ("ppo", "gspo")  # token ratio (policy_loss) | sequence ratio (gspo_loss): --loss
# update()'s fixed values (no flags), the paper's where it has one
EPOCHS = 1  # passes over each batch (paper: 1)
GRAD_CLIP = 1.0  # max gradient norm of each optimizer step, the model's and the critic's apart (paper: 1.0)
DUAL_CLIP = 3.0  # dual-clip c: a negative advantage's token term is at most -A c; --loss ppo only (paper: 3)
VF_COEF = 0.5  # --algo ppo: weight of the value loss in the shared loss (PPO paper's c1: 1, on Atari)
VF_CLIP = 0.5  # --algo ppo: value clip, V within V_old +- this, reward units (verl: 0.5)


# ---- the losses (PPO, Schulman et al. 2017, arXiv 1707.06347; DAPO, Yu et al. 2025, arXiv 2503.14476;
# GSPO, Zheng et al. 2025, arXiv 2507.18071), on (B, T) token tensors ----
def masked_mean(x, mask, count=None):
    """sum(x * mask) / count, count defaulting to mask.sum() (clamped to >= 1,
    so an all-zero mask gives 0, not NaN). x, mask: same shape; returns a 0-d tensor."""
    mask = mask.to(x.dtype)
    if count is None:
        count = mask.sum().clamp(min=1.0)
    return (x * mask).sum() / count


def policy_loss(
    logp, old_logp, adv, mask, clip=0.2, dual_clip=3.0, token_count=None, weights=None, clip_high=None
):
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
    n_tok = m.sum(-1)  # (B,)
    log_s = (((logp - old_logp) * m).sum(-1) / n_tok.clamp(min=1.0)).clamp(-20.0, 20.0)
    s = torch.exp(log_s)  # (B,)
    pg_plain, pg_clip = -adv * s, -adv * s.clamp(1.0 - clip, 1.0 + clip_high)
    pg = torch.maximum(pg_plain, pg_clip)
    rows = (n_tok > 0).to(logp.dtype)
    loss = masked_mean(pg, rows, seq_count)
    with torch.no_grad():
        stats = {
            "clip_frac": masked_mean((pg_clip > pg_plain).to(logp.dtype), rows),
            "approx_kl": masked_mean(old_logp - logp, mask),
        }
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


# ---- micro-batches: token budget; left-padded rows (SDPA) or one packed row (flash-attn varlen) ----
def micro_batches(samples, idx, max_tokens, packed):
    """Indices -> lists of indices, longest first, each under max_tokens. The cost of a micro-batch
    is what the attention sees: its summed lengths when packed, rows x longest when padded."""
    idx = sorted(idx, key=lambda i: -(len(samples[i].prompt_ids) + len(samples[i].response_ids)))
    out, cur, width, total = [], [], 0, 0
    for i in idx:
        n = len(samples[i].prompt_ids) + len(samples[i].response_ids)
        cost = total + n if packed else max(width, n) * (len(cur) + 1)
        if cur and cost > max_tokens:
            out.append(cur)
            cur, width, total = [], 0, 0
        cur.append(i)
        width, total = max(width, n), total + n
    return out + [cur] if cur else out


def make_batch(samples, idx, pad_id, packed):
    """Model inputs for samples[idx] + where each response token's prediction sits in the logits.
    Only the logits that predict response tokens are computed (logits_to_keep): with a 150k vocab
    the full logits of a micro-batch would not fit. Padded: rows are left-padded so all responses
    end in the last column and the last K+1 positions cover every one. Packed: the sequences are
    concatenated in one row, restarting position_ids marks their boundaries (transformers then
    masks attention per sequence for SDPA/eager, and flash-attn 2 runs varlen)."""
    seqs = [samples[i].prompt_ids + samples[i].response_ids for i in idx]
    resp = [len(samples[i].response_ids) for i in idx]
    if packed:
        ends = np.cumsum([len(s) for s in seqs])
        keep = torch.tensor([e - r - 1 + k for e, r in zip(ends, resp) for k in range(r)])
        ids = torch.tensor([[t for s in seqs for t in s]])
        cu = torch.tensor([0, *ends], dtype=torch.int32)  # sequence boundaries, for varlen
        # an upper bound is all varlen attention needs; a power of two keeps the values few, so a
        # compiled layer (--compile 1, which guards on this int) is not recompiled per micro-batch
        longest = 1 << (max(len(s) for s in seqs) - 1).bit_length()
        inputs = dict(
            input_ids=ids,
            position_ids=torch.tensor([[p for s in seqs for p in range(len(s))]]),
            logits_to_keep=keep,
            cu_seq_lens_q=cu,
            cu_seq_lens_k=cu,
            max_length_q=longest,
            max_length_k=longest,
        )
        rows, cols, targets = torch.zeros_like(keep), torch.arange(len(keep)), ids[0, keep + 1]
        last = (
            torch.zeros(len(seqs), dtype=torch.long),
            torch.tensor(ends - np.array(resp) - 1, dtype=torch.long),
        )
    else:
        W, K = max(len(s) for s in seqs), max(resp)
        ids = torch.full((len(seqs), W), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for b, s in enumerate(seqs):
            ids[b, W - len(s) :], mask[b, W - len(s) :] = torch.tensor(s), 1
        inputs = dict(
            input_ids=ids,
            attention_mask=mask,
            position_ids=(mask.cumsum(1) - 1).clamp(min=0),
            logits_to_keep=K + 1,
        )
        rows = torch.tensor([b for b, r in enumerate(resp) for _ in range(r)], dtype=torch.long)
        cols = torch.tensor([K - r + k for r in resp for k in range(r)], dtype=torch.long)  # logit column
        targets = ids[rows, W - K + cols]  # the token it predicts
        last = (torch.arange(len(seqs)), torch.tensor([W - r - 1 for r in resp], dtype=torch.long))
    # last: (row, column) of each sample's last prompt token in input_ids: the critic's state
    return {"inputs": inputs, "rows": rows, "cols": cols, "targets": targets, "last_prompt": last}


def response_logprobs(model, batch, device, temperature=1.0, entropy_grad=False, entropy=True):
    """Log-prob and entropy of every response token of a micro-batch: two (n_tokens,) tensors, in
    sample order (the order of make_batch's idx), token order within a sample. The entropy carries
    a gradient only with entropy_grad (an entropy bonus); else it is a metric, kept off the graph.
    entropy=False: None in its place (two fewer passes over the (n_tokens, vocab) log-probs)."""
    return score(model, batch, device, temperature, entropy_grad, entropy=entropy)[:2]


def score(model, batch, device, temperature=1.0, entropy_grad=False, critic=None, entropy=True):
    """response_logprobs' two tensors and, with a critic, V(s) of each sample from the same forward:
    (n_samples,), else None."""
    # every copy to the device before the forward is queued: a copy waits for the GPU to finish what
    # it was given, so one after it would hold the CPU until the forward is done
    to = lambda x: x.to(device) if torch.is_tensor(x) else x  # noqa: E731
    inputs = {k: to(v) for k, v in batch["inputs"].items()}
    rows, cols, targets = to(batch["rows"]), to(batch["cols"]), to(batch["targets"])
    r, c = map(to, batch["last_prompt"]) if critic is not None else (None, None)
    out = model(**inputs, use_cache=False, output_hidden_states=critic is not None)
    logits = out.logits[rows, cols].float() / temperature  # (n, V)
    logp_all = torch.log_softmax(logits, -1)  # (n, V)
    logp = logp_all.gather(-1, targets[:, None])[:, 0]
    values = None
    if critic is not None:  # the last layer's (normed) hidden state at the last prompt token
        values = critic(out.hidden_states[-1][r, c])
    if not entropy:
        return logp, None, values
    with torch.enable_grad() if entropy_grad else torch.no_grad():
        return logp, -(logp_all.exp() * logp_all).sum(-1), values


def dummy_pass(model, device):
    """A rank with fewer micro-batches than the others still joins FSDP's collectives: one token
    forward (and backward, of a zero loss) stands in for each missing micro-batch."""
    out = model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device), use_cache=False)
    return out.logits.sum() * 0.0


def synced_micro_batches(samples, idx, cfg, pad_id, packed):
    """micro_batches(), padded with None up to the largest count on any rank."""
    mbs = micro_batches(samples, idx, cfg.micro_batch_tokens, packed)
    return mbs + [None] * (int(all_reduce(len(mbs), "max")) - len(mbs))


@torch.no_grad()
def logprobs(model, samples, *, cfg, device, pad_id, packed):
    """Per-sample log-probs of the responses under `model` -> list of (r_i,) CPU tensors (train.py:
    the old log-probs of the update, and the KL reference's). They stay on the device until the last
    micro-batch is queued: a copy to the CPU after each would wait for its forward, and the GPU would
    then wait for the next micro-batch's inputs to be built."""
    out, done = [None] * len(samples), []
    for mb in synced_micro_batches(samples, range(len(samples)), cfg, pad_id, packed):
        if mb is None:
            dummy_pass(model, device)
            continue
        done.append(
            (
                mb,
                response_logprobs(
                    model, make_batch(samples, mb, pad_id, packed), device, cfg.temperature, entropy=False
                )[0],
            )
        )
    for mb, logp in done:
        for i, lp in zip(mb, logp.cpu().split([len(samples[i].response_ids) for i in mb])):
            out[i] = lp
    return out


class Critic:
    """--algo ppo's learned value V(s) (Schulman et al. 2017): a head on the policy,

        V(s_t) = w . h_t + b,   h_t = the policy model's last hidden state (after its final norm) at
                                the last prompt token: the state the step acted in, before any reply

    Why a head on the policy and not a separate value model (verl's critic is a second LLM with its
    own optimizer): the update's forward yields V at no extra cost (one no-grad pass before the
    advantages gives the values GAE needs), and nothing else is sharded, saved or pushed twice. The
    value loss flows into the shared trunk, weighted by VF_COEF (the PPO paper's shared-parameter
    objective, eq. 9: L^CLIP - c1 L^VF). Zero-initialised: V = 0 on every rank with no broadcast, so
    the first advantages are plain discounted returns.
    The head lives outside the model, fp32, on the model's device: inside, FSDP2 would shard it and
    the engine (push_weights) and the HF export would get a weight they do not know. So it has its
    own AdamW (--lr, --weight_decay, the same cosine), its own gradient clip at GRAD_CLIP, its
    gradient averaged over ranks by hand (FSDP2 does the model's), and its own file in the
    checkpoint (checkpoint.save / load_checkpoint's `extra`), so --resume 1 keeps it."""

    def __init__(self, hidden, device, make_optimizer):
        self.head = torch.nn.Linear(hidden, 1).to(device)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)
        self.opt, self.sched = make_optimizer(self.head)

    def __call__(self, h):
        return self.head(h.float()).squeeze(-1)  # (B,)

    def step(self, grad_clip, world):
        """Average the head's gradient over ranks, clip it, step."""
        if world > 1:
            for p in self.head.parameters():  # a rank with no sample this step adds zeros
                p.grad = torch.zeros_like(p) if p.grad is None else p.grad
                dist.all_reduce(p.grad)
                p.grad /= world
        torch.nn.utils.clip_grad_norm_(self.head.parameters(), grad_clip)
        self.opt.step()

    def state_dict(self):
        return {
            "head": self.head.state_dict(),
            "opt": self.opt.state_dict(),
            "sched": self.sched.state_dict(),
        }

    def load_state_dict(self, state):
        self.head.load_state_dict(state["head"])
        self.opt.load_state_dict(state["opt"])
        self.sched.load_state_dict(state["sched"])


@torch.no_grad()
def state_values(model, critic, samples, *, cfg, device, pad_id, packed):
    """V(s) of every sample under the current weights -> (N,) float64 (train.py: GAE's values, and
    the old values the value loss clips around)."""
    out = np.zeros(len(samples))
    for mb in synced_micro_batches(samples, range(len(samples)), cfg, pad_id, packed):
        if mb is None:
            dummy_pass(model, device)
            continue
        out[mb] = (
            score(model, make_batch(samples, mb, pad_id, packed), device, critic=critic, entropy=False)[2]
            .cpu()
            .numpy()
        )
    return out


def update(
    model, opt, sched, samples, *, old, ref, adv, cfg, device, pad_id, packed, critic=None, targets=None
):
    """PPO-style clipped update over this rank's samples -> metrics. Token-mean over the GLOBAL
    mini-batch: each micro-batch loss is its token sum over the mini-batch's token count on all
    ranks (times the world size, since FSDP averages gradients over ranks), so the update does not
    depend on how samples fell across ranks or micro-batches. old/ref: per-sample log-prob tensors
    (logprobs(); ref None = no KL term); adv: one float per sample; pad_id: the tokenizer's pad
    token; packed: one packed row per micro-batch (varlen attention) instead of padded rows. --loss
    gspo: GSPO's sequence ratio, a mean over the mini-batch's sequences. critic (--algo ppo): its
    clipped value loss joins the loss (x VF_COEF), mean over samples; targets: per sample (old
    value, value target)."""
    world = dist.get_world_size() if dist_on() else 1
    keys = ("loss", "clip_frac", "kl_ref", "entropy", "tis_weight", "tis_trunc_frac", "grad_norm") + (
        ("value_loss", "vf_clip_frac") if critic else ()
    )
    stats = {k: torch.zeros((), device=device) for k in keys}
    n_steps = 0
    for _ in range(EPOCHS):
        perm = torch.randperm(len(samples)).tolist()
        steps = max(1, math.ceil(all_reduce(len(samples), "max") * world / cfg.mini_batch))
        for chunk in np.array_split(perm, steps):
            n_tok = all_reduce(sum(len(samples[i].response_ids) for i in chunk)) / world
            n_seq = all_reduce(len(chunk)) / world
            opt.zero_grad(set_to_none=True)
            if critic:
                critic.opt.zero_grad(set_to_none=True)
            for mb in synced_micro_batches(samples, chunk.tolist(), cfg, pad_id, packed):
                if mb is None:
                    dummy_pass(model, device).backward()
                    continue
                logp, ent, v = score(
                    model,
                    make_batch(samples, mb, pad_id, packed),
                    device,
                    cfg.temperature,
                    entropy_grad=cfg.entropy_coef > 0,
                    critic=critic,
                )
                loss = surrogate(samples, mb, logp, old, adv, cfg, n_tok, n_seq, stats)
                if critic:
                    t = torch.tensor(np.asarray([targets[i] for i in mb]), dtype=torch.float32, device=device)
                    vl, vclip = value_loss(v, t[:, 0], t[:, 1], VF_CLIP, count=n_seq)
                    loss = loss + VF_COEF * vl
                    stats["value_loss"] += vl.detach()
                    stats["vf_clip_frac"] += vclip * len(mb) / n_seq
                ent_sum = ent.sum() / n_tok
                loss = loss - cfg.entropy_coef * ent_sum
                if ref is not None:
                    kl = kl_k3(logp[None], torch.cat([ref[i] for i in mb]).to(device)[None]).sum() / n_tok
                    loss = loss + cfg.kl_coef * kl
                    stats["kl_ref"] += kl.detach()
                loss.backward()
                stats["loss"] += loss.detach()
                stats["entropy"] += ent_sum.detach()
            gn = torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
            stats["grad_norm"] += gn.full_tensor() if hasattr(gn, "full_tensor") else gn
            opt.step()
            if critic:
                critic.step(GRAD_CLIP, world)
            n_steps += 1
    lr = sched.get_last_lr()[0]  # this update's, logged; the step sets the next iteration's
    sched.step()
    if critic:
        critic.sched.step()
    if cfg.tis_cap <= 0:
        del stats["tis_weight"], stats["tis_trunc_frac"]
    gn = stats.pop("grad_norm")  # already global; the rest are this rank's shares of global means
    vals = all_reduce(torch.stack(list(stats.values()))) / world
    return {k: float(v) / n_steps for k, v in zip(stats, vals)} | {
        "grad_norm": float(gn) / n_steps,
        "optimizer_steps": n_steps,
        "lr": lr,
    }


def surrogate(samples, mb, logp, old, adv, cfg, n_tok, n_seq, stats):
    """One micro-batch's clipped policy loss (its share of the mini-batch's token mean, or of GSPO's
    sequence mean), with --tis_cap's weights; adds its clip/TIS shares to stats."""
    device = logp.device
    cat = lambda xs: torch.cat([xs[i] for i in mb]).to(device)[None]  # noqa: E731
    m = torch.ones_like(logp)[None]
    w = None
    if cfg.tis_cap > 0:  # the engine's sampling policy vs the trainer's: see tis_weights
        rollout_lp = torch.cat([torch.tensor(samples[i].logprobs) for i in mb]).to(device)[None]
        w, trunc = tis_weights(cat(old), rollout_lp, cfg.tis_cap)
        stats["tis_weight"] += w.sum() / n_tok
        stats["tis_trunc_frac"] += trunc * len(logp) / n_tok
    clip_high = cfg.clip_high or cfg.clip
    if cfg.loss == "gspo":  # one ratio per sequence: (B, T) rows of this micro-batch's samples
        lens = [len(samples[i].response_ids) for i in mb]
        a = torch.tensor([float(adv[i]) for i in mb], device=device)
        loss, pst = gspo_loss(
            rows(logp, lens), rows(cat(old)[0], lens), a, rows(m[0], lens), cfg.clip, clip_high, n_seq
        )
        stats["clip_frac"] += pst["clip_frac"] * len(mb) / n_seq
        return loss
    a = torch.cat([torch.full((len(samples[i].response_ids),), float(adv[i])) for i in mb]).to(device)
    loss, pst = policy_loss(
        logp[None],
        cat(old),
        a[None],
        m,
        cfg.clip,
        DUAL_CLIP,
        token_count=n_tok,
        weights=w,
        clip_high=clip_high,
    )
    stats["clip_frac"] += pst["clip_frac"] * len(logp) / n_tok
    return loss


def rows(flat, lens):
    """A micro-batch's flat per-token tensor (n_tokens,) -> (B, T) rows, one per sample, zero-padded."""
    return torch.nn.utils.rnn.pad_sequence(list(flat.split(lens)), batch_first=True)
