"""The vLLM engine against transformers, on CPU, with real vLLM and the tiny model.

vLLM allows one live engine per process here, so the module shares one (on its own model, which
the tests train); bad input is checked through train.py in a subprocess, as a user meets it.
"""

import copy
import json
import os
import random
import re
import subprocess
import sys
import tempfile

import pytest
import torch

pytest.importorskip("vllm", reason="vllm is not installed (bash install.sh)")

from engine import HFEngine, VLLMEngine  # noqa: E402
from envs import GroupedEnvs  # noqa: E402
from memory import make_memory  # noqa: E402
from ppo import logprobs  # noqa: E402
from prompts import prompt_module  # noqa: E402
from rollout import render_prompts, rollout  # noqa: E402
from tiny import build_tiny  # noqa: E402
from train import Config  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE_ROOT = tempfile.mkdtemp()  # the module engine's VLLM_CACHE_ROOT


@pytest.fixture(scope="module")
def setup():
    """(model, tokenizer, engine); also checks that starting vLLM kept torch's RNG and threads."""
    model, tok = build_tiny("treasure", seed=1)
    torch.set_num_threads(1)
    rng = torch.get_rng_state()
    with pytest.MonkeyPatch.context() as mp:  # its own cache root, as bench.pair's arms have
        mp.setenv("VLLM_CACHE_ROOT", CACHE_ROOT)
        os.makedirs(os.path.join(CACHE_ROOT, "earlier"))
        for i in range(5):  # files an earlier start left: not counted as this start's
            open(os.path.join(CACHE_ROOT, "earlier", str(i)), "w").close()
        engine = VLLMEngine(model, tok.eos_token_id, kv_cache_mb=64, gpu_memory_utilization=0.3)
    assert torch.equal(torch.get_rng_state(), rng) and torch.get_num_threads() == 1
    torch.set_num_threads(2)  # vLLM would have made this a no-op
    assert torch.get_num_threads() == 2
    return model.eval(), tok, engine


def test_the_model_folder_is_named_by_its_config_so_a_compile_cache_is_found_again(setup, monkeypatch):
    """vLLM keys its compile cache (and the trainer's kernels, kept beside it) by the model folder's
    path: with a cache root of its own, the engine names that folder by the config's content, so the
    next start of the same model finds the cache; another config gets another folder; one of that
    name holding something else is not used; on the default root each start has its own, as before."""
    from engine import config_folder

    model, _, engine = setup
    monkeypatch.setenv("VLLM_CACHE_ROOT", tempfile.mkdtemp())
    folder = config_folder(model.config)
    assert engine.llm.llm_engine.model_config.model == folder
    assert config_folder(copy.deepcopy(model.config)) == folder
    other = copy.deepcopy(model.config)
    other.num_hidden_layers += 1
    assert config_folder(other) != folder
    monkeypatch.setattr(tempfile, "tempdir", tempfile.mkdtemp())
    stale = config_folder(model.config)
    with open(os.path.join(stale, "config.json"), "w") as f:
        f.write("{}")
    fresh = config_folder(model.config)
    assert (
        fresh != stale and json.load(open(os.path.join(fresh, "config.json"))) == model.config.to_diff_dict()
    )
    monkeypatch.delenv("VLLM_CACHE_ROOT")
    assert config_folder(model.config) != config_folder(model.config)


def test_the_start_counts_what_it_added_to_the_compile_cache(setup, monkeypatch, tmp_path):
    """engine.started (the set-up line's note): vLLM's start in seconds and the files it added to
    the cache root, which tells a start that compiled from one that found a carried cache."""
    from engine import cache_files

    note = re.fullmatch(r"vLLM's start \d+\.\d, \+(\d+) compile-cache files", setup[2].started)
    monkeypatch.setenv("VLLM_CACHE_ROOT", CACHE_ROOT)
    assert note and int(note[1]) == cache_files() - 5
    for i, sub in enumerate(["", "torch_compile_cache/abc", "torch_compile_cache/abc/inductor"]):
        os.makedirs(tmp_path / "root" / sub, exist_ok=True)
        (tmp_path / "root" / sub / f"f{i}").write_text("x")
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "root"))
    assert cache_files() == 3 == cache_files(str(tmp_path / "root" / "torch_compile_cache")) + 1
    monkeypatch.delenv("VLLM_CACHE_ROOT")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "root" / "torch_compile_cache"))
    assert cache_files() == 0  # its vllm/ folder is not there
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    os.rename(tmp_path / "root", tmp_path / "vllm")
    assert cache_files() == 3


