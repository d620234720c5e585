"""AppWorld: the client against a small local server that answers with the shapes of AppWorld's
environment server (runs anywhere), and against AppWorld's real server on the demo task set, started
here in AppWorld's virtualenv ($APPWORLD_VENV; skipped with the reason when it is missing)."""

import contextlib
import json
import os
import random
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from gymnasium.utils.env_checker import check_env

from envs import GroupedEnvs, make_env
from envs import appworld as aw
from envs import demo as demo_sets
from prompts import prompt_module

ANSWER = "42"


class Fake(BaseHTTPRequestHandler):
    """One world at a time, as `appworld serve environment`: POST /initialize, /execute,
    /task_completed, /evaluate, /close with a JSON body -> {"output": ...}. Code that calls
    complete_task(answer=X) completes the task; evaluate passes when X is 42."""

    def do_POST(self):
        body, server = json.loads(self.rfile.read(int(self.headers["Content-Length"]))), self.server
        server.calls.append((self.path, body))
        method = self.path.strip("/")
        if method != "initialize" and body.get("task_id") != server.task_id:
            return self.reply(500, {"detail": "The active task world is another one."})
        if method == "initialize":
            server.task_id, server.answer = body["task_id"], None
            out = {
                "task_id": body["task_id"],
                "instruction": f"What is the answer of {body['task_id']}?",
                "supervisor": {
                    "first_name": "Ada",
                    "last_name": "Lind",
                    "email": "ada@x.org",
                    "phone_number": "555",
                },
                "datetime": "2023-05-18T12:00:00",
            }
        elif method == "execute":
            done = re.search(r"complete_task\(answer=['\"]?(\w+)", body["code"])
            server.answer = done.group(1) if done else server.answer
            out = "Execution successful." if done else f"ran {body['code'].strip()}"
        elif method == "task_completed":
            out = server.answer is not None
        elif method == "evaluate":
            ok = server.answer == ANSWER
            out = {
                "success": ok,
                "difficulty": 1,
                "num_tests": 2,
                "passes": [{"requirement": "r1", "label": None}] * (1 + ok),
                "failures": [] if ok else [{}],
            }
        else:
            out = None
        self.reply(200, {"output": out})

    def reply(self, code, obj):
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def task_dir(root, splits=(("train", ["alpha_1", "beta_1", "alpha_2"]), ("test_normal", ["gamma_1"]))):
    """A data folder with just what the client reads: datasets/<split>.txt and each task's apps."""
    for split, ids in splits:
        os.makedirs(root / "data" / "datasets", exist_ok=True)
        (root / "data" / "datasets" / f"{split}.txt").write_text("\n".join(ids) + "\n")
        for task_id in ids:
            gt = root / "data" / "tasks" / task_id / "ground_truth"
            os.makedirs(gt, exist_ok=True)
            if task_id.startswith("alpha"):
                (gt / "required_apps.json").write_text('["venmo", "gmail"]')
            else:
                code = "x = models.end.spotify.Song\ny = models.start.supervisor.Task"
                (gt / "evaluation.py").write_text(code)
    return str(root)


@contextlib.contextmanager
def fake_servers(root, n=4):
    """-> (env kwargs for n stand-in servers and a data folder under root, the servers); shut down after."""
    servers = []
    for _ in range(n):
        server = ThreadingHTTPServer(("127.0.0.1", 0), Fake)
        server.calls, server.task_id = [], None
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
    urls = ";".join(f"http://127.0.0.1:{s.server_port}" for s in servers)
    try:
        yield {"data_dir": task_dir(root), "servers": urls}, servers
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()


@pytest.fixture
def fakes(tmp_path):
    with fake_servers(tmp_path) as out:
        yield out


