"""What happens to a run's out_dir around it: a second run (at once, or after it), a bad flag, a full
disk, Ctrl-C, a resume with other flags; and bench.sweep's own input. Each ends in one line and
keeps what the out_dir held; train.main runs in-process where it can, in a subprocess where the
test needs a second process or a signal."""

import errno
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from conftest import SMALL_RUN, iterations

import evaluate
import records
import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARGS = [*SMALL_RUN, "--metrics", "all"]  # all: the lr test reads "lr"


def saved_at(out):
    return json.load(open(out / "ckpt" / "meta.json"))["iteration"]


def snapshot(out):
    return {
        p.relative_to(out): p.read_bytes()
        for p in sorted(out.rglob("*"))
        if p.is_file() and p.name != ".lock"
    }


def untime(row):
    """A metrics row without its wall-clock figures (times, rates)."""
    return {k: v for k, v in row.items() if not k.startswith(("time", "wall")) and "per_s" not in k}


def one_line_error(excinfo, *words):
    msg = str(excinfo.value.code)
    assert msg.startswith("error: ") and "\n" not in msg, msg
    assert all(w in msg for w in words), msg
    return msg


def background_run(out, *extra):
    """train.py in its own process, long enough to be stopped by the test, checkpointing every iteration."""
    return subprocess.Popen(
        [sys.executable, "train.py", *ARGS, "--iterations", "1000", "--out_dir", str(out), *extra],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        # Ctrl-C as a terminal sends it, even where pytest runs in the background (bash then has
        # SIGINT ignored, and a child that inherits that never sees the test's SIGINT)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def wait_for_checkpoint(out, proc, timeout=300):
    meta, deadline = out / "ckpt" / "meta.json", time.time() + timeout
    while not meta.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert meta.exists(), proc.stderr.read()[-2000:] if proc.poll() is not None else "no checkpoint in time"


def test_a_second_run_in_one_out_dir_is_refused_and_a_dead_runs_lock_is_not(tmp_path):
    """Two runs in one out_dir mixed their logs; now the second stops in one line naming the first
    (its pid), and once the first is killed (kill -9: its lock file stays) --resume 1 goes on."""
    out = tmp_path / "run"
    first = background_run(out)
    try:
        wait_for_checkpoint(out, first)
        with pytest.raises(SystemExit) as e:
            train.main([*ARGS, "--iterations", "2", "--seed", "2", "--out_dir", str(out)])
        one_line_error(e, "in use", f"pid {first.pid}", "--out_dir")
    finally:
        first.kill()
        first.wait()
    k = saved_at(out)
    train.main([*ARGS, "--iterations", str(k + 1), "--out_dir", str(out), "--resume", "1"])
    assert iterations(out) == list(range(1, k + 2))


@pytest.mark.parametrize(
    "flags", [["--algo", "grpo"], ["--seed", "3"], ["--eval_only", "1", "--model", "MODEL"]]
)
def test_a_fresh_run_never_writes_over_a_run(run, flags):
    """`python train.py` then `python train.py --algo grpo` kept only the second run's metrics,
    episodes, eval, checkpoint and model; --eval_only replaced the run's eval.json. Refused in one
    line that names --resume 1 and --out_dir, the run left as it was."""
    before = snapshot(run)
    flags = [str(run / "model") if f == "MODEL" else f for f in flags]
    with pytest.raises(SystemExit) as e:
        train.main([*ARGS, "--iterations", "2", *flags, "--out_dir", str(run)])
    one_line_error(e, "holds a run", "--out_dir", *([] if "--eval_only" in flags else ["--resume 1"]))
    assert snapshot(run) == before


def test_an_eval_only_result_is_not_written_over(run, tmp_path):
    """An --eval_only folder holds only eval.json: a second --eval_only (another model) or a fresh run
    there replaced it without a word. Refused in one line, the eval left as it was; an eval cut short
    ("complete": false) is no result, and is played again there."""
    ev = tmp_path / "ev"
    train.main([*ARGS, "--eval_only", "1", "--model", str(run / "model"), "--out_dir", str(ev)])
    before = snapshot(ev)
    for flags in (["--eval_only", "1", "--model", str(run / "model")], ["--iterations", "2"]):
        with pytest.raises(SystemExit) as e:
            train.main([*ARGS, *flags, "--out_dir", str(ev)])
        one_line_error(e, "holds a run", "eval.json", "--out_dir")
        assert snapshot(ev) == before
    cut = {**json.loads((ev / "eval.json").read_text()), "complete": False}  # an eval cut short: no result
    (ev / "eval.json").write_text(json.dumps(cut))
    train.main([*ARGS, "--eval_only", "1", "--model", str(run / "model"), "--out_dir", str(ev)])
    assert json.loads((ev / "eval.json").read_text())["complete"] is True  # played again, in place


def test_eval_sets_load_ahead_and_play_as_in_turn(run, tmp_path, monkeypatch):
    """With env workers the next named eval set's envs are made, their games loading, before the set
    ahead of it plays (--eval_only: the first set's before the model is built; an ALFWorld split's
    loads were most of its eval; a run's eval: during its iteration's update); in-process envs are
    made in turn. Both give the same games, and every set's envs are closed."""
    plan = {
        name: ({"size": size}, [evaluate.HELD_OUT + k for k in range(3)])
        for name, size in (("a", 5), ("b", 6))
    }
    monkeypatch.setattr(evaluate, "eval_plan", lambda cfg: plan)
    events, made, rollout, load_model = [], evaluate.GroupedEnvs, evaluate.rollout, train.load_model

    class Envs(made):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.size = kwargs["size"]
            events.append(("made", self.size))

        def close(self):
            events.append(("closed", self.size))
            super().close()

    monkeypatch.setattr(evaluate, "GroupedEnvs", Envs)
    monkeypatch.setattr(
        evaluate, "rollout", lambda e, *a, **k: events.append(("play", e.size)) or rollout(e, *a, **k)
    )
    monkeypatch.setattr(train, "load_model", lambda *a: events.append(("build", 0)) or load_model(*a))
    order = {
        2: [("made", 5), ("build", 0), ("made", 6), ("play", 5), ("closed", 5), ("play", 6), ("closed", 6)],
        0: [("build", 0), ("made", 5), ("play", 5), ("closed", 5), ("made", 6), ("play", 6), ("closed", 6)],
    }
    games = {}
    for workers, expected in order.items():
        events.clear()
        out = tmp_path / f"ev{workers}"
        model = ["--model", str(run / "model"), "--env_workers", str(workers)]
        train.main([*ARGS, "--eval_only", "1", *model, "--out_dir", str(out)])
        assert events == expected, workers
        games[workers] = json.load(open(out / "eval.json"))["games"]
    assert (
        list(games[2]) == ["a", "b"] and all(len(g) == 3 for g in games[2].values()) and games[2] == games[0]
    )
    # in a run, an eval's first set is made before the update of its iteration (the games load meanwhile)
    update = train.update_policy
    monkeypatch.setattr(train, "update_policy", lambda *a: events.append(("update", 0)) or update(*a))
    monkeypatch.setattr(evaluate, "random_policy_success", lambda cfg, envs: {"a": 0.0, "b": 0.0})
    events.clear()
    flags = ["--iterations", "2", "--eval_every", "2", "--env_workers", "2", "--out_dir", str(tmp_path / "r")]
    train.main([*ARGS, *flags])
    assert events[events.index(("update", 0)) + 1 :] == [
        ("made", 5),
        ("update", 0),
        ("made", 6),
        ("play", 5),
        ("closed", 5),
        ("play", 6),
        ("closed", 6),
    ]


def test_a_bad_seed_stops_before_the_first_byte(run, tmp_path):
    """--seed -1 passed the checks, emptied metrics.jsonl and episodes.jsonl, then died with a
    traceback (a later --resume 1 went on with an empty log). Now: one line, nothing written."""
    before = snapshot(run)
    for args in (["--out_dir", str(run)], ["--out_dir", str(run), "--resume", "1"]):
        with pytest.raises(SystemExit) as e:
            train.main([*ARGS, "--iterations", "3", "--seed", "-1", *args])
        one_line_error(e)
        assert snapshot(run) == before
    with pytest.raises(SystemExit) as e:
        train.main([*ARGS, "--iterations", "3", "--seed", "-1", "--out_dir", str(tmp_path / "new")])
    one_line_error(e, "--seed")
    assert not os.path.exists(tmp_path / "new") or not os.listdir(tmp_path / "new")


def test_a_truncated_last_line_of_the_checkpoints_iteration_is_restored(run):
    """A metrics line cut short that is the checkpoint's own iteration was dropped and never redone
    (a gap 1 -> 3); the checkpoint holds its iteration's line, and resume puts it back."""
    lines = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    (run / "metrics.jsonl").write_text(lines[0] + lines[1][: len(lines[1]) // 2])
    train.main([*ARGS, "--iterations", "3", "--out_dir", str(run), "--resume", "1"])
    assert iterations(run) == [1, 2, 3]
    assert (run / "metrics.jsonl").read_text().splitlines(keepends=True)[1] == lines[1]


def test_the_lines_a_resume_redoes_are_kept_aside(run):
    """A crash after iteration 3's log lines, before its save: resume redoes iteration 3 and its logs
    drop the old lines, which used to be lost (a run's last iterations before a crash, say a
    diverging loss); they go to the logs' .redone.jsonl twins, a half-written line left out."""
    m, e = run / "metrics.jsonl", run / "episodes.jsonl"
    old_m = json.dumps({**json.loads(m.read_text().splitlines()[-1]), "iteration": 3, "loss": 123.0}) + "\n"
    old_e = json.dumps({"iteration": 3, "traj": 0, "steps": []}) + "\n"
    m.write_text(m.read_text() + old_m + '{"iteration": 4, "lo')
    e.write_text(e.read_text() + old_e)
    train.main([*ARGS, "--iterations", "3", "--out_dir", str(run), "--resume", "1"])
    assert iterations(run) == [1, 2, 3] and old_m not in m.read_text() and old_e not in e.read_text()
    assert (run / "metrics.redone.jsonl").read_text() == old_m
    assert (run / "episodes.redone.jsonl").read_text() == old_e


def test_a_kill_between_the_set_aside_and_the_log_s_cut_keeps_each_line_once(tmp_path):
    log = tmp_path / "metrics.jsonl"
    log.write_text("".join(f'{{"iteration": {i}}}\n' for i in (1, 2, 3, 4)))
    for _ in range(2):  # the second: a resume after a kill left the log uncut
        assert records.set_aside(str(log), 2) == ['{"iteration": 1}\n', '{"iteration": 2}\n']
    assert (tmp_path / "metrics.redone.jsonl").read_text() == '{"iteration": 3}\n{"iteration": 4}\n'
    (tmp_path / "metrics.redone.jsonl").write_text('{"iteration": 3}\n{"itera')  # a kill mid-append
    records.set_aside(str(log), 2)
    lines = (tmp_path / "metrics.redone.jsonl").read_text().splitlines()
    assert lines == ['{"iteration": 3}', '{"itera', '{"iteration": 3}', '{"iteration": 4}']


def test_save_every_checkpoints_between_evals_and_resume_goes_on_from_there(tmp_path, monkeypatch):
    """--save_every k: a checkpoint every k iterations too, evaluated or not (a lost host then costs
    fewer than k iterations); without it only evals and the end save. It leaves the training as it
    was, so a resume may change it."""
    saves, real_save = [], train.save
    monkeypatch.setattr(
        train, "save", lambda out, it, *a, **k: saves.append(it) or real_save(out, it, *a, **k)
    )
    base = [*ARGS, "--eval_every", "100", "--iterations", "5"]
    train.main([*base, "--out_dir", str(tmp_path / "a"), "--save_every", "2"])
    train.main([*base, "--out_dir", str(tmp_path / "b")])
    assert saves == [2, 4, 5, 5]
    train.main(
        [*base, "--iterations", "7", "--out_dir", str(tmp_path / "b"), "--resume", "1", "--save_every", "1"]
    )
    assert saves[4:] == [6, 7] and saved_at(tmp_path / "b") == 7


def no_space(*a, **k):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_save_on_a_full_disk_is_one_line_and_keeps_the_last_checkpoint(run, monkeypatch):
    """A save that fails for lack of space ended in library tracebacks; now it says so in one line,
    the last good checkpoint stays (no temp folder left to fill the disk), and resume goes on."""
    ckpt_model = {k: v for k, v in snapshot(run).items() if k.parts[0] in ("ckpt", "model")}
    monkeypatch.setattr(torch, "save", no_space)
    with pytest.raises(SystemExit) as e:
        train.main([*ARGS, "--iterations", "3", "--out_dir", str(run), "--resume", "1"])
    one_line_error(e, "iteration 3", "no space left on device", "keeps iteration 2")
    assert {k: v for k, v in snapshot(run).items() if k.parts[0] in ("ckpt", "model")} == ckpt_model
    assert not any(os.path.exists(run / d) for d in ("ckpt.tmp", "model.tmp"))
    monkeypatch.undo()
    train.main([*ARGS, "--iterations", "3", "--out_dir", str(run), "--resume", "1"])
    assert iterations(run) == [1, 2, 3] and saved_at(run) == 3


class HalfWrite:
    """A file whose disk fills halfway through a write."""

    def __init__(self, f):
        self.f = f

    def write(self, data):
        self.f.write(data[: len(data) // 2])
        self.f.flush()
        no_space()

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *a):
        self.f.close()


def test_the_episodes_log_never_keeps_half_a_line_on_a_full_disk(run, monkeypatch):
    real_open = open

    def full_open(path, mode="r", *a, **k):
        f = real_open(path, mode, *a, **k)
        return HalfWrite(f) if str(path).endswith("episodes.jsonl") and mode[0] == "a" else f

    monkeypatch.setattr(records, "open", full_open, raising=False)
    with pytest.raises(SystemExit) as e:
        train.main([*ARGS, "--iterations", "3", "--out_dir", str(run), "--resume", "1"])
    one_line_error(e, "episodes.jsonl", "no space left on device")
    for line in open(run / "episodes.jsonl"):
        json.loads(line)


def tmpfs_works():
    probe = "mkdir -p /tmp/gigpo-probe && mount -t tmpfs -o size=64k tmpfs /tmp/gigpo-probe"
    try:
        return (
            subprocess.run(
                ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", probe],
                capture_output=True,
                timeout=30,
            ).returncode
            == 0
        )
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.skipif(not tmpfs_works(), reason="needs unshare to mount a small tmpfs (user namespaces)")
def test_a_real_full_disk_mid_save_is_one_line(tmp_path):
    """A 3.5 MB tmpfs: the first checkpoint (~2.4 MB) fits, the second's temp copy does not. The
    libraries' own errors (`unexpected pos 704 vs 598`) never say why; the line does."""
    disk = tmp_path / "disk"
    disk.mkdir()
    script = 'mount -t tmpfs -o size=3500k tmpfs "$0" && exec "$@"'
    r = subprocess.run(
        [
            *"unshare --user --map-root-user --mount sh -c".split(),
            script,
            str(disk),
            sys.executable,
            "train.py",
            *ARGS,
            "--iterations",
            "3",
            "--out_dir",
            str(disk / "run"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert last.startswith("error: iteration 2") and "no space left on device" in last, last
    assert "keeps iteration 1" in last, last


def test_ctrl_c_is_one_line_that_says_what_was_kept(tmp_path):
    out = tmp_path / "run"
    proc = background_run(out)
    wait_for_checkpoint(out, proc)
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:  # say where it hangs (train.py's SIGUSR1 handler)
        proc.send_signal(signal.SIGUSR1)
        time.sleep(2)
        proc.kill()
        raise AssertionError(
            "no exit 120 s after Ctrl-C; stacks:\n" + proc.communicate()[1][-6000:]
        ) from None
    last = err.strip().splitlines()[-1]
    assert proc.returncode != 0 and "Traceback" not in err, err[-3000:]
    assert last.startswith("error: interrupted") and "keeps iteration" in last and "--resume 1" in last, last


def test_resume_with_more_iterations_says_the_lr_schedule_stretches(run, capsys):
    """--iterations 2 -> 4 on resume re-stretches the cosine over 4 iterations: the lr jumps up
    (here 5.5x: iteration 3 at 0.55 of --lr, where the 2-iteration schedule had ended at 0.1).
    Accepted (a finished run can be trained on), and said in one line at start. The log shows the
    lr each iteration trained at (it showed the next one's: iteration 1 not at --lr)."""
    from policy import lr_scale

    train.main([*ARGS, "--iterations", "4", "--out_dir", str(run), "--resume", "1"])
    lrs = [json.loads(line)["lr"] for line in open(run / "metrics.jsonl")]
    cfg = train.Config()  # iterations 1-2 on the 2-iteration schedule, 3-4 on the 4-iteration one
    at = [lr_scale(k, n, cfg.lr_min) for k, n in ((0, 2), (1, 2), (2, 4), (3, 4))]
    assert lrs == pytest.approx([cfg.lr * s for s in at])
    assert at[2] / lr_scale(2, 2, cfg.lr_min) == pytest.approx(5.5)
    assert "note: --iterations 2 -> 4 stretches the cosine lr schedule" in capsys.readouterr().out


@pytest.mark.parametrize(
    "flags",
    [
        ["--log_groups", "0"],
        ["--engine", "auto"],
        ["--kv_cache_mb", "64"],
        ["--compile", "0"],
        ["--grad_ckpt", "1", "--micro_batch_tokens", "512"],  # a run out of GPU memory goes on with less
        ["--env_args", "size=5"],
    ],
)
def test_resume_accepts_flags_that_leave_training_as_it_was(run, flags):
    args = [a for a in ARGS if a not in ("--engine", "hf")] if "--engine" in flags else ARGS
    train.main([*args, "--iterations", "3", "--out_dir", str(run), "--resume", "1", *flags])
    assert iterations(run) == [1, 2, 3]


def test_resume_of_a_checkpoint_older_than_a_flag_takes_the_flags_default(run):
    """A checkpoint whose config lacks a flag added since (here: tied_step) resumes when the flag is
    at its default (the behaviour the run had), and is refused when it is not."""
    meta_path = run / "ckpt" / "meta.json"
    meta = json.load(open(meta_path))
    del meta["config"]["tied_step"]
    json.dump(meta, open(meta_path, "w"))
    with pytest.raises(SystemExit) as e:
        train.main([*ARGS, "--iterations", "3", "--out_dir", str(run), "--resume", "1", "--tied_step", "0"])
    one_line_error(e, "--tied_step True -> False")
    train.main([*ARGS, "--iterations", "3", "--out_dir", str(run), "--resume", "1"])
    assert iterations(run) == [1, 2, 3]


def test_resume_still_refuses_env_args_that_change_the_env(run):
    with pytest.raises(SystemExit) as e:
        train.main(
            [*ARGS, "--iterations", "3", "--out_dir", str(run), "--resume", "1", "--env_args", "size=6"]
        )
    one_line_error(e, "--env_args", "another config")
    with pytest.raises(SystemExit) as e:  # with another changed flag, env_args is still named
        train.main([*ARGS, "--iterations", "3", "--out_dir", str(run), "--resume", "1", "--lr", "0.5",
                    "--env_args", "size=6"])  # fmt: skip
    one_line_error(e, "--env_args", "--lr")


def test_resume_takes_the_random_policy_from_the_checkpoint_unless_the_eval_changed(run, monkeypatch, capsys):
    """The random policy's eval success is played once a run and kept in the checkpoint (ALFWorld's two
    splits take minutes at every start otherwise); --env_args written another way plays it again."""
    meta = json.load(open(run / "ckpt" / "meta.json"))  # the rates the finished run saved
    (rates,) = meta["random_policy"].values()
    real, calls = evaluate.random_policy_success, []
    monkeypatch.setattr(evaluate, "random_policy_success", lambda *a: calls.append(1) or real(*a))
    train.main([*ARGS, "--iterations", "3", "--out_dir", str(run), "--resume", "1"])
    out = capsys.readouterr().out
    assert calls == [] and f"success {train.success_text(rates)} (as played before the checkpoint)" in out
    assert json.load(open(run / "ckpt" / "meta.json"))["random_policy"] == meta["random_policy"]
    train.main([*ARGS, "--iterations", "4", "--out_dir", str(run), "--resume", "1", "--env_args", "size=5"])
    assert calls == [1] and "as played before" not in capsys.readouterr().out


def test_the_random_policy_plays_beside_the_build_and_training_and_ends_before_an_eval_or_a_save(
    tmp_path, monkeypatch
):
    """The random play runs in a thread (ALFWorld's two splits take minutes): it starts before the
    policy's build and training (its envs in worker processes) does not wait for it: here the play
    waits for iteration 1's update, which it would never see if main waited for it first. An eval
    (the same env workers) and a save (the checkpoint keeps its rates) wait for it to end; with
    in-process envs, the first rollout does. An error in the play is raised in main."""
    started, updated, ended = threading.Event(), threading.Event(), threading.Event()
    real_build, real_play, real_update = (
        train.build_policy,
        evaluate.random_policy_success,
        train.update_policy,
    )
    real_eval, real_save = train.evaluate, train.save

    def play(*a):
        started.set()
        assert updated.wait(60), "training waited for the random policy's play"
        time.sleep(0.5)  # still playing when iteration 1 reaches its eval or save (microseconds on)
        rates = real_play(*a)
        ended.set()
        return rates

    def build(*a):
        assert started.wait(60), "the random policy did not start before the policy's build ended"
        return real_build(*a)

    def update(*a):
        out = real_update(*a)
        updated.set()
        return out

    def after_play(real):
        def call(*a, **k):
            assert ended.is_set(), f"{real.__name__} did not wait for the random policy's play"
            return real(*a, **k)

        return call

    monkeypatch.setattr(evaluate, "random_policy_success", play)
    monkeypatch.setattr(train, "build_policy", build)
    monkeypatch.setattr(train, "update_policy", update)
    monkeypatch.setattr(train, "evaluate", after_play(real_eval))
    monkeypatch.setattr(train, "save", after_play(real_save))
    for name, when in ("a", ["--eval_every", "1"]), ("b", ["--eval_every", "9", "--save_every", "1"]):
        for event in (started, updated, ended):  # a: an eval at iteration 1; b: a save, no eval
            event.clear()
        flags = [*ARGS, "--iterations", "2", *when, "--env_workers", "2", "--out_dir", str(tmp_path / name)]
        train.main(flags)
        (rates,) = json.load(open(tmp_path / name / "ckpt" / "meta.json"))["random_policy"].values()
        assert set(rates) == {"held-out"} and 0 <= rates["held-out"] <= 1
    # in-process envs (--env_workers 0): training waits for the play (a library's state may be shared)
    slow_play = lambda *a: (time.sleep(1), real_play(*a), ended.set())[1]  # noqa: E731 (outlasts the build)
    monkeypatch.setattr(evaluate, "random_policy_success", slow_play)
    monkeypatch.setattr(train, "collect", after_play(train.collect))
    ended.clear()
    train.main([*ARGS, "--iterations", "1", "--env_workers", "0", "--out_dir", str(tmp_path / "in_process")])
    monkeypatch.setattr(evaluate, "random_policy_success", lambda *a: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        train.main([*ARGS, "--iterations", "1", "--out_dir", str(tmp_path / "c")])


# ---- bench.sweep ----
def sweep(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "bench.sweep", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.parametrize(
    "runs, words",
    [
        (["a=", "a=--algo grpo"], "--run a"),  # overwrote the first config's run dirs
        (["a=--seed 3"], "--seed"),  # every "seed" was the same run
        (["a=--out_dir x"], "--out_dir"),  # every seed in one out_dir
        (["a=--algo 'grpo"], "--run a"),  # unbalanced quote: a traceback
        (["a/b=--algo grpo"], "--run a/b"),  # '/' in a name: a traceback
    ],
)
def test_sweep_bad_runs_are_one_line_before_any_run(tmp_path, runs, words):
    r = sweep(
        "--out", str(tmp_path / "sweep"), "--seeds", "0", "1", *[x for run in runs for x in ("--run", run)]
    )
    lines = r.stderr.strip().splitlines()
    assert r.returncode != 0 and len(lines) == 1, r.stderr
    assert lines[0].startswith("error: ") and words in lines[0], r.stderr
    assert not os.path.exists(tmp_path / "sweep") or not os.listdir(tmp_path / "sweep")


def test_sweep_of_failed_runs_exits_nonzero_without_a_p_value(tmp_path):
    """Runs that fail (here a bad flag) gave rows of NaN, a p-value computed from them and exit 0."""
    r = sweep(
        "--out",
        str(tmp_path / "sweep"),
        "--seeds",
        "0",
        "1",
        "--parallel",
        "2",
        "--run",
        "a=--lr -1",
        "--run",
        "b=--lr -2",
    )
    assert r.returncode != 0, r.stdout
    assert "p = " not in r.stdout, r.stdout
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: 4 of 4 runs failed") and "a-s0.log" in last, r.stderr
    # the first failed run's own one-line error, which was only in its log
    assert "(a-s0: error: --lr -1.0 must be > 0; logs: " in last, r.stderr


def test_sweep_parallel_0_is_one_line_before_any_run(tmp_path):
    """--parallel 0 was a ValueError traceback from the thread pool, after making --out."""
    r = sweep("--out", str(tmp_path / "sweep"), "--seeds", "0", "--parallel", "0", "--run", "a=")
    assert r.returncode != 0 and r.stderr.strip().splitlines() == [
        "error: --parallel 0: give 1 or more (the runs at a time)"
    ], r.stderr
    assert not os.path.exists(tmp_path / "sweep")


def test_sweep_report_of_no_runs_is_one_line_and_makes_no_folder(tmp_path):
    """--report on a missing --out made it and reported each run as failed."""
    r = sweep("--report", "--out", str(tmp_path / "none"), "--run", "a=")
    assert r.returncode != 0 and r.stderr.strip().splitlines() == [
        f"error: bench.sweep --report: {tmp_path / 'none'}: no such folder "
        "(run the sweep first, without --report)"
    ], r.stderr
    assert not os.path.exists(tmp_path / "none") and not r.stdout
    (tmp_path / "other" / "b-s0").mkdir(parents=True)  # another config's runs only
    (tmp_path / "other" / "b-s0" / "metrics.jsonl").write_text('{"iteration": 1}\n')
    r = sweep("--report", "--out", str(tmp_path / "other"), "--seeds", "0", "--run", "a=")
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "holds none of the runs' folders" in r.stderr and not r.stdout, r.stderr
    assert os.listdir(tmp_path / "other") == ["b-s0"]


def test_sweep_refuses_an_out_that_holds_runs(tmp_path):
    (tmp_path / "sweep" / "a-s0").mkdir(parents=True)
    (tmp_path / "sweep" / "a-s0" / "metrics.jsonl").write_text('{"iteration": 1}\n')
    r = sweep("--out", str(tmp_path / "sweep"), "--seeds", "0", "--run", "a=")
    assert r.returncode != 0 and r.stderr.strip().startswith("error: ") and "--report" in r.stderr, r.stderr


def test_env_workers_and_their_prefetched_resets_train_as_in_process_envs(done_run, tmp_path, monkeypatch):
    """--env_workers 2 (the next iteration's games reset by the workers during the update, and the
    first iteration's during the policy's build: GroupedEnvs.prefetch) trains on the samples
    in-process envs give: the same metrics, times aside."""
    from envs.vector import GroupedEnvs

    calls, real_prefetch, real_build = [], GroupedEnvs.prefetch, train.build_policy
    monkeypatch.setattr(GroupedEnvs, "prefetch", lambda e, s: calls.append(list(s)) or real_prefetch(e, s))
    monkeypatch.setattr(train, "build_policy", lambda *a: calls.append("build") or real_build(*a))
    out = tmp_path / "workers"
    train.main([*ARGS, "--iterations", "2", "--env_workers", "2", "--out_dir", str(out)])
    n = train.parse_args(ARGS).n_groups
    seeds = lambda it: [train.train_seed(0, it, g, n) for g in range(n)]  # noqa: E731
    assert calls == [seeds(1), "build", seeds(2)]  # iteration 1's games asked for before the build
    untimed = [[untime(json.loads(line)) for line in open(d / "metrics.jsonl")] for d in (done_run, out)]
    assert untimed[0] == untimed[1] and len(untimed[0]) == 2


def test_a_lora_checkpoint_holds_the_adapters_resumes_exactly_and_checks_its_base(tmp_path):
    """--lora_rank: ckpt/ holds the adapters and their optimizer state, not the frozen base (nor its
    lm_head tied to the embeddings); --resume reloads the base from --model and continues exactly as an
    uninterrupted run; a base that changed since is one line."""
    from tiny import build_tiny

    def save_base(seed):
        model, tok = build_tiny("treasure", seed=seed)
        model.save_pretrained(tmp_path / "base")
        tok.save_pretrained(tmp_path / "base")

    save_base(0)
    lora = [*ARGS, "--model", str(tmp_path / "base"), "--lora_rank", "4", "--lr_min", "1.0"]
    train.main([*lora, "--iterations", "3", "--out_dir", str(tmp_path / "whole")])
    train.main([*lora, "--iterations", "2", "--out_dir", str(tmp_path / "cut")])
    import torch.distributed.checkpoint as dcp

    saved = dcp.FileSystemReader(str(tmp_path / "cut" / "ckpt")).read_metadata().state_dict_metadata
    weights = [k for k in saved if k.startswith("model.")]
    assert weights and all("lora_" in k for k in weights), weights  # not the base, nor its tied lm_head
    train.main([*lora, "--iterations", "3", "--out_dir", str(tmp_path / "cut"), "--resume", "1"])
    untimed = [
        [untime(json.loads(line)) for line in open(tmp_path / d / "metrics.jsonl")] for d in ("whole", "cut")
    ]
    assert untimed[0] == untimed[1] and len(untimed[0]) == 3
    save_base(1)  # another base under the same path
    with pytest.raises(SystemExit) as e:
        train.main([*lora, "--iterations", "4", "--out_dir", str(tmp_path / "cut"), "--resume", "1"])
    one_line_error(e, "frozen base weights", "same base model")


# ---- plots.py and python -m evaluate ----
@pytest.mark.parametrize("n, kept", [(0, []), (2, [3, 4]), (9, [0, 1, 2, 3, 4])])
def test_plots_embeds_the_newest_max_episodes_and_0_embeds_none(tmp_path, capsys, n, kept):
    """--max_episodes 0 embedded every episode ([-0:]), and 9 of 5 must not wrap around."""
    import plots

    (tmp_path / "metrics.jsonl").write_text(
        "".join(f'{{"iteration": {i}, "success": 0.5}}\n' for i in (1, 2))
    )
    (tmp_path / "episodes.jsonl").write_text("".join(json.dumps({"traj": k}) + "\n" for k in range(5)))
    plots.main([str(tmp_path), "--max_episodes", str(n)])
    assert f"(2 iterations, {len(kept)} episodes)" in capsys.readouterr().out
    page = (tmp_path / "report.html").read_text()
    assert f"const EPISODES = {json.dumps([{'traj': k} for k in kept])};" in page


def test_plots_refuses_a_negative_max_episodes_in_one_line(tmp_path):
    """-1 embedded all but the oldest episode."""
    import plots

    (tmp_path / "metrics.jsonl").write_text('{"iteration": 1, "success": 0.5}\n')
    with pytest.raises(SystemExit) as e:
        plots.main([str(tmp_path), "--max_episodes", "-1"])
    one_line_error(e, "--max_episodes -1", "0 or more")
    assert not (tmp_path / "report.html").exists()


@pytest.mark.parametrize("argv", [["--help"], ["-h"], ["--help", "c1"], ["a", "b", "-h"]])
def test_evaluate_help_anywhere_prints_the_usage_and_exits_0(capsys, argv):
    """--help exited 1, and `--help c1` read --help as an eval.json."""
    evaluate.main(argv)  # returns: exit status 0
    assert capsys.readouterr().out.startswith("usage: python -m evaluate RUN_A RUN_B")