def treasure_prompts(tok):
    p = prompt_module("treasure")
    obs = [f"at ({r}, {c}) treasure ({c}, {4 - r})" for r in range(5) for c in range(5)]
    return render_prompts(tok, [p.build("t", "", o, [], 0) for o in obs])


def train_steps(model, tok, steps=3):
    """A few AdamW steps of next-token loss on random token sequences: the weights really move."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(steps)
    model.train()
    for _ in range(steps):
        x = torch.randint(3, len(tok), (8, 16), generator=g)
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()


def test_greedy_equals_transformers_before_and_after_two_pushes(setup):
    model, tok, engine = setup
    prompts = treasure_prompts(tok)
    prompts[1] = prompts[1][2:]  # unequal lengths
    seen = []
    for push in range(3):
        if push:
            train_steps(model, tok)
            # push 1: a state_dict (lists the tied lm_head); push 2: named_parameters, as FSDP2 will
            # gather them (no lm_head: push_weights must fill it)
            named = model.state_dict().items() if push == 1 else model.named_parameters()
            engine.push_weights(((n, t.detach()) for n, t in named))
        ours = engine.generate(prompts, temperature=0, max_tokens=5)
        ref = HFEngine(model, tok).generate(prompts, temperature=0, max_tokens=5)
        assert [ids for ids, _ in ours] == [ids for ids, _ in ref], f"after push {push}"
        gap = max(abs(a - b) for (_, la), (_, lb) in zip(ours, ref) for a, b in zip(la, lb))
        assert gap < 1e-4, f"after push {push}: greedy log-probs differ by {gap}"
        seen.append(ours)
    assert seen[0] != seen[1] != seen[2]  # the pushes changed what vLLM computes


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_match_training_recompute(setup, temperature):
    """Tolerance 1e-4 (mean |delta| per token; float32 on both sides, measured ~1e-6)."""
    model, tok, engine = setup
    envs = GroupedEnvs("treasure", 4, 4)
    mems = [make_memory("window") for _ in range(envs.n)]  # prompts of several lengths
    samples, _, _ = rollout(
        envs,
        engine,
        tok,
        prompt_module("treasure"),
        mems,
        [1, 2, 3, 4],
        temperature=temperature,
        top_p=1.0,
        max_tokens=3,
    )
    train_logp = logprobs(
        model,
        samples,
        cfg=Config(temperature=temperature),
        device=torch.device("cpu"),
        pad_id=tok.pad_token_id,
        packed=False,
    )
    gap = torch.cat([(t - torch.tensor(s.logprobs)).abs() for t, s in zip(train_logp, samples)]).mean()
    assert [len(t) for t in train_logp] == [len(s.response_ids) for s in samples]
    assert gap < 1e-4, f"mean |logp_rollout - logp_train| = {gap}"


def test_token_ids_in_and_out_never_retokenised(setup):
    """Prompts that no tokenizer would produce (pads, EOS inside, <unk>) go in as given, and every
    response keeps its EOS, exactly like the transformers engine."""
    model, tok, engine = setup
    rng = random.Random(0)
    prompts = [[rng.randrange(len(tok)) for _ in range(rng.randint(1, 12))] for _ in range(32)]
    prompts[0] = [tok.pad_token_id, tok.eos_token_id, tok.unk_token_id, tok.pad_token_id]
    ours = engine.generate(prompts, temperature=0, max_tokens=8)
    assert [ids for ids, _ in ours] == [
        ids for ids, _ in HFEngine(model, tok).generate(prompts, temperature=0, max_tokens=8)
    ]
    assert all(len(ids) == 8 or ids[-1] == tok.eos_token_id for ids, _ in ours)
    assert all(len(lps) == len(ids) for ids, lps in ours)


def test_logp_every_asks_for_one_prompt_in_n(setup):
    """logp_every 4: log-probs for prompts 0, 4, 8, ... of a call, None for the others; those given
    are the greedy log-probs the transformers engine computes."""
    model, tok, engine = setup
    prompts = treasure_prompts(tok)
    engine.logp_every = 4
    try:
        ours = engine.generate(prompts, temperature=0, max_tokens=4)
    finally:
        engine.logp_every = 1
    ref = HFEngine(model, tok).generate(prompts, temperature=0, max_tokens=4)
    assert [i for i, (_, lps) in enumerate(ours) if lps is not None] == list(range(0, len(prompts), 4))
    assert [ids for ids, _ in ours] == [ids for ids, _ in ref]
    assert (
        max(abs(a - b) for (_, la), (_, lb) in zip(ours, ref) if la is not None for a, b in zip(la, lb))
        < 1e-4
    )


def test_submit_and_poll_stream_the_generate_results(setup):
    """submit / poll (the overlapped rollout's path: prompts join vLLM's running batch one at a time,
    each poll returns the replies that finished) give the greedy replies and log-probs of generate;
    with logp_every 4, every 4th prompt submitted has log-probs."""
    model, tok, engine = setup
    prompts = treasure_prompts(tok)
    ref = engine.generate(prompts, temperature=0, max_tokens=4)
    engine.logp_every, got, polls, first, n = 4, {}, 0, engine.submitted, len(prompts)
    try:
        for k in range(10):
            engine.submit(k, prompts[k], temperature=0, max_tokens=4)
        while engine.pending:  # two more join the running batch after each poll
            polls += 1
            got |= {k: (ids, lps) for k, ids, lps in engine.poll()}
            for k in range(8 + 2 * polls, min(10 + 2 * polls, n)):
                engine.submit(k, prompts[k], temperature=0, max_tokens=4)
    finally:
        engine.logp_every = 1
    assert sorted(got) == list(range(len(prompts))) and polls > 1
    assert [got[k][0] for k in range(len(prompts))] == [ids for ids, _ in ref]
    with_lp = [k for k in range(n) if got[k][1] is not None]
    assert with_lp == [k for k in range(n) if (first + k) % 4 == 0]
    assert max(abs(a - b) for k in with_lp for a, b in zip(got[k][1], ref[k][1])) < 1e-4


def run_train(*flags, auto_hf_below=None):
    """train.py for one small iteration; auto_hf_below: engine.AUTO_HF_ON_CPU for this run (0: auto
    tries vLLM for the tiny model too)."""
    patch = "" if auto_hf_below is None else f"engine.AUTO_HF_ON_CPU = {auto_hf_below}; "
    return subprocess.run(
        [
            sys.executable,
            "-c",
            f"import sys, engine, train; {patch}train.main(sys.argv[1:])",
            *"--iterations 1 --n_groups 2 --eval_episodes 4 --out_dir".split(),
            tempfile.mkdtemp(prefix="gigpo-vllm-"),
            *flags,
        ],  # one dir per run
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def tiny_dir(path, **shape):
    """A tiny model of another shape (tiny.build_tiny), saved as an HF folder for --model."""
    model, tok = build_tiny("treasure", **shape)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def test_bad_input_is_one_line_never_a_hang(tmp_path):
    """auto gives the tiny model on CPU the transformers engine, without trying vLLM; where auto does
    try vLLM, a head size its CPU attention rejects (64 / 4 = 16) falls back to transformers with a
    warning that says why; a KV cache too small for one full-length sequence: --engine vllm stops
    with one line naming the flag."""
    heads4 = tiny_dir(tmp_path / "heads4", heads=4)
    r = run_train("--model", heads4)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "engine transformers" in r.stdout and "warning" not in r.stdout
    r = run_train("--model", heads4, auto_hf_below=0)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "warning: --engine auto:" in r.stdout and "head_dim=16" in r.stdout
    wide = tiny_dir(tmp_path / "wide", hidden=128)
    r = run_train("--engine", "vllm", "--kv_cache_mb", "1", "--model", wide)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: --engine vllm: KV cache too small") and "--kv_cache_mb" in last


def test_train_with_vllm_logp_every_and_tis(tmp_path):
    """train.py on the vLLM engine: logp_gap from one sample in engine.LOGP_EVERY (8), and --tis_cap,
    which weighs every token by its rollout log-prob, gets them for every sample. The set-up line and
    --eval_only's seconds line say how vLLM started."""
    for flags in ([], ["--tis_cap", "2"]):
        r = run_train("--engine", "vllm", "--out_dir", str(tmp_path / str(len(flags))), *flags)
        assert r.returncode == 0, r.stderr[-2000:]
        m = json.loads((tmp_path / str(len(flags)) / "metrics.jsonl").read_text().splitlines()[-1])
        assert 0 < m["logp_gap"] < 1e-4 and ("tis_weight" in m) == bool(flags)  # 0: no log-probs came
        start = r"set-up \(s\): .*model and engine [\d.]+ \(vLLM's start [\d.]+, \+\d+ compile"
        assert re.search(start, r.stdout)
    model = str(tmp_path / "0" / "model")  # --eval_only's seconds line says it too
    r = run_train("--engine", "vllm", "--eval_only", "1", "--model", model, "--out_dir", str(tmp_path / "ev"))
    seconds = r"seconds: model and engine [\d.]+ \(vLLM's start [\d.]+, \+\d+ compile"
    assert re.search(seconds, r.stdout), r.stderr[-2000:]
