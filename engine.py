"""The generation engines, behind one interface: transformers `generate` and vLLM in this process.

Every engine has every method below (a no-op where it has nothing to do), so no caller asks which
engine it has:
    generate(prompts, temperature, top_p, max_tokens) -> [(ids, logprobs)]   one batch, in order
    submit(key, prompt, temperature, top_p, max_tokens); poll(wait_all) -> [(key, ids, logprobs)]
        the same one prompt at a time: poll advances generation and returns what finished (the
        rollout overlaps env steps with it); `pending` counts what is submitted and not returned
    push_weights(named_tensors)    the trainer's weights in, after every update
    check_fits(prompts, max_tokens)  a prompt past the model's context is one line, not a crash
    sleep(); wake()                hand the engine's GPU memory to the update and take it back
    close()
    name ("transformers" | "vllm"), own_model (a model copy to export, else None), max_len
        (the model's context, prompt + reply), shares_layers (generates on the trainer's own layers,
        which compiling them would break), tears_down_dist (vLLM ends torch.distributed itself)
Token ids in, token ids out; temperature 0 means greedy; a response keeps its EOS (it is trained
too); logprobs is None where the engine was not asked for them (VLLMEngine's logp_every).
"""

import contextlib
import copy
import hashlib
import os
import random
import shutil
import sys
import tempfile
import time

import numpy as np
import torch
from transformers import GenerationConfig

ENGINES = ("auto", "hf", "vllm")  # --engine
# auto on CPU: below this many parameters, transformers. Measured on the 2-core machine: for the tiny
# default (0.13M) vLLM's CPU engine takes 16-40 s to start and spends 2.7x the CPU time per step sample
# generating, its per-step overhead larger than the model's compute; for SmolLM2-135M vLLM was faster
# (LOG.md). The cut between the two measured sizes is a guess (docs/training.md).
AUTO_HF_ON_CPU = 10**7
# train.py's vLLM engine: rollout log-probs for one sample in 8 (logp_gap's); --tis_cap asks for all.
# Per-token log-prob bookkeeping is Python work on every decode step: one in 8 made 1.06x the tokens/s
# of all (bench/README.md)
LOGP_EVERY = 8


def context_length(config):
    """The model's context in tokens (prompt + reply), from its HF config; None where it names none."""
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        if isinstance(getattr(config, key, None), int):
            return getattr(config, key)
    return None


class Engine:
    """What every engine has. This base generates whole batches: submit queues a prompt, poll
    generates all that are queued (one batch per sampling setting). A subclass writes generate and
    overrides what it does differently; the rest are no-ops."""

    name, max_len, own_model, shares_layers, tears_down_dist = "engine", None, None, False, False
    queue, started = (), ""  # started: how the start went, for the set-up line (vLLM's seconds, cache)

    def generate(self, prompts, temperature=1.0, top_p=1.0, max_tokens=16):
        raise NotImplementedError

    def submit(self, key, prompt, temperature=1.0, top_p=1.0, max_tokens=16):
        self.queue = self.queue or []  # the class's empty tuple until the first prompt
        self.queue.append((key, prompt, (temperature, top_p, max_tokens)))

    def poll(self, wait_all=False):
        """Generate everything submitted so far -> [(key, ids, logprobs)]."""
        queue, self.queue, done = self.queue, [], []
        for setting in dict.fromkeys(s for _, _, s in queue):
            batch = [(k, p) for k, p, s in queue if s == setting]
            outs = self.generate([p for _, p in batch], *setting)
            done += [(k, ids, lps) for (k, _), (ids, lps) in zip(batch, outs)]
        return done

    @property
    def pending(self):
        return len(self.queue)

    def push_weights(self, named_tensors):
        pass

    def check_fits(self, prompts, max_tokens):
        """A prompt plus its reply must fit the model's context (max_len): else one line naming what
        shrinks it (nothing is cut silently)."""
        longest = max(map(len, prompts))
        if self.max_len and longest + max_tokens > self.max_len:
            raise SystemExit(
                f"error: a step's prompt is {longest} tokens and its reply up to {max_tokens}, over the "
                f"model's context of {self.max_len}: shorten it with --memory window (a smaller "
                f"--memory_k), fewer steps (--env_args max_steps=N) or --max_response_tokens"
            )

    def sleep(self):
        pass

    def wake(self):
        pass

    def close(self):
        pass


