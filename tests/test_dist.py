"""FSDP2 / torchrun on CPU (gloo), the micro-batch layouts, and checkpoint/resume."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import fsdp
import ppo
import train
from rollout import Sample
from tiny import build_tiny

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def torchrun(*args):
    """2 ranks on a port free at this call (two suites on one machine must not collide, and one port
    picked at import could be taken by the time a later test ran)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={fsdp.free_port()}",
        *args,
    ]


ENV = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
sys.path.insert(0, os.path.join(ROOT, "tests"))
from dist_update import fixed_batch  # noqa: E402


def test_packed_and_padded_micro_batches_give_the_same_log_probs():
    """Left-padded rows (SDPA) and one packed row (the flash-attn varlen layout; transformers masks
    it per sequence for SDPA too) must score every response token the same."""
    model, tok = build_tiny("treasure", seed=0)
    samples, _ = fixed_batch()
    idx = list(range(len(samples)))
    padded = ppo.response_logprobs(model, ppo.make_batch(samples, idx, tok.pad_token_id, False), "cpu")
    packed = ppo.response_logprobs(model, ppo.make_batch(samples, idx, tok.pad_token_id, True), "cpu")
    one = torch.cat(
        [ppo.response_logprobs(model, ppo.make_batch(samples, [i], 0, False), "cpu")[0] for i in idx]
    )
    assert padded[0].shape == (sum(len(s.response_ids) for s in samples),)
    assert torch.allclose(padded[0], one, atol=1e-5) and torch.allclose(packed[0], one, atol=1e-5)
    assert torch.allclose(padded[1], packed[1], atol=1e-5)


def test_compiled_layers_score_and_train_like_plain_ones():
    """--compile 1 (fsdp.shard(compile_layers=True)): torch.compile each decoder layer. The same
    log-probs and gradients for both micro-batch layouts (micro-batches of other lengths reuse the
    dynamic graph), and the parameter names that checkpoints and weight pushes use are unchanged."""
    samples, _ = fixed_batch()
    idx = list(range(len(samples)))
    plain, tok = build_tiny("treasure", seed=0)
    compiled, _ = build_tiny("treasure", seed=0)
    names = [n for n, _ in compiled.named_parameters()]
    compiled = fsdp.shard(compiled, torch.device("cpu"), compile_layers=True)
    assert [n for n, _ in compiled.named_parameters()] == names
    for packed in (False, True):
        for sub in (idx, idx[:3]):
            batch = ppo.make_batch(samples, sub, tok.pad_token_id, packed)
            (a, _), (b, _) = (ppo.response_logprobs(m, batch, "cpu") for m in (plain, compiled))
            assert torch.allclose(a, b, atol=1e-5)
    for m in (plain, compiled):
        m.zero_grad()
        ppo.response_logprobs(m, ppo.make_batch(samples, idx, tok.pad_token_id, True), "cpu")[
            0
        ].sum().backward()
    for p, q in zip(plain.parameters(), compiled.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-5)


def saved_bytes_and_grads(model, batch):
    """The bytes autograd keeps for the backward of one micro-batch's log-probs, and the gradients."""
    kept = [0]

    def pack(t):
        kept[0] += t.numel() * t.element_size()
        return t

    model.zero_grad()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logp = ppo.response_logprobs(model, batch, "cpu")[0]
    logp.sum().backward()
    return kept[0], [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def test_grad_ckpt_recomputes_in_eval_mode_with_the_same_gradients():
    """--grad_ckpt 1 on an eval-mode model (train.py's: from_pretrained returns one; transformers' own
    checkpointing acts only in train mode and so kept every activation): fsdp.shard's checkpointed
    layers keep a fraction of the bytes for the backward, and give the same gradients."""
    samples, _ = fixed_batch()
    plain, tok = build_tiny("treasure", seed=0, layers=4)
    ckpt, _ = build_tiny("treasure", seed=0, layers=4)
    ckpt = fsdp.shard(ckpt.eval(), torch.device("cpu"), grad_ckpt=True)
    batch = ppo.make_batch(samples, list(range(len(samples))), tok.pad_token_id, True)
    (kept_plain, g_plain), (kept_ckpt, g_ckpt) = (
        saved_bytes_and_grads(m, batch) for m in (plain.eval(), ckpt)
    )
    assert kept_ckpt < kept_plain / 2, (kept_ckpt, kept_plain)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(g_plain, g_ckpt))


