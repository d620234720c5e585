"""A run's out_dir: who may write it, the resumable checkpoint (torch.distributed.checkpoint) with its
HF export, and what --resume 1 reads back (the checkpoint, and the metrics log up to it).

- One run at a time: a run holds an flock on out_dir/.lock (the OS drops it when the process dies,
  so a killed run's lock file blocks nothing); a second run stops in one line naming the first.
- A run never writes over another: a fresh run (no --resume) into an out_dir that holds a run's
  checkpoint, model or metrics stops in one line (what the careful trainers do, e.g. transformers'
  example scripts without --overwrite_output_dir): --resume 1 continues it, a new --out_dir starts
  another, deleting the folder (once its run has stopped: the lock is in it) starts over.
- A save writes everything under temp names, syncs them to the disk, then swaps them in, so a kill,
  a full disk or a power cut at any moment leaves the last complete checkpoint; a full disk stops
  the run in one line that says so.
"""

import contextlib
import dataclasses
import errno
import json
import logging
import math
import os
import random
import shutil
import socket
import time
import traceback
import warnings

import numpy as np
import torch

from checks import fail, first_line
from envs import env_kwargs
from evaluate import complete
from fsdp import _local, all_reduce, barrier, full_parameters
from records import log_lines, os_error, set_aside, write_whole

# a plain CPU run saves and loads its checkpoint in one process on purpose: dcp's warning about it is
# noise on every save, and the line before a resume's one-line error
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

# flags a resumed run may change: none changes what is trained (engine, kv_cache_mb, gpu_memory_utilization,
# compile, grad_ckpt, micro_batch_tokens: how the same distribution is sampled and the same gradient
# computed, so a run out of GPU memory goes on with less; log_groups, metrics: what is logged; overlap:
# when env steps run; logp_every, log_mb, peak_tflops, early_logprobs: flags of older runs' configs);
# env_args: compared as the env's arguments (env_kwargs), so spelling out a default changes nothing
RESUME_FREE = set(
    "resume iterations eval_every save_every time_limit threads env_workers wandb device out_dir logp_every "
    "engine kv_cache_mb gpu_memory_utilization compile log_groups log_mb peak_tflops env_args metrics "
    "overlap early_logprobs grad_ckpt micro_batch_tokens".split()
)
# what makes an out_dir hold a run (an empty log does not, nor an eval.json cut short: "complete" false)
RUN_FILES = ("ckpt", "ckpt.old", "model", "metrics.jsonl", "episodes.jsonl", "eval.json")
_LOCKS = {}  # out_dir (real path) -> its locked .lock file, open until the process ends


def claim_out_dir(cfg):
    """Before a byte of the run is written: lock out_dir (rank 0), then --resume: check_resume -> the
    checkpoint's meta; a fresh run (or --eval_only): out_dir must not hold a run -> None."""
    if os.environ.get("RANK", "0") == "0":
        lock(cfg.out_dir)
    if cfg.resume:
        return check_resume(cfg)
    if held := run_files(cfg.out_dir):
        ck = saved(cfg.out_dir)
        what = ", ".join(held) + (f"; {ck[0]} at iteration {ck[1]}" if ck else "")
        fail(
            f"--out_dir {cfg.out_dir} holds a run ({what}); "
            + (
                "give --eval_only a new --out_dir (its eval.json would replace the run's)"
                if cfg.eval_only
                else ("--resume 1 continues it; a new run needs " if ck else "no checkpoint to resume; use ")
                + f"a new --out_dir (or delete {cfg.out_dir} first)"
            )
        )
    return None


def run_files(out_dir):
    """The RUN_FILES out_dir holds (an empty log, or an eval.json cut short, is none)."""
    return [
        f
        for f in RUN_FILES
        if os.path.exists(path := os.path.join(out_dir, f))
        and (not f.endswith(".jsonl") or os.path.getsize(path))
        and (f != "eval.json" or complete(path))
    ]


