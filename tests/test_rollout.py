import copy

import pytest
import torch

from envs import GroupedEnvs
from memory import make_memory
from prompts import prompt_module
from rollout import HFEngine, render_prompts, rollout
from ppo import logprobs
from train import Config


def prompts_for(tok, obs_list):
    p = prompt_module("treasure")
    return render_prompts(tok, [p.build("t", "", o, [], 0) for o in obs_list])


def test_prompt_ids_are_compact(tiny_model):
    _, tok = tiny_model
    ids = prompts_for(tok, ["at (1, 3) treasure (4, 0)"])[0]
    assert len(ids) == 7 and tok.unk_token_id not in ids   # the tiny tokenizer drops "(", ")" and ","
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
    prompts[1] = prompts[1][2:]            # unequal lengths: exercises left padding
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
    expected = float(logp[sorted(set(p))].exp().sum())      # 0.36: the plain mass on prompt tokens
    share = sum(ids[0] in p for ids, _ in outs) / n
    assert abs(share - expected) < 4 * (expected * (1 - expected) / n) ** 0.5, (share, expected)
    assert model.generation_config.repetition_penalty == 1e4   # the model's own config is put back


def test_sampled_logprobs_match_training_recompute(tiny_model):
    model, tok = tiny_model
    torch.manual_seed(0)
    envs = GroupedEnvs("treasure", 4, 4)
    mems = [make_memory("window") for _ in range(envs.n)]      # prompts of several lengths
    samples, _, _ = rollout(envs, HFEngine(model, tok), tok, prompt_module("treasure"), mems,
                            [1, 2, 3, 4], temperature=1.0, top_p=1.0, max_tokens=3)
    train_logp = logprobs(model, samples, cfg=Config(temperature=1.0), device=torch.device("cpu"),
                          pad_id=tok.pad_token_id, packed=False)
    gap = torch.cat([(t - torch.tensor(s.logprobs)).abs() for t, s in zip(train_logp, samples)]).mean()
    assert [len(t) for t in train_logp] == [len(s.response_ids) for s in samples]
    assert gap < 1e-4, f"mean |logp_rollout - logp_train| = {gap}"


class ScriptedEngine:
    """Returns fixed token ids: lets a test see exactly what the rollout records."""

    def __init__(self, tok, script):
        self.tok, self.script, self.calls = tok, script, []

    def generate(self, prompts, temperature, top_p, max_tokens):
        self.calls.append(len(prompts))
        return [(list(self.script(len(self.calls) - 1, b)), [-0.5] * len(self.script(0, b)))
                for b in range(len(prompts))]


def test_rollout_records_ids_untouched_and_flags_invalid(tiny_model):
    _, tok = tiny_model
    up, pad = tok.convert_tokens_to_ids("up"), tok.pad_token_id
    left = tok.convert_tokens_to_ids("left")

    def script(call, b):   # env 0 says "up <pad>" (decodes to "up"), env 1 says "up left": invalid
        return [up, pad] if b % 2 == 0 else [up, left]
    envs = GroupedEnvs("treasure", 1, 2, max_steps=3)
    engine = ScriptedEngine(tok, script)
    mems = [make_memory("full") for _ in range(2)]
    samples, episodes, timing = rollout(envs, engine, tok, prompt_module("treasure"), mems, [5],
                                        1.0, 1.0, 3)
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
    from rollout import VLLMEngine

    class LLM:
        def __init__(self, error):
            self.error = error

        def wake_up(self):
            raise self.error

    engine = VLLMEngine.__new__(VLLMEngine)
    engine.sleeps, engine.llm = True, LLM(RuntimeError("CUDA Error: out of memory at cumem_allocator.cpp:163"))
    with pytest.raises(SystemExit) as e:
        engine.wake()
    msg = str(e.value.code)
    assert msg.startswith("error: vLLM could not wake") and "--gpu_memory_utilization" in msg and "\n" not in msg
    engine.llm = LLM(RuntimeError("something else"))
    with pytest.raises(RuntimeError, match="something else"):
        engine.wake()
    engine.sleeps = False
    engine.wake()
