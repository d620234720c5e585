import json
import os
import random
import re
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import gymnasium
import pytest
from gymnasium.utils.env_checker import check_env

from envs import demo as demo_sets
from envs.search import INVALID, Search, eval_sets, exact_match, load_questions, normalize_answer
from prompts import prompt_module

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return demo_sets.search(str(tmp_path_factory.mktemp("search_demo")))


@pytest.mark.parametrize(
    "prediction, golden, em",
    [
        ("The Beatles", ["beatles"], 1.0),  # case and an article
        ("  beatles. ", "The Beatles", 1.0),  # spaces, punctuation, a golden string
        ("an apple a day", ["Apple day"], 1.0),  # every article goes
        ("Beatle", ["Beatles"], 0.0),  # exact, not a substring or a stem
        ("the beatles band", ["The Beatles"], 0.0),
        ("Rock-'n'-roll", ["rocknroll"], 1.0),  # punctuation inside words is dropped, not a space
        ("Théâtre", ["theatre"], 0.0),  # accents are kept (as Search-R1 does)
        ("", ["x"], 0.0),
    ],
)
def test_exact_match_after_normalisation(prediction, golden, em):
    assert exact_match(prediction, golden) == em
    assert normalize_answer("  A   Tale of  THE Two-Cities!! ") == "tale of twocities"


def expert(env, obs):
    """Follows the demo's hops by reading the passages: the company's founder, their city, its country."""
    q = env.question
    company = re.search(r"(?:founded|founder of) (\w+)", q).group(1)
    info = env.step(f"<search>{company}</search>")[0]
    answer = re.search(rf"{company} is a company founded by (\w+ \w+) in", info).group(1)
    if not q.startswith("Who"):
        info = env.step(f"<search>{answer}</search>")[0]
        answer = re.search(rf"{answer} is an? \w+ born in the city of (\w+)\.", info).group(1)
    if "country" in q:
        info = env.step(f"<search>{answer} city</search>")[0]
        answer = re.search(rf"{answer} is a city in the country of (\w+)\.", info).group(1)
    return env.step(f"<answer> {answer.upper()} </answer>")


def test_scripted_expert_wins_every_question(demo):
    """BM25 finds each hop's passage in the top 3: reading them answers every question (1, 2 and 3
    hops) of both splits with reward 1 within max_steps."""
    for split in ("test", "train"):
        env = Search(data_dir=demo, split=split)
        for seed in range(len(env.questions)):
            obs, info = env.reset(seed)
            obs, r, term, trunc, info = expert(env, obs)
            assert (r, term, trunc, info["won"]) == (1.0, True, False, True), env.question
            assert env.steps <= env.max_steps
    assert len({q for q, _ in env.questions}) == len(env.questions) == 144  # train: 180 - 36
    # seed 0: no suggested title was an answer (the answers are in the passages' text)
    assert demo_sets.baselines("search", demo) == {"random": (0.0, 0.0), "rule": (0.0, 0.0)}


def test_wrong_answer_junk_and_truncation(demo):
    env = Search(data_dir=demo, max_steps=4)
    obs, info = env.reset(5)
    assert obs == f"Question: {env.question}" and info["admissible_actions"] == [
        f"<search>{env.question}</search>"
    ]
    obs, r, term, trunc, info = env.step("<search>   </search>")  # empty query: invalid
    assert (obs, r, term, trunc) == (INVALID, 0.0, False, False) and info["anchor"] == env.question
    obs, r, term, trunc, info = env.step(info["admissible_actions"][0])  # the suggested search
    assert obs.startswith("<information>Doc 1(Title: ") and obs.count("\nDoc ") == 2 and not term
    assert len(info["admissible_actions"]) == 4 and info["anchor"].startswith(env.question + "\nDoc 1")
    anchor = info["anchor"]
    for junk in (None, "", "answer: x", "<answer>x", "<search>a</answer>", "\x00" * 50):
        env.steps = 0
        obs, r, term, trunc, info = env.step(junk)
        assert (obs, r, term) == (INVALID, 0.0, False) and info["anchor"] == anchor  # a no-op turn
    env.steps = 2
    env.step("<search>zzzz qqqq</search>")  # no term matches
    obs, r, term, trunc, info = env.step("<search>zzzz</search>")
    assert obs == "<information>No results.</information>" and trunc and not term  # 4th turn: truncated
    env.reset(5)
    obs, r, term, trunc, info = env.step("<think>hm</think><answer>Nobody</answer><answer>x</answer>")
    assert (r, term, info["won"], obs) == (0.0, True, False, "Your answer: Nobody")


def test_check_env_make_and_eval_sets(demo):
    check_env(Search(data_dir=demo), skip_render_check=True)
    env = gymnasium.make("gigpo/Search-v0", data_dir=demo, topk=2)
    obs, info = env.reset(seed=1)
    assert env.observation_space.contains(obs) and obs.startswith("Question: ")
    sets = eval_sets(10, data_dir=demo)
    assert sets == {"test": ({"split": "test"}, list(range(10)))}
    with pytest.raises(ValueError, match="topk"):
        eval_sets(3, data_dir=demo, topk=0)
    assert len(eval_sets(None, data_dir=demo)["test"][1]) == len(load_questions(demo, "test")) == 36
    test_env = Search(data_dir=demo, split="test")
    first = json.loads(Path(demo, "test.jsonl").read_text().splitlines()[0])
    assert test_env.reset(0)[0] == f"Question: {first['question']}"


