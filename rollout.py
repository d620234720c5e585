"""Step-independent multi-turn rollouts over grouped envs, and the Sample record.

Every env step is its own LLM call and its own training sample: the prompt is rebuilt each step
from (task, memory text, current observation, admissible actions), so its length stays flat as the
episode grows. We keep the sampled token ids and their log-probs as the engine returned them: a
response is never decoded and re-encoded for training (decoding is only to read the action).

Two schedules, the same samples: lockstep (each step, the prompts of all active envs go to the engine
as ONE batch, then all envs step) and overlap (--overlap, with env workers: an action goes to its worker
as soon as its reply is done, the env's next prompt to the engine as soon as its step returns, so env
steps hide behind the generation of other envs' replies). Under overlap the prompts that are ready
join the engine together, once WAVE of the envs have one or the engine would idle: one prompt joining
at each engine step made most steps mixed prefill + decode, which vLLM runs slower than decode alone.
"""

import time
from dataclasses import dataclass

from tqdm import tqdm

WAVE = 1 / 8  # overlap: share of the envs whose prompts join the engine together (0: each at once)


@dataclass
class Sample:
    """One (env, step): one LLM call, one training sample."""

    prompt_ids: list
    response_ids: list
    logprobs: list  # rollout log-probs of response_ids, one per token; None if not asked (LOGP_EVERY)
    reward: float
    done: bool
    valid: bool  # did the response parse into an admissible action?
    group: int  # episode group id (uid): envs that started from the same state
    traj: int  # trajectory id, unique within the batch
    anchor: str  # anchor key: the raw observation the action was taken in
    step: int
    action: str = ""  # what the env was sent (parsed from the response)


def render_prompts(tokenizer, messages):
    """Chat messages -> prompt token ids (the chat template is applied once, then one batch encode)."""
    if tokenizer.chat_template:
        texts = [
            tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in messages
        ]
    else:
        texts = ["\n".join(x["content"] for x in m) + "\n" for m in messages]
    return tokenizer(texts, add_special_tokens=False).input_ids


def rollout(envs, engine, tokenizer, prompt, memories, group_seeds, temperature, top_p, max_tokens,
            max_turns=1000, desc=None, overlap=False):  # fmt: skip
    """Play one batch of episodes to the end -> (samples, episodes, timings).

    envs: GroupedEnvs; memories: one per env; group_seeds: one per group. Envs that finished are
    skipped; only active steps become samples, ordered by (step, env) under either schedule.
    episodes: one dict per env (won, return, length, invalid, worker_died: cut short by a dead env
    worker, so its return means nothing). timings: seconds in generation, waiting for env steps
    (under overlap: only the wait the generation did not hide) and the rest (prompts, parsing).
    overlap: the overlap schedule (module docstring) where envs step in worker processes.
    desc: show a progress bar (one tick per finished step) under this name, for long evaluations.
    """
    t_start = time.perf_counter()
    timing = {"gen": 0.0, "env": 0.0}
    obs, infos = envs.reset(group_seeds)
    timing["env"] += time.perf_counter() - t_start
    for mem, info in zip(memories, infos):
        mem.reset(info["task"])
    episodes = [
        {"won": False, "return": 0.0, "length": 0, "invalid": 0, "group": envs.group_of(i)}
        for i in range(len(obs))
    ]
    overlap = overlap and envs.workers > 0  # in-process envs step at once: nothing to hide
    samples, asked, steps = [], {}, [0] * len(obs)  # asked: env -> its prompt ids at the engine
    bar = tqdm(desc=desc, unit="step", leave=False, disable=desc is None)

    def ask(ready):  # the next prompts of these envs, built in env order, to the engine
        ready = [i for i in sorted(ready) if steps[i] < max_turns]
        if not ready:
            return
        ids = render_prompts(
            tokenizer,
            [
                prompt.build(
                    infos[i]["task"], memories[i].text(), obs[i], infos[i]["admissible_actions"], steps[i]
                )
                for i in ready
            ],
        )
        engine.check_fits(ids, max_tokens)
        for i, p_ids in zip(ready, ids):
            asked[i] = p_ids
            engine.submit(i, p_ids, temperature, top_p, max_tokens)

    stepping = {}  # env -> (prompt ids, response ids, log-probs, action, valid) while its env steps
    waiting, wave = list(range(len(obs))), max(1, round(WAVE * len(obs)))  # envs whose prompt waits
    while asked or stepping or waiting:
        if waiting and (len(waiting) >= wave or not asked):
            ask(waiting)
            waiting = []
        t0 = time.perf_counter()
        replies = engine.poll(wait_all=not overlap) if asked else []
        timing["gen"] += time.perf_counter() - t0
        actions = {}
        for i, ids, lps in replies:
            action, valid = prompt.parse(
                tokenizer.decode(ids, skip_special_tokens=True), infos[i]["admissible_actions"]
            )
            stepping[i], actions[i] = (asked.pop(i), ids, lps, action, valid), action
        envs.send(actions)
        t0 = time.perf_counter()
        # overlap: block on the envs only when the engine has nothing left to generate
        results = envs.receive(("now" if asked else "any") if overlap else "all")
        timing["env"] += time.perf_counter() - t0
        for i, (new_obs, reward, term, trunc, info) in sorted(results.items()):
            p_ids, ids, lps, action, valid = stepping.pop(i)
            reward = float(reward)
            samples.append(
                Sample(
                    p_ids,
                    ids,
                    lps,
                    reward,
                    term or trunc,
                    valid,
                    envs.group_of(i),
                    i,
                    str(infos[i].get("anchor", obs[i])),
                    steps[i],
                    action,
                )
            )
            memories[i].add(obs[i], action, reward)
            ep = episodes[i]
            ep["return"] += reward
            ep["length"] += 1
            ep["invalid"] += not valid
            ep["won"] = bool(info.get("won", False))
            ep["task_type"] = info.get("task_type")  # for per-type eval results (ALFWorld)
            ep["worker_died"] = bool(info.get("worker_died"))  # cut short by a dead env worker
            obs[i], infos[i], steps[i] = new_obs, info, steps[i] + 1
            bar.update()
        waiting += [i for i, (_, _, term, trunc, _) in results.items() if not (term or trunc)]
        if desc:
            bar.set_postfix(
                active=len(asked) + len(stepping), won=sum(e["won"] for e in episodes), refresh=False
            )
    bar.close()
    samples.sort(key=lambda s: (s.step, s.traj))
    timing["other"] = time.perf_counter() - t_start - timing["gen"] - timing["env"]
    return samples, episodes, timing
