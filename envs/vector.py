"""Grouped vector env: n_groups x group_size envs; every env of a group starts from the same seed.

Envs step in-process (workers=0, fine for a toy game) or in `workers` processes, each owning a
contiguous slice of envs; a command goes to every worker before any answer is read, so slow resets
and steps overlap. step() waits for its results; send() starts steps and receive() collects those
done, so the rollout can generate for some envs while others step (rollout.py); prefetch() starts
the next reset, so the workers load the next games while the trainer updates. Reset checks that
each group really starts from one state and fails loudly if not: a group with mixed starts silently
breaks every group baseline.

A worker that dies (a crashing game engine, the OOM killer) costs its episodes, not the run: it is
restarted with fresh envs, its envs' running episodes end as truncated (on their last observation,
info["worker_died"] = True; train.py neither trains on them nor counts them in success, an eval
leaves them out, and an iteration that loses every episode stops the run in one line), and a line
goes to stderr; a reset is retried once on the new worker.
"""

import multiprocessing as mp
import multiprocessing.connection
import signal
import sys
import threading

from tqdm import tqdm


def _worker(conn, name, kwargs, n):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's: it stops the workers
    from envs import make_env

    envs = [make_env(name, **kwargs) for _ in range(n)]
    while True:
        cmd, payload = conn.recv()
        if cmd == "close":
            break
        if cmd == "reset":
            conn.send([envs[i].reset(seed) for i, seed in payload])
        elif cmd == "step":
            conn.send([envs[i].step(a) for i, a in payload])


