import copy
import os

import pytest
import torch

import rollout as rollout_module
from engine import Engine, HFEngine
from envs import GroupedEnvs
from memory import make_memory
from ppo import logprobs
from prompts import prompt_module
from rollout import render_prompts, rollout
from train import Config


def prompts_for(tok, obs_list):
    p = prompt_module("treasure")
    return render_prompts(tok, [p.build("t", "", o, [], 0) for o in obs_list])


def test_prompt_ids_are_compact(tiny_model):
    _, tok = tiny_model
    ids = prompts_for(tok, ["at (1, 3) treasure (4, 0)"])[0]
    assert len(ids) == 7 and tok.unk_token_id not in ids  # the tiny tokenizer drops "(", ")" and ","
    assert tok.decode(ids) == "at 1 3 treasure 4 0 act"


def argmax_decode(model, prompt, n, eos):
    seq, out = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            nxt = int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax())
            out.append(nxt)
            seq.append(nxt)
            if nxt == eos:
                break
    return out


def test_greedy_engine_equals_manual_argmax(tiny_model):
    model, tok = tiny_model
    prompts = prompts_for(tok, ["at (0, 0) treasure (4, 4)", "at (2, 3) treasure (1, 1)"])
    prompts[1] = prompts[1][2:]  # unequal lengths: exercises left padding
    outs = HFEngine(model, tok).generate(prompts, temperature=0, max_tokens=4)
    for p, (ids, lps) in zip(prompts, outs):
        assert ids == argmax_decode(model, p, 4, tok.eos_token_id) and len(lps) == len(ids)


def test_model_generation_config_does_not_shape_sampling(tiny_model):
    """The engine samples from the plain logits it reports log-probs of (and the trainer recomputes):
    a model's own generation_config (Qwen2.5-Instruct: repetition_penalty 1.1, top_k 20) must not
    reshape the distribution. A huge repetition penalty here would keep every prompt token out."""
    model, tok = tiny_model
    model = copy.deepcopy(model)
    model.generation_config.repetition_penalty, model.generation_config.top_k = 1e4, 1
    engine = HFEngine(model, tok)
    prompts = prompts_for(tok, ["at (0, 0) treasure (4, 4)", "at (1, 3) treasure (4, 0)"])
    for p, (ids, _) in zip(prompts, engine.generate(prompts, temperature=0, max_tokens=4)):
        assert ids == argmax_decode(model, p, 4, tok.eos_token_id)
    p, n = prompts[0], 2000
    torch.manual_seed(0)
    outs = engine.generate([p] * n, temperature=1.0, max_tokens=1)
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([p])).logits[0, -1], -1)
    assert all(abs(lps[0] - float(logp[ids[0]])) < 1e-4 for ids, lps in outs)
    expected = float(logp[sorted(set(p))].exp().sum())  # 0.36: the plain mass on prompt tokens
    share = sum(ids[0] in p for ids, _ in outs) / n
    assert abs(share - expected) < 4 * (expected * (1 - expected) / n) ** 0.5, (share, expected)
    assert model.generation_config.repetition_penalty == 1e4  # the model's own config is put back


def test_sampled_logprobs_match_training_recompute(tiny_model):
    model, tok = tiny_model
    torch.manual_seed(0)
    envs = GroupedEnvs("treasure", 4, 4)
    mems = [make_memory("window") for _ in range(envs.n)]  # prompts of several lengths
    samples, _, _ = rollout(
        envs,
        HFEngine(model, tok),
        tok,
        prompt_module("treasure"),
        mems,
        [1, 2, 3, 4],
        temperature=1.0,
        top_p=1.0,
        max_tokens=3,
    )
    train_logp = logprobs(
        model,
        samples,
        cfg=Config(temperature=1.0),
        device=torch.device("cpu"),
        pad_id=tok.pad_token_id,
        packed=False,
    )
    gap = torch.cat([(t - torch.tensor(s.logprobs)).abs() for t, s in zip(train_logp, samples)]).mean()
    assert [len(t) for t in train_logp] == [len(s.response_ids) for s in samples]
    assert gap < 1e-4, f"mean |logp_rollout - logp_train| = {gap}"


