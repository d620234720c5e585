"""Prompt and parser for Search-R1's question answering with a search tool (envs/search.py).

`build_chat` (pretrained chat models) says what Search-R1's prompt says, in our words: reason
inside <think> </think>, search with <search> query </search>, read <information> ...
</information>, answer inside <answer> </answer>; then the question, the memory and the latest
observation. `parse_chat` takes the first complete <search>...</search> or <answer>...</answer>,
as Search-R1 does; an empty query or answer, or neither tag pair, is invalid.

`build` is terse, for the tiny model trained from scratch: the memory and the observation. Its
word-level tokenizer decodes tags as separate words ("< search > a b < / search >"), so `parse`
reads "search WORDS" / "answer WORDS" with any <, > and / dropped.
"""

import re

from envs.search import ACTION

RULES = (
    "Answer the question. Reason step by step inside <think> and </think> every time you get new "
    "information. If you are missing knowledge, call the search engine with <search> query </search>; "
    "its top results come back between <information> and </information>. You may search as often as "
    "you need. When you know the answer, give it inside <answer> and </answer>, with no explanation, "
    "for example <answer> Beijing </answer>."
)


def build(task, history_text, obs, admissible, step):
    history = f"{history_text} " if history_text else ""
    return [{"role": "user", "content": f"{history}{obs}"}]


def build_chat(task, history_text, obs, admissible, step):
    memory = f"\nYour recent steps (observation -> your action): {history_text}" if history_text else ""
    now = "" if step == 0 else f"\nStep {step + 1}. The latest observation: {obs}"
    return [{"role": "user", "content": f"{RULES}\nQuestion: {task}{memory}{now}"}]


def parse(response_text, admissible):
    words = re.sub(r"[<>/]", " ", response_text or "").lower().split()
    if len(words) >= 2 and words[0] in ("search", "answer"):
        body = words[1:-1] if words[-1] == words[0] else words[1:]  # a closing tag's word
        if body:
            return f"<{words[0]}>{' '.join(body)}</{words[0]}>", True
    return "", False


def parse_chat(response_text, admissible):
    match = ACTION.search(response_text or "")
    if match and match.group(2).strip():
        return f"<{match.group(1)}>{match.group(2).strip()}</{match.group(1)}>", True
    return "", False