def test_client_speaks_the_servers_protocol(fakes):
    kwargs, servers = fakes
    env = aw.AppWorld(**kwargs, max_steps=3)
    obs, info = env.reset(4)  # train task 4 % 3 = 1: beta_1
    server = next(s for s in servers if s.calls)  # the env took one server, and only one
    assert sum(bool(s.calls) for s in servers) == 1
    assert server.calls[0] == (
        "/initialize",
        {"task_id": "beta_1", "experiment_name": "gigpo-127-0-0-1-" + str(server.server_port)},
    )
    assert obs == (
        "My name is: Ada Lind. My personal email address is: ada@x.org and phone number: 555.\n"
        "Task: What is the answer of beta_1?"
    )
    assert (info["task"], info["won"], info["task_type"], info["anchor"]) == (obs, False, "spotify", obs)
    obs, r, term, trunc, info = env.step("x = 1\nprint(x)")
    assert (obs, r, term, trunc) == ("ran x = 1\nprint(x)", 0.0, False, False)
    assert info["task"].endswith("beta_1?")
    assert server.calls[-2:] == [
        ("/execute", {"task_id": "beta_1", "code": "x = 1\nprint(x)"}),
        ("/task_completed", {"task_id": "beta_1"}),
    ]
    n = len(server.calls)
    for junk in ("", "   \n", None):  # an unreadable reply: nothing runs
        obs, r, term, trunc, info = env.step(junk)
        assert obs == aw.INVALID and len(server.calls) == n and not term
        env.steps = 0
    obs, r, term, trunc, info = env.step("apis.supervisor.complete_task(answer='42')")
    assert (r, term, trunc, info["won"], info["tests"]) == (1.0, True, False, True, "2/2")
    assert [c[0] for c in server.calls[-3:]] == ["/task_completed", "/evaluate", "/close"]
    assert server.calls[-2][1] == {"task_id": "beta_1", "suppress_errors": True}
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step("print(1)")
    env.reset(0)  # alpha_1: task type from required_apps.json; the last step is evaluated
    assert env.type == "gmail+venmo" and env._info(False, "")["task_type"] == "gmail+venmo"
    for k in range(3):
        obs, r, term, trunc, info = env.step(f"print({k})")
    assert (r, term, trunc, info["won"], info["tests"]) == (0.0, False, True, False, "1/2")
    assert [c[0] for c in server.calls[-3:]] == ["/task_completed", "/evaluate", "/close"]
    env.close()


def test_each_env_holds_its_own_server(fakes, tmp_path):
    kwargs, servers = fakes
    envs = [aw.AppWorld(**kwargs) for _ in range(5)]
    for env in envs[:4]:
        env.reset(0)
    assert sorted(e.url for e in envs[:4]) == sorted(f"http://127.0.0.1:{s.server_port}" for s in servers)
    with pytest.raises(RuntimeError, match="all 4 AppWorld servers are held by other envs") as e:
        envs[4].reset(0)
    assert "python -m envs.appworld serve N" in str(e.value) and "\n" not in str(e.value)
    url = envs[0].url
    envs[0].close()  # its server is free again
    assert envs[4].reset(0)[0].startswith("My name is") and envs[4].url == url
    for env in envs:
        env.close()


def test_no_server_unreachable_server_and_missing_data(tmp_path, monkeypatch, fakes):
    kwargs, _ = fakes
    monkeypatch.delenv("APPWORLD_SERVERS", raising=False)
    with pytest.raises(RuntimeError, match="no AppWorld server given") as e:
        aw.AppWorld(data_dir=kwargs["data_dir"]).reset(0)  # constructible without one: train.py's checks
    assert "$APPWORLD_SERVERS" in str(e.value) and "\n" not in str(e.value)
    monkeypatch.setenv("APPWORLD_SERVERS", "http://127.0.0.1:9")  # discard port: nothing listens
    with pytest.raises(RuntimeError) as e:
        aw.AppWorld(data_dir=kwargs["data_dir"]).reset(0)
    msg = str(e.value)
    assert "no AppWorld environment server answers at http://127.0.0.1:9" in msg and "\n" not in msg
    assert "python -m envs.appworld serve N" in msg
    monkeypatch.delenv("APPWORLD_ROOT", raising=False)
    for bad in ({}, {"data_dir": str(tmp_path / "nowhere")}):
        with pytest.raises(FileNotFoundError) as e:
            aw.AppWorld(**bad)
        assert "python -m envs.demo appworld DIR" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(FileNotFoundError, match="dev.txt"):
        aw.AppWorld(data_dir=kwargs["data_dir"], split="dev")
    with pytest.raises(ValueError, match="split"):
        aw.AppWorld(data_dir=kwargs["data_dir"], split="test")