def test_compiled_layers_with_lora_train_like_plain_ones_and_turn_adapters_off():
    """--compile 1 with --lora_rank (not auto's choice, not measured on a GPU): compiled decoder
    layers holding LoRA adapters give the plain model's log-probs and adapter gradients, and
    disable_adapter (the KL reference) still turns the adapters off under compile. The training pass
    compiles one graph for all layers: the frozen embeddings' output is marked as needing grad, or
    the first layer's input would differ from the others' in its guards and compile a second."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # no graphs (or recompile limits) left by earlier tests
    samples, _ = fixed_batch()
    batch_of = lambda tok: ppo.make_batch(samples, list(range(len(samples))), tok.pad_token_id, False)  # noqa: E731
    models = []
    for compile_layers in (False, True):
        model, tok = build_tiny("treasure", seed=0)
        model = fsdp.add_lora(model, 2)
        for n, p in model.named_parameters():  # B = 0 at init: move it so the adapters change the output
            if "lora_B" in n:
                p.data.copy_(torch.linspace(-0.3, 0.3, p.numel()).view_as(p))
        models.append(fsdp.shard(model, torch.device("cpu"), compile_layers=compile_layers))
    outs, graphs = [], []
    for m in models:
        before = counters["stats"]["unique_graphs"]
        lp = ppo.response_logprobs(m, batch_of(tok), "cpu")[0]
        lp.sum().backward()
        graphs.append(counters["stats"]["unique_graphs"] - before)
        with torch.no_grad(), m.disable_adapter():
            outs.append((lp.detach(), ppo.response_logprobs(m, batch_of(tok), "cpu")[0]))
    (a, a_off), (b, b_off) = outs
    assert torch.allclose(a, b, atol=1e-5) and torch.allclose(a_off, b_off, atol=1e-5)
    assert not torch.allclose(a, a_off, atol=1e-3)  # the adapters were really off
    assert graphs == [0, 1], graphs  # plain: none; compiled: one graph for every layer's training pass
    grads = [[p.grad for p in m.parameters() if p.requires_grad] for m in models]
    assert grads[0] and all(torch.allclose(x, y, atol=1e-5) for x, y in zip(*grads))


def test_checkpointed_compiled_lora_layers_keep_under_a_tenth_for_the_same_gradients():
    """bench.pair's arms (--lora_rank 4 --compile 1 --grad_ckpt 1): checkpointed compiled layers with
    LoRA adapters keep < 1/10 of the bytes the compiled layers keep for the backward, for the same
    log-probs and adapter gradients."""
    samples, _ = fixed_batch()
    runs = []
    for ckpt in (False, True):
        torch._dynamo.reset()
        model, tok = build_tiny("treasure", seed=0, layers=4)
        model = fsdp.add_lora(model, 2)
        for n, p in model.named_parameters():  # B = 0 at init: move it so the adapters change the output
            if "lora_B" in n:
                p.data.copy_(torch.linspace(-0.3, 0.3, p.numel()).view_as(p))
        model = fsdp.shard(model.eval(), torch.device("cpu"), grad_ckpt=ckpt, compile_layers=True)
        kept, grads = saved_bytes_and_grads(
            model, ppo.make_batch(samples, list(range(8)), tok.pad_token_id, True)
        )
        runs.append((kept, [g for g, p in zip(grads, model.parameters()) if p.requires_grad]))
    (kept_plain, g_plain), (kept_ckpt, g_ckpt) = runs
    assert kept_ckpt < kept_plain / 10, (kept_ckpt, kept_plain)
    assert g_plain and all(torch.allclose(a, b, atol=1e-5) for a, b in zip(g_plain, g_ckpt))


def test_any_causal_lm_shards_a_tiny_gpt2(monkeypatch):
    """fsdp.shard finds the decoder layers of any HF causal LM (its _no_split_modules), not only
    Llama/Qwen's model.layers: a tiny random GPT-2 (transformer.h) shards per block in a gloo world
    of one, in this process, and computes what it did before."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(
            vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0
        )
    ).eval()  # eval: no dropout
    ids = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        want = model(ids).logits
    blocks = list(model.transformer.h)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        monkeypatch.setattr(fsdp, "_DIST", True)
        sharded = fsdp.shard(model, torch.device("cpu"))
        assert all(isinstance(b, FSDPModule) for b in blocks) and isinstance(sharded, FSDPModule)
        with torch.no_grad():
            assert torch.allclose(sharded(ids).logits, want, atol=1e-5)
    finally:
        dist.destroy_process_group()
    llama = build_tiny("treasure", seed=0)[0]  # and the tiny Llama's are still model.layers
    assert fsdp.decoder_layers(llama) == list(llama.model.layers)


