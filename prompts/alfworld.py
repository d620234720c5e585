"""Prompt and parser for ALFWorld, after the reference system's template.

One user message per step: the task, how many steps were taken, the memory's last observation /
action pairs, the current step and observation, the admissible actions (without "help"), and the
output format: reasoning in <think> </think>, then one action in <action> </action>.

The parser is the reference's projection, made strict: lowercase, take the text between the first
<action> and the first </action> after it; the step is valid only with a <think> and a </think>
after it somewhere in the reply, and an action that is one line, not empty and free of tag pieces
(`<`, `>`): valid_ratio then counts well-formed actions (`look</think>` or `<action></action>` is
none). An invalid reply sends the env the empty action, which it answers with "Nothing happens.":
valid=False is always a no-op (the reference sent the last 30 characters, which the env carried out
where they made a command).
As in the reference, a well-formed action that is not admissible is still valid: the env rejects
it, and the episode's reward says so. (The reference also marks responses with Chinese characters
invalid, a Qwen-specific guard we leave out.)
"""

import re
import zlib

FORMAT = (
    "Now it is your turn to act. First think step by step about the situation, inside "
    "<think> </think>. Then give exactly one admissible action inside <action> </action>."
)


def past_steps(step, history_text):
    """The prompt's line on the steps so far and the memory ("" at step 0 without memory)."""
    past = f"You have taken {step} step(s) so far. " if step else ""
    if history_text:
        past += f"Your most recent observations and the actions you took: {history_text}"
    return past + "\n" if past else ""


def build(task, history_text, obs, admissible, step):
    actions = ", ".join(f"'{a}'" for a in admissible if a != "help")
    past = past_steps(step, history_text)
    content = (
        f"You are an expert agent in a household (the ALFRED embodied environment). "
        f"Your task is to: {task}\n{past}"
        f"This is step {step + 1}. Your current observation is: {obs}\n"
        f"Your admissible actions now are: [{actions}].\n\n{FORMAT}"
    )
    return [{"role": "user", "content": content}]


def parse(response_text, admissible):
    """-> (action, valid); an invalid reply is ("", False), a no-op for the env. Never raises."""
    text = (response_text or "").lower()
    start = text.find("<action>")
    end = text.find("</action>", start + 1) if start != -1 else -1
    if start == -1 or end == -1:
        return "", False
    action = text[start + len("<action>") : end].strip()
    thought = text.find("<think>")
    well_formed = action.splitlines() == [action] and "<" not in action and ">" not in action  # 1 line
    if not (well_formed and thought != -1 and text.find("</think>", thought) != -1):
        return "", False
    return action, True


# ---- --prompt choice: the admissible actions numbered, the reply is a number ----
# SmolLM2-135M-Instruct writes no parsable tagged reply at T = 1 (0 of 32 samples, LOG.md), so RL on
# the format above has nothing to rank. Here the reply is the number of an admissible action (one or
# two tokens; give the run --max_response_tokens 2 or so): a smaller task, for small models.
# The list is in an order drawn from the list itself: the env's order put an "examine ..." first
# in most states, and a trained SmolLM2 answered "1" in 97% of steps (valid, never winning); now
# "1" is a different action from state to state, and the same state always gets the same order.
def choices(admissible):
    options = [a for a in admissible if a != "help"]
    key = "|".join(options)
    return sorted(options, key=lambda a: zlib.crc32(f"{a}|{key}".encode()))


def build_choice(task, history_text, obs, admissible, step):
    listed = "\n".join(f"{i}. {a}" for i, a in enumerate(choices(admissible), 1))
    content = (
        f"You are an expert agent in a household (the ALFRED embodied environment). "
        f"Your task is to: {task}\n{past_steps(step, history_text)}"
        f"This is step {step + 1}. Your current observation is: {obs}\n"
        f"Your admissible actions now are:\n{listed}\n\n"
        f"Answer with the number of one admissible action, and nothing else."
    )
    return [{"role": "user", "content": content}]


def parse_choice(response_text, admissible):
    """The reply's first whole number, when it numbers an admissible action -> (that action, True);
    anything else ("", False), a negative number too ("-1" is not 1). Never raises."""
    number = re.search(r"-?[0-9]+", (response_text or "")[:40])
    options = choices(admissible)
    if not number or not 1 <= int(number.group()) <= len(options):
        return "", False
    return options[int(number.group()) - 1], True
