"""AppWorld: do a day-to-day task by writing Python that calls the APIs of nine apps (Spotify, Venmo,
Gmail, Simple Note, ...) and of a supervisor (Trivedi et al. 2024, "AppWorld: A Controllable World
of Apps and People for Benchmarking Interactive Coding Agents", repository stonybrooknlp/appworld;
verl-agent's appworld env plays the same game). AppWorld itself runs in its own virtualenv (it pins
pydantic < 2 and an old fastapi, which cannot share one with vLLM): this env only speaks HTTP to
`appworld serve environment`, one server per env, and never imports appworld.

    obs:    first the supervisor and the task ("My name is: ... Task: <instruction>"), as AppWorld's
            own agents show it; after a step, what the code printed (or its traceback)
    action: Python source, run in the task's world (prompts/appworld.py pulls it out of a reply);
            "" (an unreadable reply) is invalid: a no-op step that runs nothing
    reward: 1.0 when the task's own evaluation passes (every test of `evaluate()`: success), else 0,
            evaluated once the code marks the task complete (apis.supervisor.complete_task) or after
            max_steps (50) steps; won = success; info["tests"] = "passed/total"
    task_type: the app(s) the task needs ("spotify", "gmail+venmo"), for per-type eval results
    admissible_actions: suggestions only (the random baseline, the tiny model's vocabulary): list
            the apps, show the task, give up with no answer

Servers and data (`--env_args` or the environment):
    servers=URL;URL;...  or $APPWORLD_SERVERS: AppWorld environment servers (`python -m envs.appworld
            serve N` starts N); each env takes one no other env holds (a lock file per server, held
            while the process lives), at its first reset, so any layout of --env_workers finds one
    data_dir=DIR  or $APPWORLD_ROOT: AppWorld's root (the servers' too): DIR/data/datasets/<split>.txt
            lists the split's task ids, DIR/data/tasks/<id>/ holds each task (the task type is read here)
Tasks: reset(seed) plays task seed % N of the split (train, dev, test_normal, test_challenge); the
eval set "test_normal" plays that split in order. `python -m envs.demo appworld DIR` writes a small
task set in AppWorld's own format (made with AppWorld's code) for the tests and a demo.
"""

import fcntl
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import gymnasium

from envs import TextSpace

SPLITS = ("train", "dev", "test_normal", "test_challenge")
INVALID = (
    "Your previous reply had no code to run. Reason inside <think> </think>, then put the Python "
    "code to run between <code> and </code>."
)
SUGGESTED = [
    "print(apis.api_docs.show_app_descriptions())",
    "print(apis.supervisor.show_active_task())",
    "apis.supervisor.complete_task(status='fail')",
]
SERVE_HINT = (
    "start them with `python -m envs.appworld serve N` and give --env_args servers=URL;URL or "
    "$APPWORLD_SERVERS"
)
TINY_CORPUS_EPISODES = 4  # each one needs a server: keep the tiny model's corpus small
VENV = os.environ.get("APPWORLD_VENV", os.path.expanduser("~/appworld-venv"))


def data_root(data_dir=None):
    root = data_dir or os.environ.get("APPWORLD_ROOT")
    if not root or not os.path.isdir(os.path.join(root, "data", "datasets")):
        raise FileNotFoundError(
            f"appworld: no AppWorld data ({root or 'no root given'}): give --env_args data_dir=DIR or set "
            f"$APPWORLD_ROOT to a folder with data/datasets and data/tasks (`python -m envs.appworld "
            f"install` downloads them), or make the demo set: python -m envs.demo appworld DIR"
        )
    return root


def task_ids(root, split):
    path = os.path.join(root, "data", "datasets", f"{split}.txt")
    if not os.path.exists(path):
        raise FileNotFoundError(f"appworld: no {path}: the {split} split's task ids, one a line")
    with open(path) as f:  # AppWorld's load_task_ids: "id[:tag]" lines
        ids = [line.split(":")[0].strip() for line in f if line.strip()]
    if not ids:
        raise FileNotFoundError(f"appworld: {path} lists no task")
    return ids


def task_type(root, task_id):
    """The apps the task needs, "+"-joined: ground_truth/required_apps.json where the data has it, else
    the apps its evaluation.py reads (models.start.APP / models.end.APP), else "unknown"; the supervisor
    app counts only where it is the only one (every task talks to it)."""
    folder = os.path.join(root, "data", "tasks", task_id, "ground_truth")
    try:
        with open(os.path.join(folder, "required_apps.json")) as f:
            apps = set(json.load(f))
    except (OSError, ValueError):
        try:
            with open(os.path.join(folder, "evaluation.py")) as f:
                apps = set(re.findall(r"models\.(?:start|end)\.(\w+)\.", f.read()))
        except OSError:
            apps = set()
    apps -= {"admin", "api_docs"} | ({"supervisor"} if len(apps - {"admin", "api_docs"}) > 1 else set())
    return "+".join(sorted(apps)) or "unknown"