def test_entropy_is_on_the_graph_only_with_an_entropy_bonus():
    """Without --entropy_coef the per-token entropy (over the whole vocabulary) is a metric: no graph,
    no backward work; with it, it must carry the gradient of the bonus."""
    model, tok = build_tiny("treasure", seed=0)
    samples, _ = fixed_batch()
    batch = ppo.make_batch(samples, list(range(len(samples))), tok.pad_token_id, False)
    logp, ent = ppo.response_logprobs(model, batch, "cpu")
    assert logp.requires_grad and not ent.requires_grad
    assert ppo.response_logprobs(model, batch, "cpu", entropy_grad=True)[1].requires_grad
    # the log-prob passes (old, reference) skip it: the same log-probs, no entropy
    bare, none = ppo.response_logprobs(model, batch, "cpu", entropy=False)
    assert none is None and torch.equal(bare, logp) and ent.shape == logp.shape and (ent > 0).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch's varlen attention needs a CUDA GPU")
def test_gpu_packed_varlen_and_padded_sdpa_give_the_same_loss():
    """On GPU the update packs rows for torch's varlen flash kernel (fsdp.attn_implementation); the
    padded SDPA path must give the same per-token log-probs and the same loss, within bf16 noise."""
    import random

    from transformers import Qwen2Config, Qwen2ForCausalLM

    from fsdp import attn_implementation

    dev = torch.device("cuda")
    impl = attn_implementation(dev)
    if impl == "sdpa":
        pytest.skip("no packed attention kernel in this torch (needs torch >= 2.10 or flash-attn)")
    cfg = dict(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1000,
    )
    torch.manual_seed(0)
    padded_model = Qwen2ForCausalLM(Qwen2Config(**cfg, attn_implementation="sdpa")).to(dev, torch.bfloat16)
    packed_model = Qwen2ForCausalLM(Qwen2Config(**cfg, attn_implementation=impl)).to(dev, torch.bfloat16)
    packed_model.load_state_dict(padded_model.state_dict())
    rng = random.Random(0)
    samples = [
        Sample(
            [rng.randrange(1000) for _ in range(rng.randint(20, 200))],
            [rng.randrange(1000) for _ in range(rng.randint(1, 40))],
            [],
            0.0,
            False,
            True,
            0,
            i,
            "",
            0,
        )
        for i in range(12)
    ]
    idx = list(range(len(samples)))
    lp_pad, _ = ppo.response_logprobs(padded_model, ppo.make_batch(samples, idx, 0, False), dev)
    lp_pack, _ = ppo.response_logprobs(packed_model, ppo.make_batch(samples, idx, 0, True), dev)
    assert lp_pad.shape == lp_pack.shape == (sum(len(s.response_ids) for s in samples),)
    diff = (lp_pad - lp_pack).abs()  # a mask leaking across packed sequences would be ~0.1-1 per token
    assert diff.max() < 0.1 and diff.mean() < 0.01 and abs(lp_pad.mean() - lp_pack.mean()) < 2e-3