def test_check_env_make_and_eval_sets(fakes):
    kwargs, _ = fakes
    env = make_env("appworld", **kwargs)
    check_env(env, skip_render_check=True)
    assert env.reset(7)[0] == env.reset(seed=7)[0]
    env.close()
    assert aw.eval_sets(10, **kwargs) == {"test_normal": ({"split": "test_normal"}, [0])}
    with pytest.raises(ValueError, match="test_normal"):
        aw.eval_sets(3, names=["valid_seen"], **kwargs)


def test_killed_worker_is_replaced_and_its_episodes_truncated(fakes, capfd):
    """As for every env: the dead worker's episodes end as truncated, the new worker takes the
    servers the dead one held (their locks died with it) and plays on."""
    from test_alfworld import kill_and_step

    kwargs, _ = fakes
    envs = GroupedEnvs("appworld", n_groups=2, group_size=2, workers=2, **kwargs)
    try:
        kill_and_step(envs, capfd, "print(1)")
    finally:
        envs.close()


@pytest.mark.parametrize("chat", [False, True])
def test_parsers_never_raise(chat):
    prompt, rng = prompt_module("appworld", chat=chat), random.Random(0)
    alphabet = [
        "<code>",
        "</code>",
        "<think>",
        "</think>",
        "```python\n",
        "```",
        "print(1)",
        " ",
        "\n",
        "<",
        ">",
        "x",
    ]
    for _ in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))
        action, valid = prompt.parse(text, aw.SUGGESTED)
        assert isinstance(action, str) and valid == bool(action.strip()), (text, action)
        if valid and action not in aw.SUGGESTED:
            assert "<code>" in text and "<think>" in text and "</code>" not in action
    p = prompt_module("appworld", chat=True)
    reply = (
        "<think>list apps</think>\n<code>\n```python\nprint(apis.api_docs.show_app_descriptions())"
        "\n```\n</code>"
    )
    assert p.parse(reply, []) == ("print(apis.api_docs.show_app_descriptions())", True)
    two = "<think>a</think><code>\nx = 1\n  print(x)</code><code>y</code>"
    assert p.parse(two, []) == ("x = 1\n  print(x)", True)
    for bad in (
        "<code>print(1)</code>",
        "<think>a</think><code> \n </code>",
        "<think>a</think> print(1)",
        None,
        "",
    ):
        assert p.parse(bad, []) == ("", False)
    tiny = prompt_module("appworld")
    assert tiny.parse(" print(apis.supervisor.show_active_task()) ", aw.SUGGESTED) == (aw.SUGGESTED[1], True)
    msg = p.build("My name is: Ada. Task: do it", "[out -> code]", "Execution successful.", [], 3)
    msg = msg[0]["content"]
    assert "Task: do it" in msg and "[out -> code]" in msg and "step 4" in msg and "<code>" in msg


def test_a_fence_is_dropped_as_the_old_regex_did_in_linear_time():
    """prompts.appworld.unfence (string scans) gives what the regex it replaced gave on 50,000 random
    short codes (fences, tags, whitespace of several kinds), and a degenerate reply of 120,000
    characters, mostly whitespace inside a fence, parses at once (the regex took 157 s at 8,000; the
    alarm turns a hang back into a failure)."""
    import signal

    from prompts import appworld as p

    old = re.compile(r"\s*```(?:python|py)?\s*\n(.*?)\n?\s*```\s*", re.DOTALL)
    parts = ["`", "```", "python", "py", "pyt", " ", "\n", "\t", "x", "\x1c", "\u00a0", "\r", "```py \n"]
    rng, fenced = random.Random(0), 0
    for _ in range(50_000):
        code = "".join(rng.choice(parts) for _ in range(rng.randint(0, 10)))
        m = old.fullmatch(code)
        assert p.unfence(code) == (m.group(1) if m else None), repr(code)
        fenced += m is not None
    assert fenced > 500  # enough real fences among them
    signal.signal(signal.SIGALRM, lambda *a: pytest.fail("parse_chat hung on whitespace in a fence"))
    signal.alarm(10)
    try:
        reply = "<think>a</think><code>```python\n" + "\n \t" * 40_000 + "</code>"
        assert p.parse_chat(reply, [])[1]  # no closing fence: the code as written
        reply = "<think>a</think><code>```python\nprint(1)" + " \n" * 40_000 + "```</code>"
        assert p.parse_chat(reply, []) == ("print(1)", True)
    finally:
        signal.alarm(0)