def lock(out_dir, flag="--out_dir"):
    """One run per out_dir: an exclusive flock on out_dir/.lock for the life of this process. The
    file names the holder (pid, host) for the message a second run stops with. A kill drops the
    lock with the process, so a stale file blocks nothing; in one process (tests that simulate a
    kill, then resume) the lock is taken once."""
    import fcntl

    key = os.path.realpath(out_dir)
    if key in _LOCKS:
        return
    try:
        os.makedirs(out_dir, exist_ok=True)
        f = open(os.path.join(out_dir, ".lock"), "a+")
    except OSError as e:  # --eval_only: check_config does not try out_dir
        fail(f"{flag} {out_dir}: cannot write there ({e.strerror or first_line(e)})")
    for attempt in range(21):  # holder() takes a shared lock for a moment (up to 1 s): not a run
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if attempt == 20:
                f.seek(0)
                who = f.read().strip() or "another process"
                f.close()
                fail(f"{flag} {out_dir} is in use by another run ({who}); wait for it to end or use another "
                     f"{flag}")  # fmt: skip
            time.sleep(0.05)
        except OSError as e:  # a file system without locks: run unguarded, and say so
            print(
                f"note: cannot lock {out_dir}/.lock ({e.strerror}): nothing stops a second run writing there"
            )
            break
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    f.flush()
    _LOCKS[key] = f


def holder(out_dir):
    """Who holds out_dir's lock (the line lock() wrote: pid and host), or None where no process does."""
    import fcntl

    try:
        f = open(os.path.join(out_dir, ".lock"))
    except OSError:
        return None
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)  # released as f closes
        except BlockingIOError:
            return f.read().strip() or "another process"
        except OSError:  # a file system without locks
            return None
    return None


def _swap_in(tmp, final):
    """Replace `final` by `tmp` so that one complete copy always exists on disk: `final` if it is
    there, else `final.old` (a kill between the two renames; resume then reads it, checkpoint_path).
    A `final.old` left half-deleted by a kill is dropped first while `final` is complete: renaming
    onto it failed ("Directory not empty") and no later save got through. `final.old` goes only once
    the renames are on the disk (save synced `tmp`'s files before), so a power cut or a host crash
    cannot leave a renamed checkpoint whose bytes were never written and the old one deleted."""
    old = final + ".old"
    if os.path.exists(final):
        if os.path.exists(old):
            shutil.rmtree(old)
        os.replace(final, old)
    os.replace(tmp, final)
    if _fsync(os.path.dirname(final) or "."):  # else (or where a file in it is busy) the next save drops it
        shutil.rmtree(old, ignore_errors=True)


def _fsync_tree(path, deep=True):
    """fsync every file under path (deep=False: those right in it), then the folders; an error (e.g. a
    full disk found only now) raises, a file gone meanwhile (a temp name renamed) is passed over."""
    for root, dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(FileNotFoundError):
                _fsync_path(os.path.join(root, name))
        if not _fsync(root):
            raise OSError(errno.EIO, "the disk failed to sync a folder", root)
        if not deep:
            dirs.clear()


def _fsync(folder):
    """fsync a folder's entries -> False where the disk failed (EIO); a file system that cannot sync a
    folder (EINVAL and the like) counts as done, or every save would keep its old copy there."""
    try:
        _fsync_path(folder)
    except OSError as e:
        return e.errno != errno.EIO
    return True


