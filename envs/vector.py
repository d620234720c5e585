"""Grouped vector env: n_groups x group_size envs; every env of a group starts from the same seed.

Envs step in-process (workers=0, fine for a toy game) or in `workers` processes, each owning a
contiguous slice of envs; a command goes to every worker before any answer is read, so slow resets
and steps overlap. Reset checks that each group really starts from one state and fails loudly if
not: a group with mixed starts silently breaks every group baseline (REFERENCE.md, section 2).
"""
import multiprocessing as mp


def _worker(conn, name, kwargs, n):
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
        if self.workers == 0:
            self.envs = [make_env(name, **env_kwargs) for _ in range(self.n)]
            return
        make_env(name, **env_kwargs)  # fail here, in the parent, on a bad name or kwargs
        ctx = mp.get_context("spawn")
        bounds = [self.n * w // self.workers for w in range(self.workers + 1)]
        self.slices = list(zip(bounds[:-1], bounds[1:]))
        self.conns, self.procs = [], []
        for lo, hi in self.slices:
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(child, name, env_kwargs, hi - lo), daemon=True)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)

    def group_of(self, i):
        return i // self.group_size

    def _call(self, cmd, items):
        """items: list of (env index, arg) -> results in the same order."""
        if self.workers == 0:
            fn = (lambda e, a: e.reset(a)) if cmd == "reset" else (lambda e, a: e.step(a))
            return [fn(self.envs[i], a) for i, a in items]
        per_worker = [[] for _ in self.slices]
        for k, (i, a) in enumerate(items):
            w = next(w for w, (lo, hi) in enumerate(self.slices) if lo <= i < hi)
            per_worker[w].append((k, i - self.slices[w][0], a))
        for w, jobs in enumerate(per_worker):
            if jobs:
                self.conns[w].send((cmd, [(i, a) for _, i, a in jobs]))
        out = [None] * len(items)
        for w, jobs in enumerate(per_worker):
            if jobs:
                for (k, _, _), res in zip(jobs, self.conns[w].recv()):
                    out[k] = res
        return out

    def reset(self, group_seeds):
        """group_seeds: one seed per group -> (list of obs, list of info), one per env."""
        if len(group_seeds) != self.n_groups:
            raise ValueError(f"reset needs {self.n_groups} group seeds, got {len(group_seeds)}")
        res = self._call("reset", [(i, group_seeds[self.group_of(i)]) for i in range(self.n)])
        obs, infos = [r[0] for r in res], [r[1] for r in res]
        for i in range(self.n):
            first = self.group_of(i) * self.group_size
            if (obs[i], infos[i].get("task")) != (obs[first], infos[first].get("task")):
                raise RuntimeError(f"group {self.group_of(i)}: env {i} starts from {obs[i]!r} but env "
                                   f"{first} from {obs[first]!r}; an env's reset must depend on the seed only")
        return obs, infos

    def step(self, actions):
        """actions: {env index: action str} for the active envs -> {index: (obs, r, term, trunc, info)}."""
        items = sorted(actions.items())
        return dict(zip([i for i, _ in items], self._call("step", items)))

    def close(self):
        for conn, p in zip(getattr(self, "conns", []), getattr(self, "procs", [])):
            try:
                conn.send(("close", None))
            except (BrokenPipeError, OSError):
                pass
            p.join(timeout=5)