class HFEngine(Engine):
    """transformers `generate` on the training model itself (shares its weights: no push needed)."""

    name, shares_layers = "transformers", True

    def __init__(self, model, tokenizer, copy_dtype=None):
        """copy_dtype=a torch dtype: generate from a private copy of the model in that dtype (the
        trainer's is sharded); push_weights then copies the trainer's weights in. None: share the
        training module."""
        self.model, self.tok = model, tokenizer
        self.shares_layers = copy_dtype is None
        if not self.shares_layers:
            self.model = self.own_model = copy.deepcopy(model).to(copy_dtype).eval().requires_grad_(False)
        self.max_len = context_length(model.config)

    def push_weights(self, named_tensors):
        """A shared training module needs nothing (the iterator is not even consumed); a copy gets
        the tensors copied in."""
        if self.own_model is not None:
            params = dict(self.own_model.named_parameters())
            for name, tensor in named_tensors:
                params[name].data.copy_(tensor)

    @torch.no_grad()
    def generate(self, prompts, temperature=1.0, top_p=1.0, max_tokens=16):
        model, pad, eos = self.model, self.tok.pad_token_id, self.tok.eos_token_id
        device = next(model.parameters()).device
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for b, p in enumerate(prompts):  # left padding: every row's response starts at `width`
            ids[b, width - len(p) :] = torch.tensor(p)
            mask[b, width - len(p) :] = 1
        greedy = temperature == 0
        # sample from the plain logits (at temperature, top_p), which the log-probs below and the
        # trainer score: generate fills every field left unset from model.generation_config (e.g.
        # Qwen2.5-Instruct's repetition_penalty and top_k), so that is swapped for this one meanwhile
        config = GenerationConfig(
            do_sample=not greedy,
            temperature=None if greedy else temperature,
            top_p=None if greedy else top_p,
            top_k=None if greedy else 0,
            max_new_tokens=max_tokens,
            eos_token_id=eos,
            pad_token_id=pad,
            output_logits=True,
            return_dict_in_generate=True,
        )
        was_training, own_config = model.training, model.generation_config
        model.eval()
        model.generation_config = config
        try:
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device))
        finally:
            model.generation_config = own_config
            model.train(was_training)
        seq = out.sequences[:, width:]  # (B, n)
        # log-prob of each sampled token, one position at a time, on the device: not all the logits
        # to the CPU (B x n x vocab floats: 3.4 GB for 134 rows x 128 tokens of a 49k vocab)
        logp = torch.stack(
            [
                torch.log_softmax(step.float() / (temperature or 1.0), -1)
                .gather(-1, seq[:, t, None])
                .squeeze(-1)
                for t, step in enumerate(out.logits)
            ],
            1,
        ).cpu()  # (B, n)
        seq = seq.cpu()
        results = []
        for b in range(len(prompts)):
            row = seq[b].tolist()
            n = row.index(eos) + 1 if eos in row else len(row)  # keep the EOS: it is trained too
            results.append((row[:n], logp[b, :n].tolist()))
        return results


def config_folder(config):
    """vLLM's model folder: the config alone (the weights are pushed after the start). vLLM keys its
    compile cache by this path too (ModelConfig.model), and the trainer's compiled kernels go beside
    (vLLM points TORCHINDUCTOR_CACHE_DIR into that cache). Where this process has a VLLM_CACHE_ROOT
    of its own (bench.pair's arms: one each, carried to the next machine) the folder is named by
    the config's content, so a later start of the same model finds both caches; elsewhere a fresh
    name, as before (runs started together on the default root would compile into one folder)."""
    tmp = tempfile.mkdtemp(prefix="vllm-config-")
    config.save_pretrained(tmp)
    if not os.environ.get("VLLM_CACHE_ROOT"):
        return tmp
    text = open(os.path.join(tmp, "config.json"), "rb").read()
    folder = os.path.join(tempfile.gettempdir(), "vllm-config-" + hashlib.sha256(text).hexdigest()[:16])
    try:
        os.rename(tmp, folder)  # fails where it is there already (an earlier start; another run now)
    except OSError:
        pass
    try:
        if open(os.path.join(folder, "config.json"), "rb").read() == text:
            shutil.rmtree(tmp, ignore_errors=True)
            return folder
    except OSError:
        pass
    return tmp  # a folder of that name holding something else: this start's own, as before


