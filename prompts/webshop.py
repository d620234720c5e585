"""Prompt and parser for WebShop (envs/webshop.py).

`build_chat` (pretrained chat models) follows the ALFWorld prompt's shape, as verl-agent does for
WebShop: the instruction, the steps taken, the memory, the current page, the admissible actions
(the search suggestion shown as `search[<your query>]`), then reasoning in <think> </think> and one
action in <action> </action>. `parse_chat` is ALFWorld's strict parser, except that the action may
hold < and > (`click[next >]`, `click[< prev]`); a tag inside it is still invalid.

`build` is terse, for the tiny model trained from scratch: the memory and the page without its
[SEP] marks. Its word-level tokenizer decodes `click[buy now]` as "click [ buy now ]" and an ASIN
digit by digit, so `parse` compares with all spaces removed; any "search [ words ]" is a search.
"""

import re

from prompts.alfworld import FORMAT, past_steps  # <think> ... </think> then <action> ... </action>


def build(task, history_text, obs, admissible, step):
    history = f"{history_text} " if history_text else ""
    return [{"role": "user", "content": f"{history}{obs}".replace(" [SEP] ", " ")}]


def build_chat(task, history_text, obs, admissible, step):
    actions = ", ".join("'search[<your query>]'" if a.startswith("search[") else f"'{a}'" for a in admissible)
    past = past_steps(step, history_text)
    content = (
        f"You are an expert shopper on WebShop, a shopping website you use by searching and clicking. "
        f"Your task is to: {task}\n{past}"
        f"This is step {step + 1}. The current page (its texts separated by [SEP]) is: {obs}\n"
        f"Your admissible actions now are: [{actions}].\n\n{FORMAT}"
    )
    return [{"role": "user", "content": content}]


def parse(response_text, admissible):
    text = (response_text or "").strip().lower()
    table = {re.sub(r"\s+", "", a): a for a in admissible}
    squeezed = re.sub(r"\s+", "", text)
    if squeezed in table:
        return table[squeezed], True
    search = re.fullmatch(r"search\s*\[(.*)\]", text, re.DOTALL)
    words = search.group(1) if search else ""  # a search with a word in it: not blank, not "]"s
    if words.replace("]", "").strip() and any(a.startswith("search[") for a in admissible):
        return f"search[{' '.join(words.split())}]", True
    return "", False


def parse_chat(response_text, admissible):
    """-> (action, valid): lowercased, the text between the first <action> and the </action> after
    it, one line, with a <think> ... </think> in the reply; anything else ("", False). Never raises."""
    text = (response_text or "").lower()
    start = text.find("<action>")
    end = text.find("</action>", start + 1) if start != -1 else -1
    if start == -1 or end == -1:
        return "", False
    action = text[start + len("<action>") : end].strip()
    thought = text.find("<think>")
    if (
        not action
        or len(action.splitlines()) > 1  # any line break, \r included
        or re.search(r"</?(think|action)>", action)
        or thought == -1
        or text.find("</think>", thought) == -1
    ):
        return "", False
    return action, True
