"""Step-independent multi-turn rollouts over grouped envs, and the generation engine.

Every env step is its own LLM call and its own training sample: the prompt is rebuilt each step
from (task, memory text, current observation, admissible actions), so its length stays flat as the
episode grows. Each step, the prompts of all active envs go to the engine as ONE batch. We keep
the sampled token ids and their log-probs as the engine returned them: a response is never decoded
and re-encoded for training (decoding is only to read the action).

Engine interface (nothing else of an engine leaks out of this file):
    generate(prompts: list[list[int]], temperature, top_p, max_tokens) -> list[(ids, logprobs)]
    load_weights(state_dict)           # push the trainer's weights (no-op when sharing the module)
temperature 0 means greedy.
"""
import time
from dataclasses import dataclass

import torch


@dataclass
class Sample:
    """One (env, step): one LLM call, one training sample."""
    prompt_ids: list
    response_ids: list
    logprobs: list      # rollout log-probs of response_ids, one per token
    reward: float
    done: bool
    valid: bool         # did the response parse into an admissible action?
    group: int          # episode group id (uid): envs that started from the same state
    traj: int           # trajectory id, unique within the batch
    anchor: str         # anchor key: the raw observation the action was taken in
    step: int


class HFEngine:
    """transformers `generate` on the training model itself (shares its weights: no sync needed)."""

    def __init__(self, model, tokenizer):
        self.model, self.tok = model, tokenizer

    @torch.no_grad()
    def generate(self, prompts, temperature=1.0, top_p=1.0, max_tokens=16):
        model, pad, eos = self.model, self.tok.pad_token_id, self.tok.eos_token_id
        device = next(model.parameters()).device
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for b, p in enumerate(prompts):  # left padding: every row's response starts at `width`
            ids[b, width - len(p):] = torch.tensor(p)
            mask[b, width - len(p):] = 1
        greedy = temperature == 0
        was_training = model.training
        model.eval()
        out = model.generate(
            input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_tokens,
            do_sample=not greedy, temperature=None if greedy else temperature,
            top_p=None if greedy else top_p, top_k=None if greedy else 0, eos_token_id=eos, pad_token_id=pad,
            output_logits=True, return_dict_in_generate=True)
        model.train(was_training)
        seq = out.sequences[:, width:].cpu()                                  # (B, n)
        logits = torch.stack(out.logits, 1).float().cpu()                      # (B, n, V)
        logp = torch.log_softmax(logits / (temperature or 1.0), -1)
        logp = logp.gather(-1, seq.unsqueeze(-1)).squeeze(-1)                 # (B, n)
        results = []
        for b in range(len(prompts)):
            row = seq[b].tolist()
            n = row.index(eos) + 1 if eos in row else len(row)  # keep the EOS: it is trained too
            results.append((row[:n], logp[b, :n].tolist()))
        return results

    def load_weights(self, state_dict):
        pass  # shares the training module


def render_prompts(tokenizer, messages):
    """Chat messages -> prompt token ids (the chat template is applied once, then one batch encode)."""
    if tokenizer.chat_template:
        texts = [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False)
                 for m in messages]
    else:
        texts = ["\n".join(x["content"] for x in m) + "\n" for m in messages]
    return tokenizer(texts, add_special_tokens=False).input_ids


def rollout(envs, engine, tokenizer, prompt, memories, group_seeds, temperature, top_p,
            max_tokens, max_turns=1000):
    """Play one batch of episodes to the end -> (samples, episodes, timings).

    envs: GroupedEnvs; memories: one per env; group_seeds: one per group. Envs that finished are
    skipped; only active steps become samples. episodes: one dict per env (won, return, length,
    invalid). timings: seconds in generation, env steps and the rest (prompts, parsing).
    """
    t_start = time.perf_counter()
    timing = {"gen": 0.0, "env": 0.0}
    t0 = time.perf_counter()
    obs, infos = envs.reset(group_seeds)
    timing["env"] += time.perf_counter() - t0
    for mem, info in zip(memories, infos):
        mem.reset(info["task"])
    episodes = [{"won": False, "return": 0.0, "length": 0, "invalid": 0} for _ in obs]
    samples, active, step = [], list(range(len(obs))), 0
    while active and step < max_turns:
        messages = [prompt.build(infos[i]["task"], memories[i].text(), obs[i],
                                 infos[i]["admissible_actions"], step) for i in active]
        prompt_ids = render_prompts(tokenizer, messages)
        t0 = time.perf_counter()
        outs = engine.generate(prompt_ids, temperature=temperature, top_p=top_p, max_tokens=max_tokens)
        timing["gen"] += time.perf_counter() - t0
        actions = {}
        for i, (ids, _) in zip(active, outs):
            text = tokenizer.decode(ids, skip_special_tokens=True)
            actions[i] = prompt.parse(text, infos[i]["admissible_actions"])
        t0 = time.perf_counter()
        results = envs.step({i: a for i, (a, _) in actions.items()})
        timing["env"] += time.perf_counter() - t0
        still = []
        for i, p_ids, (ids, lps) in zip(active, prompt_ids, outs):
            new_obs, reward, term, trunc, info = results[i]
            reward = float(reward)
            action, valid = actions[i]
            samples.append(Sample(p_ids, ids, lps, reward, term or trunc, valid, envs.group_of(i), i,
                                  str(infos[i].get("anchor", obs[i])), step))
            memories[i].add(obs[i], action, reward)
            ep = episodes[i]
            ep["return"] += reward
            ep["length"] += 1
            ep["invalid"] += not valid
            ep["won"] = bool(info.get("won", False))
            obs[i], infos[i] = new_obs, info
            if not (term or trunc):
                still.append(i)
        active, step = still, step + 1
    timing["other"] = time.perf_counter() - t_start - timing["gen"] - timing["env"]
    return samples, episodes, timing