class ScriptedEngine(Engine):
    """Returns fixed token ids: lets a test see exactly what the rollout records."""

    def __init__(self, tok, script):
        self.tok, self.script, self.calls = tok, script, []

    def generate(self, prompts, temperature, top_p, max_tokens):
        self.calls.append(len(prompts))
        return [
            (list(self.script(len(self.calls) - 1, b)), [-0.5] * len(self.script(0, b)))
            for b in range(len(prompts))
        ]


def test_rollout_records_ids_untouched_and_flags_invalid(tiny_model):
    _, tok = tiny_model
    up, pad = tok.convert_tokens_to_ids("up"), tok.pad_token_id
    left = tok.convert_tokens_to_ids("left")

    def script(call, b):  # env 0 says "up <pad>" (decodes to "up"), env 1 says "up left": invalid
        return [up, pad] if b % 2 == 0 else [up, left]

    envs = GroupedEnvs("treasure", 1, 2, max_steps=3)
    engine = ScriptedEngine(tok, script)
    mems = [make_memory("full") for _ in range(2)]
    samples, episodes, timing = rollout(envs, engine, tok, prompt_module("treasure"), mems, [5], 1.0, 1.0, 3)
    by_env = {i: [s for s in samples if s.traj == i] for i in (0, 1)}
    # never re-tokenised: "up <pad>" would re-encode to [up]
    assert all(s.response_ids == [up, pad] for s in by_env[0])
    assert all(s.valid for s in by_env[0]) and not any(s.valid for s in by_env[1])
    assert [s.step for s in by_env[1]] == [0, 1, 2] and by_env[1][-1].done
    assert episodes[1]["invalid"] == 3 and episodes[1]["length"] == 3
    # env 1 never moved: its anchor (the obs the action was taken in) is the same every step
    assert len({s.anchor for s in by_env[1]}) == 1
    # full history grows the prompt of later steps; step-independent: one call per step, batched
    assert len(by_env[1][2].prompt_ids) > len(by_env[1][0].prompt_ids)
    assert engine.calls[0] == 2 and sum(engine.calls) == len(samples)
    assert set(timing) == {"gen", "env", "other"}


def test_vllm_that_cannot_wake_is_one_line():
    """A 1.5B update on one H200 once left vLLM no memory to wake into: vLLM's out-of-memory
    traceback becomes one line naming the knobs; other errors stay as they are; an engine that
    never sleeps (CPU, or a fixed KV cache) does nothing."""
    from engine import VLLMEngine

    class LLM:
        def __init__(self, error):
            self.error = error

        def wake_up(self):
            raise self.error

    engine = VLLMEngine.__new__(VLLMEngine)
    engine.sleeps, engine.llm = (
        True,
        LLM(RuntimeError("CUDA Error: out of memory at cumem_allocator.cpp:163")),
    )
    with pytest.raises(SystemExit) as e:
        engine.wake()
    msg = str(e.value.code)
    assert (
        msg.startswith("error: vLLM could not wake") and "--gpu_memory_utilization" in msg and "\n" not in msg
    )
    engine.llm = LLM(RuntimeError("something else"))
    with pytest.raises(RuntimeError, match="something else"):
        engine.wake()
    engine.sleeps = False
    engine.wake()


class OneAtATime(Engine):
    """Wraps an engine so that each poll returns one finished reply (the prompt submitted first), as
    a continuously batching engine does when replies end at different steps: under --overlap the
    rollout must then step envs while others still wait for the engine."""

    def __init__(self, engine):
        self.engine, self.max_len, self.done, self.polls, self.joins = engine, engine.max_len, [], 0, 0

    def poll(self, wait_all=False):
        self.polls += 1
        self.joins += bool(self.queue)  # polls at which new prompts joined the engine
        self.done += super().poll()  # every queued prompt, generated in one batch by the inner engine
        if wait_all:
            out, self.done = self.done, []
            return out
        return [self.done.pop(0)]

    @property
    def pending(self):
        return len(self.queue) + len(self.done)

    def generate(self, prompts, temperature=1.0, top_p=1.0, max_tokens=16):
        return self.engine.generate(prompts, temperature, top_p, max_tokens)


