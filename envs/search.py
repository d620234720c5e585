"""Search-R1: answer a question with a search tool, offline (the protocol of Search-R1, Jin et al.
2025, "Search-R1: Training LLMs to Reason and Leverage Search Engines with RL", repository
PeterGriffinJin/Search-R1; verl-agent's search env plays the same game).

    obs:    first "Question: <question>"; after a search the top-k passages, as Search-R1 shows them:
            "<information>Doc 1(Title: "T") text\\nDoc 2(Title: ...) ...</information>"; after an
            unreadable action, a line that says how to search or answer
    action: the first complete "<search>query</search>" or "<answer>text</answer>" in the text
            (Search-R1's rule); anything else is invalid: a no-op turn
    reward: 1.0 when the answer equals a golden answer after normalisation (lowercase, no
            punctuation, no articles a/an/the, spaces collapsed: Search-R1's exact match), else 0;
            the episode ends at the answer; truncated after max_steps turns (4) without one
    admissible_actions: suggestions only, for the random baseline and the tiny model's vocabulary
            (any query or answer is accepted): search the question as written, or answer with the
            title of a passage just shown

Data (`--env_args data_dir=DIR` or $SEARCH_DATA):
    corpus.jsonl           {"id": "0", "contents": "\\"Title\\"\\ntext"} per line (Search-R1's wiki-18.jsonl)
    train.jsonl, test.jsonl  {"question": ..., "golden_answers": [...]} per line (the FlashRAG QA files
                           Search-R1 preprocesses); .parquet works too where pandas is installed
`--env_args retriever_url=http://HOST:PORT/retrieve` asks a server that speaks Search-R1's
retrieval protocol (POST {"queries", "topk", "return_scores"} -> {"result": [[{"document": {"id",
"contents"}, "score"}, ...]]}) instead of the in-process BM25 over corpus.jsonl.
Questions: reset(seed) plays train question seed % N; the eval set "test" plays the test questions
in order. `python -m envs.demo search DIR` writes a small multi-hop demo set in these formats.
"""

import json
import os
import re
import string
import sys
import urllib.request
from functools import lru_cache

import gymnasium

from envs import TextSpace, test_set

INVALID = (
    "Your previous action is invalid. To search, put the query between <search> and </search>; "
    "to give the final answer, put it between <answer> and </answer>. Try again."
)
PUNCTUATION = set(string.punctuation)
ACTION = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)
TINY_CORPUS_EPISODES = 100


def normalize_answer(text):
    """Search-R1's (and SQuAD's) answer normalisation."""
    text = "".join(ch for ch in text.lower() if ch not in PUNCTUATION)
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def exact_match(prediction, golden_answers):
    golden = [golden_answers] if isinstance(golden_answers, str) else golden_answers
    return float(normalize_answer(prediction) in {normalize_answer(g) for g in golden})


def import_bm25s():
    """bm25s imports numba when it is installed, and numba's llvmlite in sys.modules breaks vLLM's
    CPU kernel registration (its scan of every module: "'_lib_fn_wrapper' object has no attribute
    'get'"), so bm25s is imported with numba hidden: it then uses its numpy backend. A hack, for as
    long as those two versions disagree; nothing changes where numba is already loaded."""
    if "bm25s" not in sys.modules and "numba" not in sys.modules:
        sys.modules["numba"] = None  # `import numba` now raises ImportError
        try:
            import bm25s  # noqa: F401
        finally:
            del sys.modules["numba"]
    import bm25s

    return bm25s


class BM25:
    """In-process BM25 (the `bm25s` package, English stopwords) -> [(doc index, score)], best first;
    only documents that share a term with the query (score > 0), as a Lucene search returns."""

    def __init__(self, texts):
        bm25s = import_bm25s()
        self.n, self.bm25s = len(texts), bm25s
        self.index = bm25s.BM25()
        self.index.index(bm25s.tokenize(texts, stopwords="en", show_progress=False), show_progress=False)

    def search(self, query, k):
        tokens = self.bm25s.tokenize([query], stopwords="en", show_progress=False, return_ids=False)
        ids, scores = self.index.retrieve(tokens, k=min(k, self.n), show_progress=False)
        return [(int(i), float(s)) for i, s in zip(ids[0], scores[0]) if s > 0]


def data_root(data_dir=None):
    root = data_dir or os.environ.get("SEARCH_DATA")
    if not root or not os.path.isdir(root):
        raise FileNotFoundError(
            f"search: no data dir ({root or 'none given'}): give --env_args data_dir=DIR "
            "or set $SEARCH_DATA to a "
            f"folder with Search-R1's corpus.jsonl and train/test QA files, or make the demo set: "
            f"python -m envs.demo search DIR"
        )
    return root


def question(text):
    """Search-R1's preprocessing: stripped, ending in a question mark."""
    text = text.strip()
    return text if text.endswith("?") else text + "?"