def test_missing_data_is_one_line(tmp_path, monkeypatch, demo):
    import train

    monkeypatch.delenv("SEARCH_DATA", raising=False)
    for kwargs in ({}, {"data_dir": str(tmp_path / "nowhere")}):
        with pytest.raises(FileNotFoundError) as e:
            Search(**kwargs)
        assert "--env_args data_dir=DIR" in str(e.value) and "$SEARCH_DATA" in str(e.value)
        assert "python -m envs.demo search DIR" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(FileNotFoundError, match="test.jsonl"):
        Search(data_dir=str(tmp_path), split="test")
    for env_args, words in (("", "$SEARCH_DATA"), ("topk=0", "topk"), ("split=dev", "split")):
        cfg = train.parse_args(
            ["--env", "search", "--env_args", env_args, "--out_dir", str(tmp_path / "out")]
        )
        with pytest.raises(SystemExit) as e:
            train.check_config(cfg)
        msg = str(e.value.code)
        assert msg.startswith("error: ") and words in msg and "\n" not in msg, msg
    # the data dir given in --env_args reaches the eval sets (evaluate.eval_plan passes it on)
    monkeypatch.setenv("SEARCH_DATA", demo)
    cfg = train.parse_args(
        ["--env", "search", "--env_args", f"data_dir={demo}", "--out_dir", str(tmp_path / "o")]
    )
    assert train.check_config(cfg) is None
    monkeypatch.delenv("SEARCH_DATA")
    assert train.check_config(cfg) is None


class Stub(BaseHTTPRequestHandler):
    """Search-R1's retrieval server, as far as the client sees it: POST /retrieve."""

    requests = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Stub.requests.append((self.path, body))
        docs = [
            {"id": str(i), "contents": f'"Stub {i}"\nabout {body["queries"][0]}'} for i in range(body["topk"])
        ]
        result = [[{"document": d, "score": 1.0 / (i + 1)} for i, d in enumerate(docs)]]
        data = json.dumps({"result": result}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_http_retriever_against_a_stub_server(tmp_path, demo):
    server = HTTPServer(("127.0.0.1", 0), Stub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:  # QA files only, no corpus.jsonl: the server is the retriever
        for split in ("train", "test"):
            (tmp_path / f"{split}.jsonl").write_text(Path(demo, f"{split}.jsonl").read_text())
        url = f"http://127.0.0.1:{server.server_port}/retrieve"
        env = Search(data_dir=str(tmp_path), retriever_url=url, topk=2)
        env.reset(0)
        obs, r, term, trunc, info = env.step("<search> who is x </search>")
        assert Stub.requests == [("/retrieve", {"queries": ["who is x"], "topk": 2, "return_scores": True})]
        assert obs == (
            '<information>Doc 1(Title: "Stub 0") about who is x\n'
            'Doc 2(Title: "Stub 1") about who is x</information>'
        )
        assert info["admissible_actions"][1:] == ["<answer>Stub 0</answer>", "<answer>Stub 1</answer>"]
        with pytest.raises(FileNotFoundError, match="retriever_url"):
            Search(data_dir=str(tmp_path))  # no corpus and no server
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("chat", [False, True])
def test_parsers_never_raise(chat):
    prompt, rng = prompt_module("search", chat=chat), random.Random(0)
    alphabet = [
        "<search>",
        "</search>",
        "<answer>",
        "</answer>",
        "<",
        ">",
        "/",
        " ",
        "a",
        "search",
        "answer",
        "\n",
    ]
    for _ in range(2000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))
        action, valid = prompt.parse(text, [])
        assert isinstance(action, str) and valid == bool(action)
        if valid:
            assert re.fullmatch(r"<(search|answer)>\S.*?</\1>", action, re.DOTALL), (
                text,
                action,
            )  # Search-R1's rule
    tiny, chat_ = prompt_module("search"), prompt_module("search", chat=True)
    assert tiny.parse("< search > Who founded X < / search >", []) == ("<search>who founded x</search>", True)
    assert tiny.parse("answer Kessa", []) == ("<answer>kessa</answer>", True)
    assert tiny.parse("search", []) == ("", False) and tiny.parse(None, []) == ("", False)
    first = chat_.parse("<think>a</think> <search> Q one </search><answer>b</answer>", [])
    assert first == ("<search>Q one</search>", True)
    assert chat_.parse("<answer>\n</answer>", []) == ("", False)
    msg = chat_.build("Who?", "[Question: Who? -> <search>x</search>]", "<information>y</information>", [], 1)
    assert "Question: Who?" in msg[0]["content"] and "<information>y" in msg[0]["content"]


def test_train_one_iteration_with_the_tiny_model(demo, train_tiny):
    last, row = train_tiny("search", f"data_dir={demo},max_steps=3", 6)
    assert re.search(r"held-out success test \d\.\d{3} \(test 4 games", last), last
    assert row["iteration"] == 1 and 4 <= row["samples"] <= 12 and row["episode_length"] <= 3


def test_bm25_keeps_numba_out_of_the_process():
    """bm25s would import numba, whose llvmlite in sys.modules breaks vLLM's CPU start-up (a train.py
    run on --env search or webshop with the vLLM engine failed so); envs.search.import_bm25s hides it."""
    code = (
        "import sys; from envs.search import BM25; import envs.webshop; "
        "assert BM25(['alpha beta', 'gamma']).search('alpha', 2)[0][0] == 0; "
        "assert 'llvmlite' not in sys.modules and 'numba' not in sys.modules, 'numba loaded'"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