def play(model, tok, overlap, engine=None, workers=3, groups=3, kill=None):
    envs = GroupedEnvs("treasure", groups, 2, workers=workers)
    try:
        mems = [make_memory("window") for _ in range(envs.n)]
        engine = engine or HFEngine(model, tok)
        if kill is not None:  # a worker that dies after the reset: the first step sent to it fails
            import signal

            reset = envs.reset
            envs.reset = lambda seeds: (reset(seeds), os.kill(envs.procs[kill].pid, signal.SIGKILL))[0]
        play.envs = envs  # for a test's look at its restarts
        return rollout(
            envs,
            engine,
            tok,
            prompt_module("treasure"),
            mems,
            [11, 12, 13][:groups],
            temperature=0,
            top_p=1.0,
            max_tokens=2,
            overlap=overlap,
        )
    finally:
        envs.close()


def fields(samples):
    return [
        (s.prompt_ids, s.response_ids, s.reward, s.done, s.valid, s.group, s.traj, s.anchor, s.step, s.action)
        for s in samples
    ]


@pytest.mark.parametrize("wave", [0, 0.5])
def test_overlapped_rollout_yields_the_lockstep_samples(tiny_model, monkeypatch, wave):
    """--overlap: env workers step some envs while the engine generates for others; with the same
    seeds the samples (ids, rewards, groups, anchors, order) and episodes are those of the lockstep
    schedule, for the tiny model greedy and for an engine that finishes one reply per poll (so envs
    really step between generations), whether each prompt joins the engine at once (wave 0) or
    prompts wait to join in waves of half the envs."""
    model, tok = tiny_model
    lock, lock_eps, _ = play(model, tok, overlap=False)
    assert len({s.step for s in lock}) > 1
    monkeypatch.setattr(rollout_module, "WAVE", wave)
    for engine in (None, OneAtATime(HFEngine(model, tok))):
        over, over_eps, timing = play(model, tok, overlap=True, engine=engine)
        assert fields(over) == fields(lock)
        assert all(abs(a - b) < 1e-5 for x, y in zip(over, lock) for a, b in zip(x.logprobs, y.logprobs))
        assert over_eps == lock_eps and set(timing) == {"gen", "env", "other"}
    assert engine.polls >= len(lock)  # one reply per poll: every sample was generated on its own
    steps = len({s.step for s in lock})
    if wave:  # prompts joined in waves: ~2 joins a step (of 6 envs, 3 at a time), not one per prompt
        assert engine.joins <= 2 * steps + 1 < len(lock)
    else:
        assert engine.joins > 2 * steps + 1


def test_overlapped_rollout_survives_a_dead_worker(tiny_model):
    """A worker killed mid-rollout under --overlap costs its envs' episodes (worker_died, cut short),
    not the rollout: the other envs play to the end, as in the lockstep schedule."""
    model, tok = tiny_model
    whole, _, _ = play(model, tok, overlap=True, workers=2, groups=2)
    samples, episodes, _ = play(
        model, tok, overlap=True, engine=OneAtATime(HFEngine(model, tok)), workers=2, groups=2, kill=0
    )
    dead = [i for i, e in enumerate(episodes) if e["worker_died"]]
    assert dead == [0, 1]  # worker 0 of 2 holds envs 0 and 1 of 4
    assert play.envs.restarts == 1  # env 1, its reply made after the death, is not sent to the new worker
    assert all(e["length"] == 1 for e in episodes[:2])
    alive = [s for s in whole if s.traj >= 2]
    assert fields([s for s in samples if s.traj >= 2]) == fields(alive)


def test_a_prompt_past_the_context_is_one_line(tiny_model):
    """A step's prompt plus its reply longer than the model's context stops the run with one line that
    names the flags that shorten it (it used to reach vLLM as a crash, or pass the tiny model's
    positions silently)."""
    model, tok = tiny_model
    engine = HFEngine(model, tok)
    assert engine.max_len == model.config.max_position_embeddings
    engine.max_len = 40  # the treasure prompt with full history passes it by the second step
    envs = GroupedEnvs("treasure", 1, 2)
    with pytest.raises(SystemExit) as e:
        rollout(
            envs,
            engine,
            tok,
            prompt_module("treasure"),
            [make_memory("full") for _ in range(2)],
            [3],
            temperature=1.0,
            top_p=1.0,
            max_tokens=2,
        )
    msg = str(e.value)
    assert msg.startswith("error: a step's prompt is") and "\n" not in msg
    assert "--memory" in msg and "--max_response_tokens" in msg and "context of 40" in msg