@lru_cache(maxsize=4)
def load_questions(root, split):
    """-> [(question, [golden answers])] from <root>/<split>.jsonl, .json or .parquet."""
    for ext in ("jsonl", "json", "parquet"):
        path = os.path.join(root, f"{split}.{ext}")
        if not os.path.exists(path):
            continue
        if ext == "parquet":
            try:  # Search-R1's processed files (golden answers also under reward_model.ground_truth.target)
                import pandas

                rows = pandas.read_parquet(path).to_dict("records")
            except ImportError as e:
                raise ValueError(
                    f"search: reading {path} needs pandas and pyarrow (pip install pandas pyarrow), "
                    f"or give the split as .jsonl"
                ) from e
        else:
            with open(path) as f:
                rows = [json.loads(line) for line in f if line.strip()] if ext == "jsonl" else json.load(f)
        out = [
            (
                question(r["question"]),
                list(
                    r["golden_answers"]
                    if "golden_answers" in r
                    else r["reward_model"]["ground_truth"]["target"]
                ),
            )
            for r in rows
        ]
        if out:
            return out
    raise FileNotFoundError(
        f"search: no questions in {root}/{split}.jsonl (or .json, .parquet): the split needs "
        f'lines of {{"question", "golden_answers"}}; python -m envs.demo search DIR'
    )


@lru_cache(maxsize=2)
def load_corpus(root):
    path = os.path.join(root, "corpus.jsonl")
    if not os.path.exists(path):
        raise FileNotFoundError(
            f'search: no {path} (Search-R1\'s {{"id", "contents"}} lines): add it, or give '
            f"--env_args retriever_url=http://HOST:PORT/retrieve"
        )
    with open(path) as f:
        docs = [json.loads(line) for line in f if line.strip()]
    return docs, BM25([d["contents"] for d in docs])


def http_retrieve(url, query, k, timeout=30):
    """One query to a Search-R1 retrieval server -> its documents ({"id", "contents"}), best first."""
    body = json.dumps({"queries": [query], "topk": k, "return_scores": True}).encode()
    request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        hits = json.load(response)["result"][0]
    return [h["document"] if "document" in h else h for h in hits]


def passages(docs):
    """Search-R1's layout: 'Doc i(Title: <first line>) <the rest>' per document."""
    lines = []
    for i, doc in enumerate(docs):
        title, _, text = doc["contents"].partition("\n")
        lines.append(f"Doc {i + 1}(Title: {title}) {text}")
    return "\n".join(lines)


class Search(gymnasium.Env):
    def __init__(self, data_dir=None, split="train", retriever_url="", topk=3, max_steps=4):
        if (
            split not in ("train", "test")
            or type(topk) is not int
            or type(max_steps) is not int
            or topk < 1
            or max_steps < 1
        ):
            raise ValueError(
                f"search: split must be train or test, topk and max_steps integers >= 1; got "
                f"split={split!r} topk={topk!r} max_steps={max_steps!r}"
            )
        self.root = data_root(data_dir)
        self.questions = load_questions(self.root, split)
        self.url, self.topk, self.max_steps = retriever_url, topk, max_steps
        if not self.url:
            load_corpus(self.root)  # fail now, not at the first search
        self.observation_space, self.action_space = TextSpace(), TextSpace(["<answer>unknown</answer>"])

    def retrieve(self, query):
        if self.url:
            return http_retrieve(self.url, query, self.topk)
        docs, index = load_corpus(self.root)
        return [docs[i] for i, _ in index.search(query, self.topk)]

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        seed = seed if seed is not None else int(self.np_random.integers(2**62))
        self.question, self.golden = self.questions[seed % len(self.questions)]
        self.steps, self.shown = 0, []
        obs = f"Question: {self.question}"
        return obs, self._info(False)

    def step(self, action):
        self.steps += 1
        match = ACTION.search(action or "")
        kind, text = (match.group(1), match.group(2).strip()) if match else (None, "")
        if kind == "answer":
            won = exact_match(text, self.golden) == 1.0
            obs = f"Your answer: {text}"
            return obs, float(won), True, False, self._info(won)
        if kind == "search" and text:
            self.shown = self.retrieve(text)
            obs = f"<information>{passages(self.shown) or 'No results.'}</information>"
        else:
            obs = INVALID
        return obs, 0.0, False, self.steps >= self.max_steps, self._info(False)

    def _info(self, won):
        titles = [d["contents"].partition("\n")[0].strip('"') for d in self.shown]
        suggested = [f"<search>{self.question}</search>"] + [f"<answer>{t}</answer>" for t in titles]
        # the state is the question and the passages on show: an invalid turn leaves the anchor as it was
        return {
            "task": self.question,
            "admissible_actions": list(dict.fromkeys(suggested)),
            "won": won,
            "anchor": f"{self.question}\n{passages(self.shown)}".strip(),
        }


def eval_sets(n=None, names=None, **env_args):
    """One eval set, "test": the test split in order (envs.test_set)."""
    return test_set("search", names, n, lambda: len(load_questions(Search(**env_args).root, "test")))