@pytest.mark.parametrize(
    "installed, kernel", [("2.8.3", "flash_attention_2"), (None, "torch_varlen"), ("4.0.0b4", "torch_varlen")]
)
def test_flash_attn_2_is_told_by_its_distribution_version(monkeypatch, installed, kernel):
    """flash-attn 4 also installs a `flash_attn` module: only the flash-attn 2 distribution counts,
    else torch's varlen kernel (the GPU choice, made here with the lookups faked)."""
    import importlib.metadata
    import importlib.util

    import fsdp

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: object() if name == "flash_attn" else real_find_spec(name, *a),
    )

    def version(name):
        if installed is None or name not in ("flash-attn", "flash_attn"):
            raise importlib.metadata.PackageNotFoundError(name)
        return installed

    monkeypatch.setattr(importlib.metadata, "version", version)
    assert fsdp.attn_implementation(torch.device("cuda")) == kernel


def test_single_process_run_rendezvous_on_a_free_port(monkeypatch):
    """`python train.py` on a GPU makes its own world of 1: with MASTER_PORT unset it must pick a free
    port (a fixed 29511 made a second run on the same host die with EADDRINUSE); a set one is kept.
    The GPU and the process group are faked: only the port is under test."""
    import socket

    import fsdp

    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    monkeypatch.setattr(os, "environ", env)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(fsdp.dist, "init_process_group", lambda *a, **k: None)
    monkeypatch.setattr(fsdp.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(fsdp.dist, "get_world_size", lambda: 1)
    monkeypatch.setattr(fsdp, "_DIST", False)
    with socket.socket() as held:  # another run's rendezvous on the old fixed port
        held.bind(("127.0.0.1", 29511))
        held.listen()
        assert fsdp.setup_dist(train.Config()) == (0, 1, torch.device("cuda:0"))
        port = int(env["MASTER_PORT"])
        assert port != 29511
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free
    del env["RANK"]
    env["MASTER_PORT"] = "29577"
    fsdp.setup_dist(train.Config())
    assert env["MASTER_PORT"] == "29577"


def test_varlen_attention_generates_like_sdpa_on_cpu():
    """The torch_varlen implementation (GPU update) hands every call that is not a packed row to SDPA:
    padded generation from such a model gives SDPA's tokens (this part runs on CPU too)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from fsdp import register_varlen

    register_varlen()
    cfg = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=50,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    ref = Qwen2ForCausalLM(Qwen2Config(**cfg, attn_implementation="sdpa")).eval()
    var = Qwen2ForCausalLM(Qwen2Config(**cfg, attn_implementation="torch_varlen")).eval()
    var.load_state_dict(ref.state_dict())
    ids = torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]])
    mask = (ids != 0).long()
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(ref.generate(ids, **kw), var.generate(ids, **kw))


def test_micro_batches_respect_the_token_budget():
    samples, _ = fixed_batch()
    for packed in (False, True):
        mbs = ppo.micro_batches(samples, range(len(samples)), 40, packed)
        assert sorted(i for mb in mbs for i in mb) == list(range(len(samples)))
        for mb in mbs:
            lens = [len(samples[i].prompt_ids) + len(samples[i].response_ids) for i in mb]
            assert len(mb) == 1 or (sum(lens) if packed else max(lens) * len(lens)) <= 40


@pytest.mark.parametrize("ckpt", [True, False], ids=["grad_ckpt", "no_ckpt"])
def test_two_gloo_ranks_update_like_one_process(tmp_path, ckpt):
    """One update on a fixed batch: FSDP2 over 2 ranks (3/4 and 1/4 of the samples, then token
    balancing), with activation checkpointing and without, == one process without."""
    script = os.path.join(ROOT, "tests", "dist_update.py")
    subprocess.run([sys.executable, script, str(tmp_path / "one.pt")], check=True, env=ENV, timeout=300)
    ranks = subprocess.run(
        torchrun(script, str(tmp_path / "two.pt"), *["--grad_ckpt"] * ckpt),
        env=ENV,
        timeout=300,
        capture_output=True,
        text=True,
    )
    where = "\n".join(
        line for line in ranks.stderr.splitlines() if "dist_update rank" in line or "terminate" in line
    )
    assert ranks.returncode == 0, where + "\n...\n" + ranks.stderr[-3000:]  # why and where it failed
    one, two = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    init, _ = build_tiny("treasure", seed=0)
    init = dict(init.named_parameters())
    assert abs(one["loss"] - two["loss"]) < 1e-5 and abs(one["grad_norm"] - two["grad_norm"]) < 1e-4
    moved = max((one["weights"][k] - init[k]).abs().max().item() for k in init)
    diff = max((one["weights"][k] - two["weights"][k]).abs().max().item() for k in init)
    assert moved > 5e-3 and diff < 5e-4, (moved, diff)  # lr 1e-2: weights moved, and moved alike
    # the ranks started at 3/4 vs 1/4 of the tokens; balanced, they differ by at most one sample
    t0, t1 = two["tokens"]
    assert abs(t0 - t1) <= two["longest"] and t0 + t1 == sum(one["tokens"]), two["tokens"]


def run_train(args, **kw):
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "train.py"), *args],
        env=ENV,
        cwd=ROOT,
        capture_output=True,
        text=True,
        **kw,
    )


SMALL = ["--n_groups", "4", "--group_size", "2", "--eval_episodes", "8", "--threads", "1"]


def test_torchrun_two_ranks_trains_end_to_end(tmp_path):
    """vLLM where installed (one engine per rank; auto would pick transformers for the tiny model on
    CPU) under torchrun, gloo."""
    import importlib.util

    engine = ["--engine", "vllm"] if importlib.util.find_spec("vllm") else []
    out = subprocess.run(
        torchrun(
            os.path.join(ROOT, "train.py"), *SMALL, *engine, "--iterations", "2", "--out_dir", str(tmp_path)
        ),
        env=ENV,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1].startswith("held-out success")
    assert len(open(tmp_path / "metrics.jsonl").readlines()) == 2
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tmp_path / "model")


def test_bad_flag_under_torchrun_is_printed_once(tmp_path):
    """Every rank checks the flags; only rank 0 says what is wrong (it used to be once per rank)."""
    out = subprocess.run(
        torchrun(os.path.join(ROOT, "train.py"), "--eval_every", "0", "--out_dir", str(tmp_path)),
        env=ENV,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode != 0 and out.stderr.count("error: --eval_every 0") == 1, out.stderr[-2000:]


def test_kill_then_resume_loses_nothing(tmp_path):
    args = [*SMALL, "--engine", "hf", "--iterations", "8", "--eval_every", "2", "--out_dir", str(tmp_path)]
    proc = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "train.py"), *args],
        env=ENV,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    meta = tmp_path / "ckpt" / "meta.json"
    deadline = time.time() + 300
    while time.time() < deadline and not (meta.exists() and json.load(open(meta))["iteration"] >= 4):
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)  # mid-run, maybe mid-write: the last good checkpoint must survive
    proc.wait()
    killed_at = json.load(open(meta))["iteration"]
    assert 4 <= killed_at < 8
    bad = run_train([*args, "--resume", "1", "--lr", "0.5"], timeout=120)
    assert bad.returncode != 0 and "--lr" in bad.stderr.strip().splitlines()[-1]
    out = run_train([*args, "--resume", "1"], timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"resumed from {tmp_path}/ckpt at iteration {killed_at}" in out.stdout
    its = [json.loads(l)["iteration"] for l in open(tmp_path / "metrics.jsonl")]
    assert its == list(range(1, 9)) and json.load(open(meta))["iteration"] == 8