class GroupedEnvs:
    def __init__(self, name, n_groups, group_size, workers=0, **env_kwargs):
        from envs import make_env

        self.n_groups, self.group_size = n_groups, group_size
        self.n = n_groups * group_size
        self.workers = min(workers, self.n)
        self.last = [("", {})] * self.n  # last (obs, info) of each env: where a dead worker's episodes end
        self.restarts, self.ready, self.in_flight = 0, {}, []  # ready: steps done, not yet received
        self.dead = set()  # envs of a restarted worker: unplayable until the next reset
        self.early = None  # a prefetched reset (prefetch), not yet collected
        if self.workers == 0:
            self.envs = [make_env(name, **env_kwargs) for _ in range(self.n)]
            return
        make_env(name, **env_kwargs)  # fail here, in the parent, on a bad name or kwargs
        self.name, self.env_kwargs, self.ctx = name, env_kwargs, mp.get_context("spawn")
        bounds = [self.n * w // self.workers for w in range(self.workers + 1)]
        self.slices = list(zip(bounds[:-1], bounds[1:]))
        self.conns, self.procs = [None] * self.workers, [None] * self.workers
        self.in_flight = [[] for _ in range(self.workers)]  # per worker: env indices of each step sent
        for w in range(self.workers):
            self._start(w)

    def _start(self, w):
        lo, hi = self.slices[w]
        parent, child = self.ctx.Pipe()
        p = self.ctx.Process(target=_worker, args=(child, self.name, self.env_kwargs, hi - lo), daemon=True)
        p.start()
        child.close()  # the worker holds the only other end: its death is then an EOF here, not a hang
        self.conns[w], self.procs[w] = parent, p

    def _restart(self, w, cmd, n_jobs):
        # the interpreter exits and ends the workers under a thread still stepping them (train.py's
        # random play, cut short by Ctrl-C): no restart, no message
        if not threading.main_thread().is_alive():
            raise RuntimeError("the process is exiting: no env worker is restarted")
        old = self.procs[w]
        old.join(timeout=1)
        if old.is_alive():  # the pipe broke but the process lingers
            old.kill()
            old.join()
        lo, hi = self.slices[w]
        # tqdm.write: a line of its own, not appended to train.py's progress bar (stderr, no newline)
        tqdm.write(
            f"env worker {w} (envs {lo}..{hi - 1}) died (exit code {old.exitcode}) during {cmd} of "
            f"{n_jobs} env(s); restarted, "
            + ("retrying the reset" if cmd == "reset" else "their episodes end as truncated"),
            file=sys.stderr,
        )
        self.conns[w].close()
        self._start(w)
        self.restarts += 1

    def group_of(self, i):
        return i // self.group_size

    def _worker_of(self, i):
        return next(w for w, (lo, hi) in enumerate(self.slices) if lo <= i < hi)

    def _reset_start(self, items):
        """Send a reset to the workers: items: list of (env index, seed) -> what _reset_end reads."""
        per_worker = [[] for _ in self.slices]
        for k, (i, a) in enumerate(items):
            w = self._worker_of(i)
            per_worker[w].append((k, i - self.slices[w][0], a))
        return (
            items,
            per_worker,
            {w: self._send(w, "reset", jobs) for w, jobs in enumerate(per_worker) if jobs},
        )

    def _reset_end(self, started):
        """The results of a sent reset, in the order of its items (a dead worker is restarted and its
        part of the reset sent once more)."""
        items, per_worker, sent = started
        out = [None] * len(items)
        for w, jobs in enumerate(per_worker):
            if not jobs:
                continue
            results = self._recv(w) if sent[w] else None
            if results is None:
                self._restart(w, "reset", len(jobs))
                # nothing has happened yet: try once more on the fresh worker
                results = self._recv(w) if self._send(w, "reset", jobs) else None
                if results is None:
                    raise RuntimeError(f"env worker {w} died twice while resetting; see stderr")
            for (k, _, _), res in zip(jobs, results):
                out[k] = res
        return out

    def _send(self, w, cmd, jobs):
        try:
            self.conns[w].send((cmd, [(i, a) for _, i, a in jobs]))
            return True
        except (BrokenPipeError, ConnectionResetError, OSError):
            return False

    def _recv(self, w):
        try:
            return self.conns[w].recv()
        except (EOFError, ConnectionResetError, OSError):
            return None

    def _truncated(self, i):
        obs, info = self.last[i]
        return obs, 0.0, False, True, {**info, "won": False, "worker_died": True}

    def reset(self, group_seeds):
        """group_seeds: one seed per group -> (list of obs, list of info), one per env."""
        if len(group_seeds) != self.n_groups:
            raise ValueError(f"reset needs {self.n_groups} group seeds, got {len(group_seeds)}")
        items = [(i, group_seeds[self.group_of(i)]) for i in range(self.n)]
        self.receive("all")  # steps a caller sent and never received (it raised): not read as resets
        early, self.early, self.dead = self.early, None, set()
        if self.workers == 0:
            res = [self.envs[i].reset(seed) for i, seed in items]
        elif early and early[0] == items:  # prefetched: the workers have (mostly) done it already
            res = self._reset_end(early)
        else:
            if early:  # another reset was prefetched: read its results away
                self._reset_end(early)
            res = self._reset_end(self._reset_start(items))
        obs, infos = [r[0] for r in res], [r[1] for r in res]
        self.last = list(zip(obs, infos))
        for i in range(self.n):
            first = self.group_of(i) * self.group_size
            if (obs[i], infos[i].get("task")) != (obs[first], infos[first].get("task")):
                raise RuntimeError(
                    f"group {self.group_of(i)}: env {i} starts from {obs[i]!r} but env "
                    f"{first} from {obs[first]!r}; an env's reset must depend on the seed only"
                )
        return obs, infos

    def prefetch(self, group_seeds):
        """Start the reset of these group seeds now and return at once, so the workers load the next
        games while the trainer updates (train.py, after each rollout); reset() with the same seeds
        then only collects it. In-process envs, or steps still in flight: nothing to do."""
        if self.workers and not any(self.in_flight) and not self.early:
            self.early = self._reset_start([(i, group_seeds[self.group_of(i)]) for i in range(self.n)])

    def step(self, actions):
        """actions: {env index: action str} for the active envs -> {index: (obs, r, term, trunc, info)}."""
        self.send(actions)
        return self.receive("all")

    def send(self, actions):
        """Start stepping these envs ({env index: action str}) and return at once (in-process envs
        step here); receive() collects the results. Each worker gets one message per call."""
        if self.workers == 0:
            self.ready.update({i: self.envs[i].step(a) for i, a in sorted(actions.items())})
            return
        per_worker = {}
        for i, a in sorted(actions.items()):
            if i in self.dead:  # its worker died while its reply was generated: its episode ends here
                self.ready[i] = self._truncated(i)
            else:
                per_worker.setdefault(self._worker_of(i), []).append((i, a))
        for w, jobs in per_worker.items():
            self.in_flight[w].append([i for i, _ in jobs])
            if not self._send(w, "step", [(None, i - self.slices[w][0], a) for i, a in jobs]):
                self._lost(w)

    def receive(self, until="all"):
        """The results of sent steps -> {env index: (obs, r, term, trunc, info)}: until="all" waits for
        every one; "any" for at least one (where any is in flight); "now" takes those ready."""
        out, self.ready = self.ready, {}
        while any(self.in_flight):
            block = until == "all" or until == "any" and not out
            busy = {self.conns[w]: w for w, q in enumerate(self.in_flight) if q}
            answered = mp.connection.wait(list(busy), timeout=None if block else 0)
            if not answered:
                break
            for conn in answered:
                w = busy[conn]
                results = self._recv(w)
                if results is None:
                    self._lost(w)
                else:
                    out.update(zip(self.in_flight[w].pop(0), results))
        out.update(self.ready)  # the steps of workers lost meanwhile
        self.ready = {}
        for i, (obs, _, _, _, info) in out.items():
            self.last[i] = (obs, info)
        return out

    def _lost(self, w):
        """Worker w died: restart it; every step it had in flight ends truncated (in self.ready), and
        so does the next step of each of its other envs (--overlap: their replies were being made),
        as the fresh worker's envs hold no game until the next reset."""
        jobs = [i for q in self.in_flight[w] for i in q]
        self.in_flight[w] = []
        self.dead.update(range(*self.slices[w]))
        self._restart(w, "step", len(jobs))
        self.ready.update({i: self._truncated(i) for i in jobs})

    def close(self):
        for env in getattr(self, "envs", []):  # in-process: an ALFWorld game frees its planner library here
            env.close()
        for conn, p in zip(getattr(self, "conns", []), getattr(self, "procs", [])):
            try:
                conn.send(("close", None))
            except (BrokenPipeError, OSError):
                pass
            p.join(timeout=5)
            if p.is_alive():  # still loading a prefetched game, say
                p.terminate()