def _fsync_path(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def checkpoint_path(out_dir):
    """The complete checkpoint of a run: out_dir/ckpt, or out_dir/ckpt.old where a kill between
    _swap_in's renames left no ckpt (ckpt.old is then the last complete one)."""
    path = os.path.join(out_dir, "ckpt")
    return path if os.path.exists(path) or not os.path.exists(path + ".old") else path + ".old"


def saved(out_dir):
    """(path, iteration) of the checkpoint in out_dir; None without a readable one."""
    path = checkpoint_path(out_dir)
    try:
        with open(os.path.join(path, "meta.json")) as f:
            return path, json.load(f)["iteration"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def kept_text(out_dir):
    """What a run that stops now leaves to resume from, for its last line."""
    ck = saved(out_dir)
    return (
        f"{ck[0]} keeps iteration {ck[1]}; --resume 1 goes on from it"
        if ck
        else f"{out_dir} holds no checkpoint yet"
    )


def interrupted(out_dir):
    """The line Ctrl-C ends a run with: what out_dir keeps."""
    return f"interrupted: {kept_text(out_dir)}"


def out_of_memory(e, out_dir):
    """The line a run out of GPU memory ends with: where in this code (the innermost frame of a
    top-level module: the update's ppo.py, the engine's engine.py, ...), torch's account of the
    card's memory, what to lower and what out_dir keeps."""
    here = os.path.dirname(os.path.abspath(__file__))
    tb = traceback.extract_tb(e.__traceback__)
    ours = [
        f for f in tb if f.filename.endswith(".py") and os.path.dirname(os.path.abspath(f.filename)) == here
    ]
    where = f" in {os.path.basename(ours[-1].filename)}:{ours[-1].lineno} ({ours[-1].name})" if ours else ""
    return (
        f"out of GPU memory{where}: {(str(e).strip().splitlines() or [''])[0]}; less memory (--resume "
        "1 takes these): --grad_ckpt 1, a smaller --micro_batch_tokens, a smaller "
        f"--kv_cache_mb or --gpu_memory_utilization, fewer runs on the card; {kept_text(out_dir)}"
    )


def save(out_dir, it, model, tok, opt, sched, rank, config, gen_model=None, extra=None, notes=None):
    """out_dir/ckpt (model + optimizer shards of every rank, iteration, config (a dict), scheduler,
    per-rank RNG, notes ({key: JSON value} for meta.json: train.py's metrics line, which kept_log puts
    back if the log lost it, and the random policy's rates); extra:
    {name: object with state_dict()} kept whole by rank 0 in ckpt/extra.pt, e.g. --algo ppo's critic,
    replicated on every rank) and out_dir/model (HF format: transformers and vLLM load it as is).
    Each is written under a temp name then swapped in, so a crash mid-write never destroys the last
    good one. model/ goes first and ckpt/ last: resume continues from ckpt/, so a kill between the two
    swaps redoes these iterations and exports model/ again (the other order left model/ one save
    behind for good when the kill came at the last iteration). A write that fails (a full disk)
    stops every rank in one line; the temp copies are removed, the last good checkpoint stays."""
    tmp, final, tmp_hf = (os.path.join(out_dir, d) for d in ("ckpt.tmp", "ckpt", "model.tmp"))
    if rank == 0:  # a killed save's leftovers: never mixed into this one
        for d in (tmp, tmp_hf):
            shutil.rmtree(d, ignore_errors=True)
    barrier()
    from torch.distributed.checkpoint.api import CheckpointException

    error = None
    try:
        _write(tmp, tmp_hf, it, model, tok, opt, sched, rank, config, gen_model, extra, notes)
    except (Exception, CheckpointException) as e:  # CheckpointException: a BaseException
        if _caused(e, lambda x: isinstance(x, KeyboardInterrupt)):  # Ctrl-C inside dcp: wrapped as a failure
            raise KeyboardInterrupt from e
        error = e
    barrier()  # every rank's files written: rank 0 puts them on the disk before any swap
    if rank == 0 and error is None:
        try:
            _fsync_tree(out_dir, deep=False)  # the logs (metrics.jsonl): a checkpoint never leads them
            _fsync_tree(tmp_hf)
            _fsync_tree(tmp)
        except OSError as e:
            error = e
    if all_reduce(int(error is not None), "max"):
        if rank == 0:
            free = shutil.disk_usage(out_dir).free  # before the temp copies go
            for d in (tmp, tmp_hf):
                shutil.rmtree(d, ignore_errors=True)
            why = (
                "failed on another rank"
                if error is None
                else "no space left on device"
                if _caused(error, _no_space) or free < 1 << 20
                else f"{type(error).__name__}: {first_line(error)}"
            )
            fail(
                f"iteration {it}: the checkpoint was not saved ({why}; {free >> 20} MiB free on {out_dir}'s "
                f"disk); {kept_text(out_dir)}"
            )
        fail("the checkpoint was not saved")
    if rank == 0:
        try:
            _swap_in(tmp_hf, os.path.join(out_dir, "model"))
            _swap_in(tmp, final)
        except OSError as e:  # e.g. a file system that would not delete the copy before last
            error = e
    if all_reduce(int(error is not None), "max"):  # every rank stops, none waits in a collective
        fail(f"iteration {it}: the checkpoint was not swapped in ({os_error(error)}); {kept_text(out_dir)}"
             if rank == 0 else "the checkpoint was not saved")  # fmt: skip


def _write(tmp, tmp_hf, it, model, tok, opt, sched, rank, config, gen_model, extra, notes):
    """save's writes, all under temp names: first the collective steps (dcp.save raises on every rank
    when one fails; the full-weight gather writes nothing), then each rank's own files, so a rank
    that fails never leaves the others waiting in a collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    msd, osd = trained_state(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=tmp)
    frozen = frozen_checksum(model)
    if hasattr(model, "get_base_model"):  # LoRA: the export holds the merged weights, HF names
        full = {name: w.cpu() for name, w in full_parameters(model)}
        gen_model = gen_model or model.get_base_model()
    else:
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    torch.save(
        {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()},
        os.path.join(tmp, f"rng{rank}.pt"),
    )
    if rank == 0:
        if extra:
            torch.save({k: v.state_dict() for k, v in extra.items()}, os.path.join(tmp, "extra.pt"))
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(
                {
                    "iteration": it,
                    "config": config,
                    "sched": sched.state_dict(),
                    "frozen_checksum": frozen,
                    **(notes or {}),
                },
                f,
            )
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        (gen_model or model).save_pretrained(tmp_hf, state_dict=full)
        tok.save_pretrained(tmp_hf)


def trained_state(model, opt):
    """What ckpt/ holds: the model's trained parameters (and buffers) and the optimizer state. With
    --lora_rank that is the adapters, not the frozen base, which --resume loads from --model again
    (checked by frozen_checksum): a LoRA checkpoint is MBs, not the base model's GBs. (dcp's own
    ignore_frozen_params keeps a frozen weight tied to another, e.g. SmolLM2's lm_head: 28M
    parameters.)"""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    frozen = {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    msd, osd = get_state_dict(model, opt)
    return {k: v for k, v in msd.items() if k not in frozen}, osd


def frozen_checksum(model):
    """The sum of |w| over the model's frozen parameters (the LoRA base; all ranks' shards), float64;
    None when every parameter trains."""
    frozen = [p for p in model.parameters() if not p.requires_grad]
    if not frozen:
        return None
    return float(all_reduce(sum(_local(p.detach()).double().abs().sum().item() for p in frozen)))


def _no_space(e):
    """Is e a full disk (or quota)?"""
    return isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT) or "No space left" in str(e)


def _caused(e, test):
    """Does test hold for e or anything in its chain, or in a dcp failure's ({rank: exception})?"""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if test(e) or any(
            _caused(f[0] if isinstance(f, tuple) else f, test)
            for f in (getattr(e, "failures", None) or {}).values()
        ):
            return True
        e = e.__cause__ or e.__context__
    return False


