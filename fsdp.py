"""torchrun + FSDP2 for train.py: the attention kernel on GPU, process group set-up, sharding, LoRA,
token balancing across ranks, collectives and the full-weight gather for the engine (which the
engine's weight push and checkpoint.py's HF export read).

A plain CPU run never joins a process group: every function here is then a no-op or the plain
single-process version, so train.py reads the same either way.
"""

import datetime
import os
import socket

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

PACKED_ATTN = ("flash_attention_2", "torch_varlen")  # implementations that take packed rows


# ---- attention for the update on GPU: which kernel, and packed (varlen) sequences without flash-attn ----
def attn_implementation(device):
    """flash-attn 2 where it is installed, else torch's own varlen flash kernel (torch >= 2.10), both
    on packed rows; else SDPA on left-padded rows. On CUDA, cuDNN's SDPA is turned off: with a
    padding mask it spent ~25 ms of CPU per call on an H200 while the GPU idled (measured with
    `python -m bench.update --profile 1`); SDPA's other kernels do not."""
    if device.type != "cuda":
        return "sdpa"
    torch.backends.cuda.enable_cudnn_sdp(False)
    if flash_attn_2():
        return "flash_attention_2"
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401  (torch >= 2.10)
    except ImportError:
        return "sdpa"
    register_varlen()
    return "torch_varlen"


def flash_attn_2():
    """Is flash-attn 2 installed? The module name alone does not say: flash-attn 4 installs a
    `flash_attn` package too (flash_attn.cute), without the kernels transformers' flash_attention_2 calls."""
    import importlib.metadata
    import importlib.util

    if importlib.util.find_spec("flash_attn") is None:
        return False
    try:
        return importlib.metadata.version("flash-attn").split(".")[0] == "2"
    except importlib.metadata.PackageNotFoundError:
        return False


def register_varlen():
    """Make attn_implementation="torch_varlen" known to transformers (attention and its masks)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register("torch_varlen", _varlen_attention)
    AttentionMaskInterface.register("torch_varlen", _varlen_mask)


def _varlen_mask(*args, attention_mask=None, **kw):
    """No mask for a packed row (its cu_seq_lens delimit the sequences) or an unpadded one (causal);
    SDPA's mask for padded rows (generation from this model), which _varlen_attention hands to SDPA."""
    from transformers.masking_utils import sdpa_mask

    return None if attention_mask is None else sdpa_mask(*args, attention_mask=attention_mask, **kw)


def _varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
    """A transformers attention function for one packed row: q (1, Hq, T, D), k/v (1, Hkv, T, D)
    and cu_seq_lens_q/k (make_batch) -> causal attention within each sequence, (1, T, Hq, D)."""
    if "cu_seq_lens_q" not in kw:  # not a packed row (generation with a KV cache, padded rows): SDPA
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kw
        )
    from torch.nn.attention.varlen import varlen_attn

    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # (T, H, D)
    if k.shape[1] != q.shape[1]:  # GQA
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    out = varlen_attn(
        q,
        k,
        v,
        kw["cu_seq_lens_q"],
        kw["cu_seq_lens_k"],
        kw["max_length_q"],
        kw["max_length_k"],
        scale=scaling,
        window_size=(-1, 0),
    )  # (-1, 0) = causal
    return out[None], None


_DIST = False  # set by setup_dist; not dist.is_initialized(): an in-process vLLM makes its own group


def dist_on():
    """Did this process join a torchrun / FSDP2 process group (setup_dist)?"""
    return _DIST


