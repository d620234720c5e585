"""What a kill, a damaged checkpoint or a NaN can cost: at most the iterations since the last
checkpoint, never the checkpoint itself. Kill points are simulated by arranging the files a kill
leaves behind, or by a hook that raises where the kill would strike; train.main runs in-process."""

import errno
import io
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
from conftest import SMALL_RUN, iterations

import checkpoint
import records
import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARGS = SMALL_RUN


class Killed(BaseException):
    """A kill -9 at this point: nothing after it runs (not even `except Exception`)."""


def resume(out, iters=3):
    return train.main([*ARGS, "--iterations", str(iters), "--out_dir", str(out), "--resume", "1"])


def one_line_error(excinfo, *words):
    msg = str(excinfo.value.code)
    assert msg.startswith("error: ") and "\n" not in msg, msg
    assert all(w in msg for w in words), msg
    return msg


def partial(path):
    """A folder half-deleted by a kill during shutil.rmtree."""
    files = sorted(os.listdir(path))
    for f in files[: len(files) // 2]:
        os.remove(path / f)


@pytest.mark.parametrize(
    "arrange",
    [
        "ckpt.old half-deleted",  # kill while the swap deleted ckpt.old: every later save failed
        "model.old half-deleted",  # the same in model/'s swap
        "ckpt/ renamed, not replaced",  # kill between the swap's two renames: no ckpt/, ckpt.old complete
        "metrics line half-written",  # kill mid-write of a metrics line: resume crashed on it
    ],
)
def test_resume_after_a_kill_at_any_point_of_the_save(run, arrange):
    if arrange == "ckpt.old half-deleted":
        shutil.copytree(run / "ckpt", run / "ckpt.old")
        partial(run / "ckpt.old")
    elif arrange == "model.old half-deleted":
        shutil.copytree(run / "model", run / "model.old")
        partial(run / "model.old")
    elif arrange == "ckpt/ renamed, not replaced":
        os.replace(run / "ckpt", run / "ckpt.old")
    else:
        with open(run / "metrics.jsonl", "a") as f:
            f.write('{"iteration": 3, "success": 0.')
    resume(run)
    assert iterations(run) == [1, 2, 3]
    assert json.load(open(run / "ckpt" / "meta.json"))["iteration"] == 3
    assert not any(os.path.exists(run / d) for d in ("ckpt.old", "model.old", "ckpt.tmp", "model.tmp"))
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(run / "model")


def test_checkpoint_never_leads_the_log(tmp_path, monkeypatch):
    """A kill in the save of an eval iteration used to lose that iteration's metrics line for good
    (the line came after the save), and a kill between the two swaps left model/ behind ckpt/. Now
    the line comes first, model/ is swapped in before ckpt/, and resume redoes the iteration."""
    out, swaps, real_swap = tmp_path / "run", [], checkpoint._swap_in

    def swap(tmp, final):
        swaps.append(os.path.basename(final))
        if swaps.count("ckpt") == 2:  # iteration 2's checkpoint: killed before ckpt/ is replaced
            raise Killed
        real_swap(tmp, final)

    monkeypatch.setattr(checkpoint, "_swap_in", swap)
    with pytest.raises(Killed):
        train.main([*ARGS, "--iterations", "2", "--out_dir", str(out)])
    assert swaps == ["model", "ckpt", "model", "ckpt"]
    assert iterations(out) == [1, 2] and json.load(open(out / "ckpt" / "meta.json"))["iteration"] == 1
    monkeypatch.setattr(checkpoint, "_swap_in", real_swap)
    resume(out, 2)
    assert iterations(out) == [1, 2] and json.load(open(out / "ckpt" / "meta.json"))["iteration"] == 2


def test_a_run_killed_in_its_first_save_is_not_sent_to_resume(tmp_path, monkeypatch):
    """Killed before its first ckpt/ (model/ and the log were there): a fresh run's error said
    "--resume 1 continues it" and --resume said "drop --resume", each sending the user to the other."""
    out = tmp_path / "run"

    def swap(tmp, final):
        raise Killed

    monkeypatch.setattr(checkpoint, "_swap_in", swap)
    with pytest.raises(Killed):
        train.main([*ARGS, "--iterations", "1", "--out_dir", str(out)])
    monkeypatch.undo()
    with pytest.raises(SystemExit) as e:
        train.main([*ARGS, "--iterations", "1", "--out_dir", str(out)])
    assert "--resume 1" not in one_line_error(e, "no checkpoint to resume", "new --out_dir")
    with pytest.raises(SystemExit) as e:
        resume(out, 1)
    one_line_error(e, "stopped before its first checkpoint", f"delete {out}")


def test_a_disk_that_fails_to_sync_a_folder_stops_the_save(run, monkeypatch):
    """EIO on a folder's fsync was passed over and the save went ahead: now it stops the run in one
    line, and the last complete checkpoint stays."""
    real = checkpoint._fsync_path

    def fsync_path(path):
        if str(path).endswith("ckpt.tmp"):
            raise OSError(errno.EIO, "Input/output error")
        real(path)

    monkeypatch.setattr(checkpoint, "_fsync_path", fsync_path)
    with pytest.raises(SystemExit) as e:
        resume(run)
    one_line_error(e, "iteration 3: the checkpoint was not saved", "keeps iteration 2")
    assert json.load(open(run / "ckpt" / "meta.json"))["iteration"] == 2 and not os.path.exists(
        run / "ckpt.tmp"
    )


def test_an_old_copy_that_will_not_go_costs_one_line_not_a_traceback(run, monkeypatch):
    """A copy before last that cannot be deleted (on NFS, a file a reader holds open): the save that
    made it keeps going, the next stops in one line, and ckpt/ keeps the last complete checkpoint."""
    real = shutil.rmtree

    def rmtree(path, ignore_errors=False, **k):
        if str(path).endswith(".old"):
            if ignore_errors:
                return
            raise OSError(errno.ENOTEMPTY, "Directory not empty", str(path))
        real(path, ignore_errors=ignore_errors, **k)

    monkeypatch.setattr(shutil, "rmtree", rmtree)
    with pytest.raises(SystemExit) as e:
        resume(run, 4)  # iteration 3 saves (model.old stays), iteration 4 cannot move model/ aside
    one_line_error(e, "iteration 4: the checkpoint was not swapped in", "keeps iteration 3")
    assert json.load(open(run / "ckpt" / "meta.json"))["iteration"] == 3


def test_a_killed_export_leaves_nothing_in_the_next_model(run):
    junk = run / "model.tmp" / "adapter_model.safetensors"  # a kill mid-export left model.tmp/
    junk.parent.mkdir()
    junk.write_bytes(b"stale")
    resume(run)
    assert not os.path.exists(run / "model" / junk.name) and not os.path.exists(run / "model.tmp")


def test_a_run_out_of_gpu_memory_ends_in_one_line(run, tmp_path):
    """CUDA out of memory (two runs on a card, a micro-batch too big) ends a run in one line, not a
    traceback: where in this code (the innermost frame of a top-level module), torch's account of
    the card, the flags that lower the memory, and what out_dir keeps to go on from."""
    import checks

    class Message(Exception):  # its text is made in checks.py's frame: raised from inside this code
        def __str__(self):
            raise torch.OutOfMemoryError(
                "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has 79.18 GiB."
            )

    with pytest.raises(torch.OutOfMemoryError) as e:
        checks.first_line(Message())
    line = checkpoint.out_of_memory(e.value, str(run))
    assert "\n" not in line and line.startswith("out of GPU memory in checks.py:")
    assert "(first_line): CUDA out of memory. Tried to allocate 2.00 GiB" in line
    assert "--grad_ckpt 1" in line and "--micro_batch_tokens" in line and line.endswith("goes on from it")
    assert checkpoint.out_of_memory(torch.OutOfMemoryError("x"), str(tmp_path)).endswith("no checkpoint yet")


def test_the_update_gives_its_cached_gpu_memory_back_before_each_wake(tmp_path, monkeypatch):
    """Every iteration, after the update and before the engine wakes (which an engine with a fixed
    cache skips), train.py hands torch's cached blocks back to the card (a no-op on CPU): an arm
    sharing a GPU otherwise held its update's peak while generating."""
    import engine

    events = []
    monkeypatch.setattr(train, "release_cached_memory", lambda device: events.append("release"))
    monkeypatch.setattr(engine.HFEngine, "wake", lambda self: events.append("wake"))
    update = train.update_policy
    monkeypatch.setattr(train, "update_policy", lambda *a: events.append("update") or update(*a))
    train.main([*ARGS, "--iterations", "2", "--out_dir", str(tmp_path / "r")])
    assert events == ["update", "release", "wake"] * 2


def test_a_probe_of_the_lock_does_not_stop_a_run_starting(tmp_path):
    """checkpoint.holder() (bench.pair asks who runs in a folder) holds a shared lock for a moment;
    a run starting in that moment failed, naming the pid of a run long gone."""
    import fcntl
    import threading

    out = tmp_path / "run"
    out.mkdir()
    (out / ".lock").write_text("pid 4242 on gone\n")
    probe = open(out / ".lock")
    fcntl.flock(probe, fcntl.LOCK_SH)
    threading.Timer(0.3, probe.close).start()
    checkpoint.lock(str(out))
    assert checkpoint.holder(str(out)) == f"pid {os.getpid()} on {socket.gethostname()}"


def test_save_is_on_the_disk_before_the_swap(tmp_path, monkeypatch):
    """A power cut right after a swap must not leave renamed files whose bytes were never written,
    the old checkpoint deleted: every file of ckpt/ and model/ is fsynced before they are swapped in,
    and ckpt.old goes only after the folder's entries (the renames) are synced. Files written whole
    (eval.json) are synced before their rename too."""
    out, events = tmp_path / "run", []
    real = {"fsync": os.fsync, "replace": os.replace, "rmtree": shutil.rmtree}

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real["fsync"](fd)

    def replace(src, dst):
        events.append(("replace", str(src), str(dst)))
        real["replace"](src, dst)

    def rmtree(path, *a, **k):
        events.append(("rmtree", str(path)))
        real["rmtree"](path, *a, **k)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(shutil, "rmtree", rmtree)
    train.main([*ARGS, "--iterations", "2", "--out_dir", str(out)])
    at = lambda *e: max(i for i, x in enumerate(events) if x == e)  # noqa: E731  (the last: iteration 2's)
    for d in ("model", "ckpt"):
        tmp, final = str(out / f"{d}.tmp"), str(out / d)
        moved_aside, swapped = at("replace", final, final + ".old"), at("replace", tmp, final)
        files = [os.path.join(r, f) for r, _, fs in os.walk(final) for f in fs]
        synced = {x[1] for x in events[:moved_aside] if x[0] == "fsync"}
        assert files and {f.replace(final, tmp, 1) for f in files} <= synced, d
        assert str(out / "metrics.jsonl") in synced  # the log, whose lines the checkpoint must not lead
        dropped = at("rmtree", final + ".old")
        assert swapped < events.index(("fsync", str(out)), swapped) < dropped, d
    ev = str(out / "eval.json")  # a file written whole (records.write_whole): synced, then renamed
    assert ("fsync", ev + ".tmp") in events[: at("replace", ev + ".tmp", ev)]


def flip_optimizer_bytes(ckpt):
    """16 bytes of one AdamW exp_avg set to 0xff: they load without complaint, as NaN."""
    from torch.distributed.checkpoint import FileSystemReader

    info = next(
        v
        for k, v in FileSystemReader(str(ckpt)).read_metadata().storage_data.items()
        if k.fqn.endswith("q_proj.weight.exp_avg")
    )
    path = ckpt / info.relative_path
    data = bytearray(path.read_bytes())
    blob = bytes(data[info.offset : info.offset + info.length])
    at = info.offset + blob.index(torch.load(io.BytesIO(blob)).numpy().tobytes())
    data[at : at + 16] = b"\xff" * 16
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage, words",
    [
        ("meta.json truncated", "unreadable or incomplete"),
        ("meta.json without sched", "unreadable or incomplete"),
        ("shard truncated", "does not load"),
        (".metadata missing", "does not load"),
        (".metadata truncated", "does not load"),  # the loader printed two tracebacks before the line
        ("rng truncated", "does not load"),
        ("optimizer bytes flipped", "non-finite values"),
    ],
)
def test_damaged_checkpoint_is_one_line(run, damage, words, caplog):
    ckpt = run / "ckpt"
    if damage == "meta.json truncated":
        text = (ckpt / "meta.json").read_text()
        (ckpt / "meta.json").write_text(text[: len(text) // 2])
    elif damage == "meta.json without sched":
        meta = json.load(open(ckpt / "meta.json"))
        del meta["sched"]
        (ckpt / "meta.json").write_text(json.dumps(meta))
    elif damage == "shard truncated":
        shard = ckpt / "__0_0.distcp"
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    elif damage == ".metadata missing":
        os.remove(ckpt / ".metadata")
    elif damage == ".metadata truncated":
        (ckpt / ".metadata").write_bytes((ckpt / ".metadata").read_bytes()[:3000])
    elif damage == "rng truncated":
        (ckpt / "rng0.pt").write_bytes((ckpt / "rng0.pt").read_bytes()[:100])
    else:
        flip_optimizer_bytes(ckpt)
    log = (run / "metrics.jsonl").read_text()
    with pytest.raises(SystemExit) as e:
        resume(run)
    one_line_error(e, "--resume", str(ckpt), "corrupt", words)
    assert (run / "metrics.jsonl").read_text() == log
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]  # no library tracebacks


def test_metrics_log_on_resume(tmp_path):
    """A half-written last line (a kill mid-write) is dropped; a damaged line before it is one line."""
    log = tmp_path / "metrics.jsonl"
    log.write_text('{"iteration": 1}\n{"iteration": 2}\n{"iteration": 3}\n{"itera')
    assert checkpoint.kept_log(str(log), 2) == ['{"iteration": 1}\n', '{"iteration": 2}\n']
    log.write_text('{"iteration": 1}\n{"iteration": 2}')  # complete, but the newline did not make it
    assert checkpoint.kept_log(str(log), 2) == ['{"iteration": 1}\n', '{"iteration": 2}\n']
    log.write_text('{"iteration": 1}\ngarbage\n{"iteration": 3}\n')
    with pytest.raises(SystemExit) as e:
        checkpoint.kept_log(str(log), 3)
    one_line_error(e, "--resume", "line 2")


def snapshot(out):
    return {p.relative_to(out): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def test_non_finite_update_stops_before_anything_is_saved(run, monkeypatch):
    """Whatever makes the update non-finite, the run stops with one line at that iteration and the
    last good ckpt/, model/ and log stay as they were (they used to be overwritten with NaN)."""
    before = snapshot(run)
    real_update = train.update

    def update(model, *a, **k):  # any cause: here one weight turns NaN in the update of iteration 3
        out = real_update(model, *a, **k)
        next(model.parameters()).data[0, 0] = float("nan")
        return out

    monkeypatch.setattr(train, "update", update)
    with pytest.raises(SystemExit) as e:
        resume(run, 4)
    one_line_error(e, "iteration 3: non-finite update", "weights not finite", "still hold iteration 2")
    assert snapshot(run) == before


def test_huge_lr_stops_before_anything_is_saved(tmp_path):
    """--lr 1e30 used to exit 0 with NaN loss and weights, saved over the last good checkpoint (a
    fresh run can no longer start in a run's out_dir: tests/test_runs.py)."""
    with pytest.raises(SystemExit) as e:
        train.main([*ARGS, "--iterations", "2", "--lr", "1e30", "--out_dir", str(tmp_path / "run")])
    one_line_error(e, "iteration 1: non-finite update", "saved nothing yet")
    assert not any(os.path.exists(tmp_path / "run" / d) for d in ("ckpt", "model", "ckpt.tmp", "model.tmp"))


def test_time_limit_stops_saved_not_evaluated_then_resume_goes_on(tmp_path, capsys):
    """--time_limit: the first iteration past it is the last, checkpointed but not evaluated (an eval
    is minutes on ALFWorld; a long run goes on over many limits); --resume (the limit may change)
    trains on to --iterations, evaluated there."""
    out = tmp_path / "run"
    args = [*ARGS, "--eval_every", "10", "--iterations", "3", "--out_dir", str(out)]
    assert train.main([*args, "--time_limit", "1e-9"]) is None
    assert iterations(out) == [1]
    assert json.load(open(out / "ckpt" / "meta.json"))["iteration"] == 1
    assert (out / "model" / "config.json").exists() and not (out / "eval.json").exists()
    assert [json.loads(line)["eval_success"] for line in open(out / "metrics.jsonl")] == [None]
    assert "stopped after iteration 1 of 3" in capsys.readouterr().out
    assert train.main([*args, "--resume", "1"]) is not None
    assert iterations(out) == [1, 2, 3]
    assert json.load(open(out / "eval.json"))["iteration"] == 3
    last = capsys.readouterr().out.strip().splitlines()[-1]  # the eval it reports, named
    assert last.startswith("held-out success") and last.endswith("at iteration 3"), last


def test_a_resumed_run_logs_the_last_eval_until_its_next(tmp_path):
    """eval_success is the last eval's on every line (docs/training.md); a resume used to log null
    from its first iteration until its own first eval."""
    out = tmp_path / "run"
    args = [*ARGS, "--eval_every", "2", "--out_dir", str(out)]
    train.main([*args, "--iterations", "3", "--time_limit", "1e-9", "--save_every", "1"])  # saved at 1
    train.main([*args, "--iterations", "2", "--resume", "1"])  # 2: evaluated
    train.main([*args, "--iterations", "5", "--resume", "1"])  # 3 carries 2's, 4 its own
    lines = [json.loads(line) for line in open(out / "metrics.jsonl")]
    ev = [m["eval_success"] for m in lines]
    assert ev[0] is None and ev[1] is not None and ev[2] == ev[1] and ev[3] is not None, ev
    # named sets (ALFWorld) come back as sets
    line = {"eval_success": 0.2, "eval_success/valid_seen": 0.2, "eval_success/valid_seen/pick": 0.3}
    rates = records.logged_rates({"metrics_line": json.dumps(line)})
    assert rates == {"valid_seen": 0.2, "valid_seen/pick": 0.3} and records.logged_rates(None) == {}


def test_a_fresh_run_keeps_an_episode_log_it_did_not_write(tmp_path):
    """An out_dir holding only episodes.jsonl (a run killed between its episode records and its first
    metrics line, or a user's file) was emptied by a fresh run; now it is a run, refused in one line."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "episodes.jsonl").write_text('{"iteration": 1}\n')
    with pytest.raises(SystemExit) as e:
        train.main([*ARGS, "--iterations", "1", "--out_dir", str(out)])
    one_line_error(e, "holds a run (episodes.jsonl)", "new --out_dir")
    assert (out / "episodes.jsonl").read_text() == '{"iteration": 1}\n'


def test_time_limit_stop_after_an_eval_reports_that_eval_and_its_iteration(tmp_path, capsys, monkeypatch):
    """A --time_limit stop one iteration after an eval: the last line reports that eval, named by its
    iteration (2), not the stop's (3). The clock is the test's: it jumps past the limit in the eval."""
    clock = [0.0]

    def tick():  # every reading a millisecond later, so rates stay finite
        clock[0] += 1e-3
        return clock[0]

    monkeypatch.setattr(time, "perf_counter", tick)
    real_eval = train.run_eval

    def slow_eval(*a, **kw):
        out = real_eval(*a, **kw)
        clock[0] += 3600.0  # the eval took an hour: the next iteration is past the limit
        return out

    monkeypatch.setattr(train, "run_eval", slow_eval)
    out = tmp_path / "run"
    args = [*ARGS, "--eval_every", "2", "--iterations", "5", "--time_limit", "1", "--out_dir", str(out)]
    assert train.main(args) is not None
    assert iterations(out) == [1, 2, 3]
    assert json.load(open(out / "ckpt" / "meta.json"))["iteration"] == 3
    assert json.load(open(out / "eval.json"))["iteration"] == 2
    text = capsys.readouterr().out
    assert "stopped after iteration 3 of 5" in text
    last = text.strip().splitlines()[-1]
    assert last.startswith("held-out success") and last.endswith("at iteration 2"), last


def _children(pid):
    """Live processes whose parent is pid (from /proc: no psutil needed)."""
    kids = []
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if d.isdigit() and int(fields[1]) == pid and fields[0] != "Z":
                kids.append(int(d))
        except (OSError, IndexError, ValueError):
            pass
    return kids


def _running(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_sigterm_stops_the_env_workers_with_the_run(tmp_path):
    """SIGTERM (a scheduler's kill) with --env_workers 2 ends like Ctrl-C: one line saying what is
    kept, and no env worker left behind (they outlived the run by ~10 s, still starting up)."""
    p = subprocess.Popen(
        [
            sys.executable,
            "train.py",
            *ARGS,
            "--env_workers",
            "2",
            "--iterations",
            "500",
            "--out_dir",
            str(tmp_path / "run"),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 120
    while len(_children(p.pid)) < 3 and time.time() < deadline:  # the tracker + 2 workers
        time.sleep(0.2)
    workers = [k for k in _children(p.pid) if b"spawn_main" in open(f"/proc/{k}/cmdline", "rb").read()]
    assert len(workers) >= 2, "the run never started its env workers"
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert not [w for w in workers if _running(w)], "env workers outlived the run"
    assert p.returncode != 0 and err.strip().splitlines()[-1].startswith("error: interrupted:")
    assert "Traceback" not in err