def check_resume(cfg):
    """--resume: the run's checkpoint (checkpoint_path) must have a readable meta.json from the same
    config (bar RESUME_FREE fields; env_args as env_kwargs) -> its meta. Anything else is one line."""
    path = os.path.join(checkpoint_path(cfg.out_dir), "meta.json")
    if not os.path.exists(path):
        held = run_files(cfg.out_dir)
        fail(
            f"--resume but {path} does not exist; "
            + (
                f"the run in {cfg.out_dir} ({', '.join(held)}) stopped before its first checkpoint: "
                f"delete {cfg.out_dir} or use a new --out_dir"
                if held
                else "drop --resume or point --out_dir at a run"
            )
        )
    try:
        meta = json.load(open(path))
        if (
            not isinstance(meta.get("iteration"), int)
            or not isinstance(meta.get("config"), dict)
            or not isinstance(meta.get("sched"), dict)
        ):
            raise ValueError("no iteration, config or sched")
    except (ValueError, OSError, AttributeError) as e:  # a half-written or hand-edited file
        fail(f"--resume: {path} is unreadable or incomplete ({first_line(e)}); the checkpoint is corrupt")
    # a flag newer than the checkpoint: the run had the behaviour its default keeps
    old = {**dataclasses.asdict(type(cfg)()), **meta["config"]}
    diff = [
        f"--{k} {old.get(k)!r} -> {v!r}"
        for k, v in dataclasses.asdict(cfg).items()
        if k not in RESUME_FREE and old.get(k) != v
    ]
    if old.get("env_args") != cfg.env_args:
        try:
            same_env = env_kwargs(cfg.env, old.get("env_args") or "") == env_kwargs(cfg.env, cfg.env_args)
        except (ValueError, TypeError):
            same_env = False
        if not same_env:
            diff.append(f"--env_args {old.get('env_args')!r} -> {cfg.env_args!r}")
    if diff:
        fail(
            f"--resume: {cfg.out_dir} was trained with another config ({'; '.join(diff)}); "
            f"use the same flags or another --out_dir"
        )
    return meta


@contextlib.contextmanager
def _quiet_loader():
    """dcp.load logs a traceback on the root logger for each metadata file it fails to read, before
    it raises: load_checkpoint's one line says all of it."""
    before = logging.root.manager.disable
    logging.disable(logging.ERROR)
    try:
        yield
    finally:
        logging.disable(before)