def servers_list(servers=None):
    text = servers or os.environ.get("APPWORLD_SERVERS", "")
    return [u.strip().rstrip("/") for u in re.split(r"[;\s]+", text) if u.strip()]


def claim_server(urls):
    """-> (url, open lock file) of a server no other env holds. flock: the kernel frees it when the
    process dies, so a restarted env worker finds its dead predecessor's servers free again."""
    folder = os.path.join(tempfile.gettempdir(), "gigpo-appworld-locks")
    os.makedirs(folder, exist_ok=True)
    for url in urls:
        lock = open(os.path.join(folder, hashlib.sha1(url.encode()).hexdigest()[:16]), "w")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return url, lock
        except OSError:
            lock.close()
    raise RuntimeError(
        f"appworld: all {len(urls)} AppWorld servers are held by other envs; each env needs "
        f"its own: {SERVE_HINT}"
    )


def call(url, method, timeout=600, **body):
    """POST url/method with a JSON body -> its "output" (AppWorld's environment server protocol)."""
    request = urllib.request.Request(
        f"{url}/{method}", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.load(response)["output"]
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")[:300]
        raise RuntimeError(f"appworld: server {url} failed on /{method} (HTTP {e.code}): {detail}") from None
    except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
        reason = getattr(e, "reason", e)
        raise RuntimeError(
            f"appworld: no AppWorld environment server answers at {url} ({reason}): {SERVE_HINT}"
        ) from None


class AppWorld(gymnasium.Env):
    def __init__(self, data_dir=None, split="train", servers="", max_steps=50, timeout=600):
        if split not in SPLITS or type(max_steps) is not int or max_steps < 1:
            raise ValueError(
                f"appworld: split must be one of {', '.join(SPLITS)} and max_steps an integer "
                f">= 1; got split={split!r} max_steps={max_steps!r}"
            )
        self.root, self.split, self.max_steps, self.timeout = data_root(data_dir), split, max_steps, timeout
        self.tasks = task_ids(self.root, split)
        self.urls, self.url, self.lock = servers_list(servers), None, None
        self.task_id, self.open = None, False  # open: a task world is up on the server
        self.observation_space, self.action_space = TextSpace(), TextSpace(SUGGESTED)

    def _server(self):
        if self.url is None:  # at the first reset, not in __init__: train.py's checks build unplayed envs
            if not self.urls:
                raise RuntimeError(f"appworld: no AppWorld server given: {SERVE_HINT}")
            self.url, self.lock = claim_server(self.urls)
        return self.url

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        seed = seed if seed is not None else int(self.np_random.integers(2**62))
        url = self._server()
        self._close_task()
        self.task_id, self.steps, self.done = self.tasks[seed % len(self.tasks)], 0, False
        # experiment_name: each server writes its world's state under experiments/outputs/<name>/, and the
        # envs of a group play one task: one name per server keeps their files apart
        out = call(
            url,
            "initialize",
            self.timeout,
            task_id=self.task_id,
            experiment_name="gigpo-" + re.sub(r"\W+", "-", url.split("//")[-1]),
        )
        self.open, sup = True, out["supervisor"]
        obs = (
            f"My name is: {sup['first_name']} {sup['last_name']}. My personal email address is: "
            f"{sup['email']} and phone number: {sup['phone_number']}.\nTask: {out['instruction']}"
        )
        self.first_obs, self.type = obs, task_type(self.root, self.task_id)  # the prompt shows it every step
        return obs, self._info(False, obs)

    def step(self, action):
        if self.task_id is None or self.done:
            raise RuntimeError("appworld: step() before reset() or after the episode ended")
        self.steps += 1
        code = action if isinstance(action, str) else ""
        if code.strip():
            obs = call(self.url, "execute", self.timeout, task_id=self.task_id, code=code)
            completed = bool(call(self.url, "task_completed", self.timeout, task_id=self.task_id))
        else:
            obs, completed = INVALID, False
        truncated = not completed and self.steps >= self.max_steps
        won, info = False, {}
        if completed or truncated:
            result = call(self.url, "evaluate", self.timeout, task_id=self.task_id, suppress_errors=True)
            won = bool(result["success"])
            info["tests"] = f"{len(result.get('passes', []))}/{result.get('num_tests', 0)}"
            self.done = True
            self._close_task()
        return obs, float(won), completed, truncated, {**self._info(won, obs), **info}

    def _info(self, won, obs):
        # the anchor is the output the code just printed: GiGPO groups the steps of a group that saw the same
        return {
            "task": self.first_obs,
            "admissible_actions": list(SUGGESTED),
            "won": won,
            "anchor": obs,
            "task_type": self.type,
            "task_id": self.task_id,
        }

    def _close_task(self):
        """Frees the server's world (its in-memory databases); a server already gone needs nothing freed."""
        if self.open:
            self.open = False
            try:
                call(self.url, "close", 30, task_id=self.task_id)
            except RuntimeError:
                pass

    def close(self):
        self._close_task()
        if self.lock is not None:
            self.lock.close()
            self.lock, self.url = None, None


def eval_sets(n=None, names=None, **env_args):
    """One eval set, "test_normal" (verl-agent's): that split in order."""
    if any(x != "test_normal" for x in names or ()):
        raise ValueError(f"--eval_sets {','.join(names)}: appworld has the eval set test_normal")
    count = len(AppWorld(**{**env_args, "split": "test_normal"}).tasks)
    return {"test_normal": ({"split": "test_normal"}, list(range(min(count, n or count))))}


def serve(n, root, port=8000, venv=VENV):
    """Start n environment servers on ports port..port+n-1 (AppWorld's venv, root `root`, each logging to
    root/server-PORT.log), wait until each answers -> (their URLs as $APPWORLD_SERVERS wants them, the
    processes)."""
    exe = os.path.join(venv, "bin", "appworld")
    if not os.path.exists(exe):
        raise FileNotFoundError(
            f"appworld: no {exe}: run `python -m envs.appworld install` (or set $APPWORLD_VENV)"
        )
    procs, urls = [], [f"http://127.0.0.1:{port + i}" for i in range(n)]
    logs = [os.path.join(root, f"server-{port + i}.log") for i in range(n)]  # a file: a pipe would fill
    for i in range(n):
        with open(logs[i], "w") as log:
            command = [
                exe,
                "serve",
                "environment",
                "--port",
                str(port + i),
                "--root",
                root,
                "--no-show-usage",
            ]
            procs.append(
                subprocess.Popen(
                    command, env={**os.environ, "APPWORLD_ROOT": root}, stdout=log, stderr=subprocess.STDOUT
                )
            )
    for url, p, log in zip(urls, procs, logs):
        while True:
            try:
                urllib.request.urlopen(url + "/", timeout=2).close()
                break
            except OSError:
                if p.poll() is not None:
                    for q in procs:  # no half-started set left running
                        q.kill()
                    with open(log) as f:
                        tail = " ".join(f.read().split())[-300:]
                    raise RuntimeError(f"appworld: the server for {url} exited ({log}): {tail}")
                time.sleep(0.5)
    return ";".join(urls), procs


INSTALL = """set -e
python3 -m venv "$1"
"$1/bin/pip" install -q appworld==0.1.3.post1
"$1/bin/appworld" install
cd "$2" && "$1/bin/appworld" download data
"""

if __name__ == "__main__":
    usage = (
        "usage: python -m envs.appworld install [ROOT]   (AppWorld in $APPWORLD_VENV, data in ROOT)\n"
        "       python -m envs.appworld serve N [ROOT] [PORT]   (N servers; Ctrl-C stops them)"
    )
    args = sys.argv[1:]
    if not args or args[0] not in ("install", "serve") or (args[0] == "serve" and len(args) < 2):
        sys.exit(usage)
    k = 2 if args[0] == "serve" else 1  # where ROOT is
    root = os.path.abspath(args[k] if len(args) > k else os.environ.get("APPWORLD_ROOT", "appworld_root"))
    if args[0] == "install":
        os.makedirs(root, exist_ok=True)
        subprocess.run(["bash", "-c", INSTALL, "install", VENV, root], check=True)
        print(f"AppWorld in {VENV}, its data in {root}/data; next: python -m envs.appworld serve N {root}")
    else:
        try:
            urls, procs = serve(int(args[1]), root, int(args[3]) if len(args) > 3 else 8000)
        except (FileNotFoundError, RuntimeError) as e:  # one line, not a traceback
            sys.exit(f"error: {e}")
        print(
            f"{len(procs)} AppWorld servers up; in another shell:\n  export APPWORLD_ROOT={root} "
            f"APPWORLD_SERVERS='{urls}'\n  python train.py --env appworld",
            flush=True,
        )
        try:
            for p in procs:
                p.wait()
        except KeyboardInterrupt:
            for p in procs:
                p.terminate()