# --- AppWorld's real server, on the demo set made by AppWorld's code -------------------------------------


def scripted(obs):
    """The code that solves a demo task, from its instruction (one step)."""
    email = re.search(r"email address is: (\S+) and", obs).group(1)
    login = (
        "pw = [a for a in apis.supervisor.show_account_passwords() if a['account_name'] == "
        "'simple_note'][0]['password']\n"
        f"tok = apis.simple_note.login(username='{email}', password=pw)['access_token']\n"
    )
    if m := re.search(r"note that mentions (\w+)\?", obs):
        return login + (
            f"notes = apis.simple_note.search_notes(access_token=tok, query='{m.group(1)}')\n"
            "apis.supervisor.complete_task(answer=notes[0]['title'])"
        )
    if m := re.search(r'titled "(.+)" with the content "(.+)"\.', obs):
        return login + (
            f"apis.simple_note.create_note(access_token=tok, title={m.group(1)!r}, "
            f"content={m.group(2)!r})\napis.supervisor.complete_task()"
        )
    name = re.search(r"zip code of my (\w+) address", obs).group(1)
    return (
        f"a = [a for a in apis.supervisor.show_addresses() if a['name'].lower() == {name!r}][0]\n"
        "apis.supervisor.complete_task(answer=a['zip_code'])"
    )


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    """The demo set (3 train, 3 test tasks) and 2 real AppWorld servers on it."""
    python = os.path.join(aw.VENV, "bin", "python")
    if not os.path.exists(python):
        pytest.skip(
            f"no AppWorld virtualenv at {aw.VENV} (set $APPWORLD_VENV; python -m envs.appworld install)"
        )
    root = demo_sets.appworld(str(tmp_path_factory.mktemp("appworld_demo")), n_train=3, n_test=3)
    port = 18000 + os.getpid() % 1000 * 2
    urls, procs = aw.serve(2, root, port=port)
    yield {"data_dir": root, "servers": urls}
    for p in procs:
        p.kill()  # SIGTERM's graceful shutdown takes ~14 s
        p.wait(timeout=30)


def test_demo_set_on_the_real_server_random_and_scripted(real):
    """AppWorld's own code loads the hand-made tasks: the scripted policy wins every test task (its
    evaluation passes), the random suggestions win none; task types come from the apps."""
    env = aw.AppWorld(**real, split="test_normal", max_steps=4)
    rng, wins, types = random.Random(0), {"random": [], "scripted": []}, []
    for policy in ("random", "scripted"):
        for seed in range(len(env.tasks)):
            obs, info = env.reset(seed)
            types.append(info["task_type"])
            done = False
            while not done:
                action = (
                    rng.choice(info["admissible_actions"]) if policy == "random" else scripted(info["task"])
                )
                obs, r, term, trunc, info = env.step(action)
                done = term or trunc
            wins[policy].append((info["won"], r, info["tests"]))
    env.close()
    assert [w for w, _, _ in wins["scripted"]] == [True] * 3 and all(r == 1.0 for _, r, _ in wins["scripted"])
    assert not any(w for w, _, _ in wins["random"]) and {t for _, _, t in wins["scripted"]} >= {"1/1", "2/2"}
    assert set(types) == {"simple_note", "supervisor"}


def test_real_server_errors_and_a_wrong_answer(real):
    env = aw.AppWorld(**real, split="train")
    obs, info = env.reset(0)  # notetitle_1
    obs, r, term, trunc, info = env.step("print(apis.supervisor.show_active_task()['instruction'])")
    assert obs.strip() == info["task"].split("Task: ")[1] and not term
    obs, *_ = env.step("1 / 0")
    assert obs.startswith("Execution failed. Traceback:") and "ZeroDivisionError" in obs
    obs, *_ = env.step("def (:")
    assert obs.startswith("Execution failed.") and "Syntax error" in obs
    obs, r, term, trunc, info = env.step("apis.supervisor.complete_task(answer='not it')")
    assert (r, term, info["won"], info["tests"]) == (0.0, True, False, "0/1")
    env.close()