def load_checkpoint(path, model, opt, sched, rank, meta, extra=None):
    """Load the checkpoint at path (checkpoint_path) into model, optimizer, scheduler, RNG and extra
    (as save's) -> its iteration. A missing or truncated shard, or weights / optimizer state that are
    not finite (flipped bytes load silently and turn every weight into NaN an update later), stop with
    one line."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    frozen = frozen_checksum(model)
    if meta.get("frozen_checksum") is not None and not math.isclose(
        frozen, meta["frozen_checksum"], rel_tol=1e-6
    ):
        fail(
            f"--resume: the frozen base weights of --model {meta['config'].get('model')} differ from those "
            f"{path} was trained on (checksum {frozen:.6g}, saved {meta['frozen_checksum']:.6g}): resume "
            "on the same base model"
        )
    try:
        msd, osd = trained_state(model, opt)
        state = {"model": msd, "optim": osd}
        with _quiet_loader():
            dcp.load(state, checkpoint_id=path)
        set_state_dict(
            model,
            opt,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=StateDictOptions(ignore_frozen_params=True, strict=False),  # dcp.load checked the keys
        )
        sched.load_state_dict(meta["sched"])
        extra_state = torch.load(os.path.join(path, "extra.pt"), weights_only=False) if extra else {}
        for k, v in (extra or {}).items():
            v.load_state_dict(extra_state[k])
        rng_file = os.path.join(path, f"rng{rank}.pt")
        if os.path.exists(rng_file):
            rng = torch.load(rng_file, weights_only=False)
            torch.set_rng_state(rng["torch"])
            random.setstate(rng["python"])
            np.random.set_state(rng["numpy"])
    except (Exception, CheckpointException) as e:  # damage shows as many types (CheckpointException: a
        e = next(iter(e.failures.values()))[0] if isinstance(e, CheckpointException) else e  # BaseException)
        fail(
            f"--resume: {path} does not load ({type(e).__name__}: {first_line(e)}); the checkpoint is corrupt"
        )
    names = {id(p): n for n, p in model.named_parameters()}
    named = [
        *model.state_dict().items(),
        *(
            (f"optimizer {k} of {names.get(id(p), '?')}", v)
            for p, st in opt.state.items()
            for k, v in st.items()
        ),
        *_tensors(extra_state, "extra.pt"),
    ]
    bad = [
        n
        for n, t in named
        if torch.is_tensor(t) and t.is_floating_point() and not torch.isfinite(_local(t)).all()
    ]
    if all_reduce(len(bad), "max"):
        fail(
            f"--resume: {path} holds non-finite values ({', '.join(bad[:3]) or 'on another rank'}); "
            f"the checkpoint is corrupt"
        )
    return meta["iteration"]


def _tensors(tree, name):
    """(name, tensor) of every tensor in nested dicts and lists (a state_dict of state_dicts)."""
    if torch.is_tensor(tree):
        yield name, tree
    elif isinstance(tree, (dict, list, tuple)):
        for k, v in tree.items() if isinstance(tree, dict) else enumerate(tree):
            yield from _tensors(v, f"{name} {k}")


# ---- the metrics log through --resume ----
def kept_log(path, upto, last_line=None):
    """The lines of metrics.jsonl up to iteration `upto` (the checkpoint's; resume redoes the rest).
    A half-written last line (a kill mid-write) is dropped; a damaged line before it is an error.
    last_line: the checkpoint's own copy of iteration `upto`'s line, put back where the log lost it
    (a kill or a full disk cut it short after the save: dropped, it was never redone)."""
    lines = list(log_lines(path))
    kept, last = [], 0
    for k, (line, it) in enumerate(lines):
        if it is None:
            if k == len(lines) - 1:
                break
            fail(
                f"--resume: line {k + 1} of {path} is not a metrics line; remove it or use another --out_dir"
            )
        if it <= upto:
            kept.append(line)
            last = it
    if last < upto and last_line:
        kept.append(last_line.rstrip("\n") + "\n")
    return kept


def open_metrics_log(out_dir, kept, start):
    """out_dir/metrics.jsonl, ready for records.append_lines (rank 0) -> its path. A fresh run starts
    it empty; a resumed one keeps the lines of the iterations its checkpoint holds (`kept`, from
    kept_log) and moves the rest, which it redoes, to metrics.redone.jsonl."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "metrics.jsonl")
    if start:
        set_aside(path, start)  # the later lines, to metrics.redone.jsonl; `kept` (kept_log's) is written
    write_whole(path, "".join(kept) if start else "")
    return path
