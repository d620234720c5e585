"""Prompt and parser for AppWorld (envs/appworld.py).

`build_chat` (pretrained chat models) says what verl-agent's AppWorld prompt says, in our words: you
are a coding agent with the apps' APIs, how to discover them (apis.api_docs), the supervisor's
passwords and the complete_task call; then the supervisor and the task (info["task"]), the memory
(the recent output -> code pairs) and the latest output; reason inside <think> </think> and put the
code inside <code> </code>.
`parse_chat` takes the code between the first <code> and the </code> after it (a ```python fence
inside it is dropped); no <think> ... </think>, no code or an empty block is invalid (never raises).

`build` / `parse` are the same for the tiny model trained from scratch (it cannot write code: this
env is for pretrained models); `parse` also accepts a suggested action written as is.
"""

import re

RULES = (
    "You are an autonomous coding agent. You complete the day-to-day tasks of your supervisor by "
    "writing Python code that calls the APIs of their apps (spotify, venmo, gmail, simple_note, "
    "todoist, amazon, splitwise, phone, file_system) through the `apis` object, e.g. "
    "`apis.spotify.login(...)`. "
    "Each code block runs in the same Python session (variables persist) and you see what it prints.\n"
    "- Find the APIs with apis.api_docs.show_app_descriptions(), apis.api_docs.show_api_descriptions("
    "app_name='...') and apis.api_docs.show_api_doc(app_name='...', api_name='...'). Never guess an "
    "API.\n"
    "- The supervisor's account passwords: apis.supervisor.show_account_passwords(); log in to an app "
    "with its login API to get an access token.\n"
    "- When done, call apis.supervisor.complete_task(answer=...) with the answer if the task asks a "
    "question, else apis.supervisor.complete_task(). Take no other action than the task asks for."
)
FORMAT = (
    "First reason step by step about what to do next inside <think> </think>, then give the Python "
    "code to run now inside <code> </code>."
)


def build_chat(task, history_text, obs, admissible, step):
    memory = f"\n\nYour recent steps ([output -> your code]): {history_text}" if history_text else ""
    now = f"\n\nThis is step {step + 1}. The output of your last code:\n{obs}" if step else ""
    return [{"role": "user", "content": f"{RULES}\n\n{task}{memory}{now}\n\n{FORMAT}"}]


def parse_chat(response_text, admissible):
    text = response_text or ""
    start = text.find("<code>")
    end = text.find("</code>", start + 1) if start != -1 else -1
    think = text.find("<think>")
    if start == -1 or end == -1 or think == -1 or text.find("</think>", think) == -1:
        return "", False
    code = text[start + len("<code>") : end]
    fenced = unfence(code)
    code = (code if fenced is None else fenced).strip("\n")
    return (code, True) if code.strip() else ("", False)


def unfence(code):
    """The inside of a ```python (or ```py, or bare ```) fence around the whole code, its trailing
    whitespace dropped; None where there is no such fence. A fence opens with a line break after
    the tag and closes at the last ``` (only whitespace after it). String scans, not a regex: the
    regex this replaced backtracked cubically on whitespace inside a fence (3.7 s at 2,000
    characters, 157 s at 8,000), and a degenerate reply is mostly whitespace."""
    rest = code.lstrip()
    if not rest.startswith("```"):
        return None
    rest = rest[3:]
    for tag in ("python", "py", ""):
        if rest.startswith(tag):
            after = rest[len(tag) :]
            newline = after.rfind("\n", 0, len(after) - len(after.lstrip()))  # the last in the run
            if newline != -1:
                begin = len(tag) + newline + 1
                break
    else:
        return None
    tail = rest.rstrip()
    if not tail.endswith("```") or len(tail) - 3 < begin:
        return None
    return rest[begin : len(tail) - 3].rstrip()


def build(task, history_text, obs, admissible, step):
    return build_chat(task, history_text, obs, admissible, step)


def parse(response_text, admissible):
    squeezed = {re.sub(r"\s+", "", a): a for a in admissible}
    text = re.sub(r"\s+", "", response_text or "")
    return (squeezed[text], True) if text in squeezed else parse_chat(response_text, admissible)