def cache_files(root=None):
    """Files under root, by default vLLM's cache root (VLLM_CACHE_ROOT, else XDG_CACHE_HOME or ~/.cache,
    /vllm). The set-up line shows how many a start added: a start that compiles writes its graphs and
    kernels there, one that finds them should write few (tells whether a carried cache was used). Runs
    that start at once on one root count each other's files too."""
    cache_home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    root = root or os.environ.get("VLLM_CACHE_ROOT") or os.path.join(cache_home, "vllm")
    return sum(len(files) for _, _, files in os.walk(root))


class VLLMEngine(Engine):
    """vLLM in this process, on the training device, with its own copy of the weights.

    Token ids in, token ids out: vLLM never loads the tokenizer (skip_tokenizer_init), so it cannot
    re-tokenise anything, and stops on the tokenizer's EOS like HFEngine. It starts from the model's
    config alone with dummy weights; the real ones arrive through push_weights, as after every update.
    Log-probs are vLLM's "processed" ones: after temperature, like the trainer's recompute (with
    top_p < 1 they are renormalised over the nucleus, the trainer's are not). On CPU: eager, in the
    model's dtype (float32), the configuration measured to match transformers. On GPU: bfloat16, the
    dtype the trainer computes in under FSDP2 (an engine in float32 next to a bf16 trainer is a
    logp_gap of its own) and CUDA graphs for the decode steps; prefill runs eager. With compile
    (train.py's default on a GPU, --compile auto): vLLM's torch.compile of the model too, and CUDA
    graphs for prefill and mixed steps (FULL_AND_PIECEWISE); it adds about a minute at start-up
    (cached for the next run).
    GPU memory: vLLM takes `gpu_memory_utilization` of the GPU, sized by a start-up profiling run
    that fails when other processes change their GPU memory meanwhile (runs sharing a GPU); with
    gpu_memory_utilization 0 it takes a fixed `kv_cache_mb` cache instead and skips that profiling,
    and by default stays awake through the update (`sleep`): on falling asleep vLLM asserts that the
    GPU's free memory went up, which other runs' allocations at that moment break (2 of 7 runs sharing
    an H200 died of it).
    Rollout log-probs come for one prompt in `logp_every` (generate, which is submit + poll:
    positions 0, N, 2N, ... of the call; submit: every N-th submitted; the others get None): vLLM's
    per-token log-prob bookkeeping is Python work on every step (`python -m bench.rollout --gpu`, six
    runs on H100s: one in 8 made 1.06x the tokens/s of all).
    """

    name, tears_down_dist = "vllm", True

    def __init__(
        self, model, eos_id, kv_cache_mb, gpu_memory_utilization, sleep=None, compile=False, logp_every=1
    ):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process: weights pushed by reference
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # its warnings here are noise (no tokenizer)
        from vllm import LLM, SamplingParams
        from vllm.sampling_params import RequestOutputKind

        self.SamplingParams, self.eos, self.logp_every = SamplingParams, eos_id, logp_every
        self.final_only, self.submitted, self.keys = RequestOutputKind.FINAL_ONLY, 0, {}
        self.max_len = context_length(model.config)
        folder = config_folder(model.config)
        cpu = next(model.parameters()).device.type == "cpu"
        self.gpu = not cpu
        self.sleeps = self.gpu and (bool(gpu_memory_utilization) if sleep is None else sleep)
        # vLLM seeds torch/random/numpy globally and makes torch.set_num_threads a no-op when it
        # starts in-process: keep the trainer's RNG streams and thread count (--threads) as they were
        rng, threads, set_threads = (
            (torch.get_rng_state(), random.getstate(), np.random.get_state()),
            torch.get_num_threads(),
            torch.set_num_threads,
        )
        kw = dict(
            skip_tokenizer_init=True,
            load_format="dummy",
            dtype=model.dtype if cpu else torch.bfloat16,
            logprobs_mode="processed_logprobs",
            generation_config="vllm",
            kv_cache_memory_bytes=kv_cache_mb << 20 if cpu or not gpu_memory_utilization else None,
            gpu_memory_utilization=gpu_memory_utilization or 0.01,
            enable_sleep_mode=not cpu,
        )
        # vLLM's compilation modes: 3 = its torch.compile pipeline, 0 = none (graphs still captured)
        graphs = (
            {"mode": 3, "cudagraph_mode": "FULL_AND_PIECEWISE"}
            if compile
            else {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}
        )
        # no second try after a failure on GPU: vLLM's sleep-mode allocator serves one engine per process
        cache, t0 = cache_files(), time.perf_counter()
        try:
            self.llm = (
                LLM(folder, enforce_eager=True, **kw) if cpu else LLM(folder, compilation_config=graphs, **kw)
            )
        finally:
            torch.set_num_threads = set_threads
            set_threads(threads)
            torch.set_rng_state(rng[0]), random.setstate(rng[1]), np.random.set_state(rng[2])
        self.threads = threads  # vLLM's CPU kernels were set up for this many; see _threads
        added = cache_files() - cache
        self.started = f"vLLM's start {time.perf_counter() - t0:.1f}, +{added} compile-cache files"
        head, embed = model.get_output_embeddings(), model.get_input_embeddings()
        names = {m: n for n, m in model.named_modules()}
        tied = head is not None and head.weight is embed.weight
        self.tied = (names[embed] + ".weight", names[head] + ".weight") if tied else (None, None)
        self.push_weights(model.state_dict().items())
        self.generate([[eos_id]], temperature=0, max_tokens=1)  # some rejections (head size) come only now

    def sleep(self):
        """GPU: hand the engine's memory to the update (vLLM sleep level 1: KV cache freed, weights
        moved to CPU memory); wake() takes it back before the next push_weights. CPU: nothing to free."""
        if self.sleeps:
            self.llm.sleep(level=1)

    def wake(self):
        """Map the engine's weights and KV cache back (GPU), into the memory the update left (train.py
        gives the trainer's cached blocks back first). Still no room is one line, not vLLM's traceback."""
        if not self.sleeps:
            return
        try:
            self.llm.wake_up()
        except RuntimeError as e:
            if "out of memory" not in str(e).lower():
                raise
            held = torch.cuda.memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")
            sys.exit(
                f"error: vLLM could not wake after the update (GPU out of memory; the trainer holds "
                f"{held:.1f} GiB): lower --gpu_memory_utilization (the engine's share), or the trainer's "
                f"memory with --grad_ckpt 1, --lora_rank or more GPUs"
            )

    @contextlib.contextmanager
    def _threads(self):
        """Run vLLM with the torch thread count it started with: after the trainer changed it, a
        weight reload on CPU produced garbage weights (measured: 1 thread at start, 2 at reload)."""
        before = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            yield
        finally:
            torch.set_num_threads(before)

    def push_weights(self, named_tensors):
        """Push the trainer's weights into vLLM, then reset its prefix cache (else KV entries computed
        with the old weights are reused). named_tensors: (HF name, full tensor) pairs, consumed once
        (fsdp.full_parameters: gathered one parameter at a time under FSDP2); a tied lm_head may be
        absent. The only place that touches vLLM's internals."""
        embed, head = self.tied

        def weights():  # vLLM fills a tied lm_head only from its own name (measured: garbage otherwise)
            for name, tensor in named_tensors:
                if name != head:
                    yield name, tensor
                if name == embed:
                    yield head, tensor

        with self._threads():
            self.llm.collective_rpc(
                "reload_weights", kwargs={"weights_iterator": weights(), "is_checkpoint_format": True}
            )
            self.llm.reset_prefix_cache()

    @staticmethod
    def _result(o):  # flat log-probs: plain lists, the sampled token's entry first at each position
        c, lp = o.outputs[0], o.outputs[0].logprobs
        return list(c.token_ids), None if lp is None else [lp.logprobs[i] for i in lp.start_indices]

    def generate(self, prompts, temperature=1.0, top_p=1.0, max_tokens=16):
        """One batch through submit / poll: log-probs for positions 0, N, 2N, ... of the call."""
        for i, p in enumerate(prompts):
            self.submit(i, p, temperature, top_p, max_tokens, logprobs=i % self.logp_every == 0)
        done = {k: (ids, lps) for k, ids, lps in self.poll(wait_all=True)}
        return [done[i] for i in range(len(prompts))]

    @property
    def pending(self):
        return len(self.keys)

    def submit(self, key, prompt, temperature=1.0, top_p=1.0, max_tokens=16, logprobs=None):
        """Queue one prompt; logprobs None: for every logp_every-th prompt submitted."""
        rid, self.submitted = str(self.submitted), self.submitted + 1
        self.keys[rid] = key
        lp = int(rid) % self.logp_every == 0 if logprobs is None else logprobs
        # FINAL_ONLY: a step returns only the requests it finished (not every running one)
        kw = dict(logprobs=0, flat_logprobs=True) if lp else {}
        kw.update(temperature=temperature, top_p=top_p, max_tokens=max_tokens, stop_token_ids=[self.eos])
        params = self.SamplingParams(**kw, detokenize=False, output_kind=self.final_only)
        self.llm.llm_engine.add_request(rid, {"prompt_token_ids": prompt}, params)

    def poll(self, wait_all=False):
        """Run vLLM's engine steps until some requests finish (wait_all: all of them) -> [(key, ids, lps)].
        One step decodes one token for every running request; a prompt submitted meanwhile joins at
        the next step (continuous batching)."""
        done, engine = [], self.llm.llm_engine
        with self._threads():
            while self.keys and not (done and not wait_all):
                # our ids are integers; a vLLM that reports its internal id adds "-<random>"
                done += [
                    (self.keys.pop(o.request_id.split("-")[0]), *self._result(o))
                    for o in engine.step()
                    if o.finished
                ]
        return done