def setup_dist(cfg):
    """-> (rank, world, device). Under torchrun (RANK set): NCCL on GPU, gloo on CPU. A plain
    `python train.py` on a GPU is rank 0 of a world of 1 (on $MASTER_PORT, else a free port), so it
    takes the same FSDP2 (bf16) path; on CPU it stays a plain single process."""
    cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if "RANK" not in os.environ and not cuda:
        return 0, 1, torch.device("cpu")
    if "RANK" not in os.environ:
        os.environ.update(
            RANK="0",
            WORLD_SIZE="1",
            LOCAL_RANK="0",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=os.environ.get("MASTER_PORT") or str(free_port()),
        )
    device = torch.device(f"cuda:{int(os.environ['LOCAL_RANK'])}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    # rank 0 evaluates (ALFWorld: many minutes) while the others wait at a barrier: a long timeout
    dist.init_process_group(
        "nccl" if cuda else "gloo", device_id=device if cuda else None, timeout=datetime.timedelta(hours=2)
    )
    global _DIST
    _DIST = True
    return dist.get_rank(), dist.get_world_size(), device


def free_port():
    """A TCP port free on this host now (the OS picks it): a fixed one made a second run on the same
    host fail with EADDRINUSE."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def all_gather(obj):
    """Every rank's obj (any picklable), in rank order: [obj] when not distributed."""
    if not _DIST:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def all_reduce(x, op="sum"):
    """A float/int (or tensor) summed or maxed over ranks; itself when not distributed."""
    if not _DIST:
        return x
    t = torch.as_tensor(x, dtype=torch.float64, device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return t.item() if not torch.is_tensor(x) else t


def shard(model, device, grad_ckpt=False, reshard_after_forward=None, compile_layers=False):
    """FSDP2: each decoder layer is its own unit, then the root (embeddings, head). On GPU, bf16
    parameters and compute with fp32 gradient reduction; the sharded fp32 master weights are what
    AdamW updates, so its state is fp32 too. Without a process group (plain CPU run) only grad_ckpt
    and compile_layers apply.
    reshard_after_forward (None = only when the world has several ranks): free each gathered layer
    after its forward and gather it again for the backward. In a world of one rank there is nothing
    to save (its shard is the whole layer) and the second gather costs time: SmolLM2-135M's update
    on an H200, 32768-token micro-batches, 93k -> 103k tokens/s without it (bench/update.py).
    compile_layers: torch.compile each decoder layer's forward (dynamic shapes: micro-batches differ
    in length), which fuses its elementwise work (norms, RoPE, SiLU, casts); the module and its
    parameter names stay as they are, so checkpoints and weight pushes do not change."""
    layers = decoder_layers(model)
    if compile_layers:
        for layer in layers:
            layer.forward = torch.compile(layer.forward, dynamic=True)
        if not model.get_input_embeddings().weight.requires_grad:  # frozen (LoRA): see _input_needs_grad
            model.get_input_embeddings().register_forward_hook(_input_needs_grad)
    if reshard_after_forward is None:
        reshard_after_forward = dist.is_initialized() and dist.get_world_size() > 1
    if grad_ckpt:
        for layer in layers:
            layer.forward = checkpointed(layer.forward)
    if not _DIST:
        return model
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if device.type == "cuda"
        else MixedPrecisionPolicy()
    )
    for layer in layers:
        fully_shard(layer, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    return fully_shard(model, mp_policy=mp, reshard_after_forward=reshard_after_forward)


def _input_needs_grad(module, args, out):
    """With frozen embeddings (--lora_rank) the first layer's input alone does not require grad in a
    training pass, and requires_grad is in a compiled graph's guards, so the first layer compiled a
    graph (and its backward) of its own: 4 graphs instead of 3 for the old log-probs, the reference's
    and the step (tests/test_dist.py). Marking it costs one input gradient more, at the first layer."""
    if torch.is_grad_enabled():
        out.requires_grad_(True)


def checkpointed(forward):
    """A layer's forward whose activations are recomputed in the backward instead of kept (when grad is
    on). Not transformers' gradient_checkpointing_enable: that acts only in train mode, and a model
    from from_pretrained is in eval mode (no dropout: the same log-probs in every pass), where it
    silently kept every activation (SmolLM2, a 1024-token fp32 forward on CPU: 1,748 MB of activations
    kept for the backward, 74 MB with this: ../LOG.md; tests/test_dist.py checks the saving)."""

    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def decoder_layers(model):
    """The decoder layers of any HF causal LM (Llama/Qwen's model.layers, GPT-2's transformer.h, ...):
    the outermost modules whose class (or a base class: FSDP2 subclasses a sharded one) transformers
    names in the model's _no_split_modules, the blocks it never splits across devices. A LoRA (peft)
    model's are its base model's. ValueError naming the class where it lists none."""
    base = getattr(model, "get_base_model", lambda: model)()
    names, layers = set(getattr(base, "_no_split_modules", None) or ()), []
    for name, module in base.named_modules():
        if any(c.__name__ in names for c in type(module).__mro__) and not any(
            name.startswith(f"{outer}.") for outer, _ in layers
        ):
            layers.append((name, module))
    if not layers:
        raise ValueError(
            f"{type(base).__name__}: no decoder layers found (its _no_split_modules names "
            f"{sorted(names) or 'none'}); FSDP2 sharding needs them"
        )
    return [module for _, module in layers]


def add_lora(model, rank):
    """LoRA adapters (peft) of this rank on every linear layer of the decoder, alpha = 2 x rank; the
    base weights freeze. The KL reference is then the same model with its adapters off."""
    from peft import LoraConfig, get_peft_model

    return get_peft_model(
        model, LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules="all-linear")
    )


def _full(p):
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()


def balance_tokens(samples, *per_sample):
    """Move whole step samples (with their advantages, and whatever else per_sample holds: one entry
    per sample, e.g. --algo ppo's value targets; None stays None) between ranks so that each rank
    trains on about the same number of tokens: ranks own whole env groups, and their episodes differ
    in length, so their token counts do too, and the update waits for the slowest. Every rank computes
    the same plan from the gathered lengths: a rank keeps its longest samples up to the mean, its
    surplus goes to whichever rank is lightest (longest first); only the moving samples travel.
    -> (samples, *per_sample) of this rank."""
    if not _DIST:
        return (samples, *per_sample)
    world, rank = dist.get_world_size(), dist.get_rank()
    lengths = [None] * world
    dist.all_gather_object(lengths, [len(x.prompt_ids) + len(x.response_ids) for x in samples])
    target = sum(map(sum, lengths)) / world
    load, keep, pool = [0] * world, [], []
    for r, lens in enumerate(lengths):
        mine = []
        for i in sorted(range(len(lens)), key=lambda i: -lens[i]):
            if load[r] + lens[i] <= target or not mine:
                load[r] += lens[i]
                mine.append(i)
            else:
                pool.append((lens[i], r, i))
        keep.append(set(mine))
    dest = {}
    for n, r, i in sorted(pool, reverse=True):
        to = min(range(world), key=lambda w: load[w])
        load[to] += n
        dest[(r, i)] = to
    cols = [c for c in per_sample if c is not None]
    outgoing = [
        (dest[(rank, i)], samples[i], [c[i] for c in cols])
        for i in range(len(samples))
        if i not in keep[rank]
    ]
    moved = [None] * world
    dist.all_gather_object(moved, outgoing)
    pairs = [(samples[i], [c[i] for c in cols]) for i in sorted(keep[rank])] + [
        (x, a) for out in moved for to, x, a in out if to == rank
    ]
    new_cols = iter([np.asarray([a[k] for _, a in pairs]) for k in range(len(cols))])
    return ([x for x, _ in pairs], *(None if c is None else next(new_cols) for c in per_sample))


def full_parameters(model):
    """(HF name, full tensor) per parameter, gathered one at a time from the shards (never a whole
    state dict on one rank): every rank must walk this in the same order (it is collective). With
    LoRA, each adapted weight comes merged, W + (alpha / r) B A, under the base model's name."""
    if not hasattr(model, "get_base_model"):
        for name, p in model.named_parameters():
            yield name, _full(p)
        return
    base = model.get_base_model()
    lora = {
        f"{n}.base_layer.weight": m for n, m in base.named_modules() if "default" in getattr(m, "lora_A", {})
    }
    for name, p in base.named_parameters():
        if ".lora_" in name:
            continue
        w = _full(p)
        if name in lora:
            m = lora[name]
            w = w + m.scaling["default"] * (
                _full(m.lora_B["default"].weight) @ _full(m.lora_A["default"].weight)
            ).to(w.dtype)
        yield name.replace(".base_layer.", "."), w


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def all_finite(tensors):
    """Are all these tensors (this rank's shards) finite on every rank?"""
    bad = sum(int(not bool(torch.isfinite(_local(t).detach()).all())) for t in tensors)
    return not all_reduce(bad, "max")


def finish_dist(engine):
    """Leave the process group, all ranks together (rank 0 may still be evaluating); a vLLM engine
    tears the groups down itself at exit (destroying them first makes its shutdown fail)."""
    if _DIST and not engine.tears_down_dist:
        dist.barrier()
        dist.destroy_process_group()


def barrier():
    if _DIST:
        dist.barrier()