def make_engine(
    kind,
    model,
    tokenizer,
    *,
    kv_cache_mb,
    gpu_memory_utilization,
    copy_dtype=None,
    compile=False,
    logp_every=1,
):
    """--engine hf | vllm | auto. auto: the transformers engine for a model under AUTO_HF_ON_CPU
    parameters on CPU (the tiny default); otherwise vLLM where it imports and serves this model, else
    the transformers engine with a one-line warning that says why; vllm: the same failure is an error.
    copy_dtype: see HFEngine (vLLM always holds its own copy); compile (GPU only), logp_every:
    VLLMEngine's."""
    small_on_cpu = (
        next(model.parameters()).device.type == "cpu"
        and sum(p.numel() for p in model.parameters()) < AUTO_HF_ON_CPU
    )
    if kind == "hf" or kind == "auto" and small_on_cpu:
        return HFEngine(model, tokenizer, copy_dtype)
    try:
        return VLLMEngine(
            model,
            tokenizer.eos_token_id,
            kv_cache_mb,
            gpu_memory_utilization,
            compile=compile,
            logp_every=logp_every,
        )
    except Exception as e:  # vLLM reports bad input as many exception types; we only need the text
        why = (str(e).strip().splitlines() or [type(e).__name__])[0].split(". ")[0]
        if "memory profiling" in why.lower():  # measured: several runs starting at once on one GPU
            why = (
                "another process changed GPU memory while vLLM measured it at start-up; for runs that share "
                "a GPU, give each a fixed cache: --gpu_memory_utilization 0 --kv_cache_mb N"
            )
        elif "memory" in why.lower():
            why = (
                f"KV cache too small: {why}; raise --kv_cache_mb "
                "(CPU, or GPU with --gpu_memory_utilization 0) or --gpu_memory_utilization (GPU)"
            )
        if isinstance(e, ImportError):
            why = f"vllm is not importable ({why})"
        if kind == "vllm":
            sys.exit(f"error: --engine vllm: {why} (--engine hf generates with transformers)")
        print(f"warning: --engine auto: {why}; using the transformers engine (--engine hf)")
        return HFEngine(model, tokenizer, copy_dtype)
