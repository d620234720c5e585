"""Prompt and parser for ALFWorld, after the reference's template (REFERENCE.md, section 5).

One user message per step: the task, how many steps were taken, the memory's last observation /
action pairs, the current step and observation, the admissible actions (without "help"), and the
output format: reasoning in <think> </think>, then one action in <action> </action>.

The parser is the reference's projection: lowercase, take the text between the first <action> and
the first </action> after it; missing tags, or a missing <think> </think>, make the step invalid
(the env still gets the last 30 characters, which it answers with "Nothing happens."). As in the
reference, a well-formed action that is not admissible is still valid: the env rejects it, and the
episode's reward says so. (The reference also marks responses with Chinese characters invalid, a
Qwen-specific guard we leave out.)
"""

FORMAT = ("Now it is your turn to act. First think step by step about the situation, inside "
          "<think> </think>. Then give exactly one admissible action inside <action> </action>.")


def build(task, history_text, obs, admissible, step):
    actions = ", ".join(f"'{a}'" for a in admissible if a != "help")
    past = f"You have taken {step} step(s) so far. " if step else ""
    if history_text:
        past += f"Your most recent observations and the actions you took: {history_text}"
    past += "\n" if past else ""
    content = (f"You are an expert agent in a household (the ALFRED embodied environment). "
               f"Your task is to: {task}\n{past}"
               f"This is step {step + 1}. Your current observation is: {obs}\n"
               f"Your admissible actions now are: [{actions}].\n\n{FORMAT}")
    return [{"role": "user", "content": content}]


def parse(response_text, admissible):
    """-> (action, valid). Never raises."""
    text = (response_text or "").lower()
    start = text.find("<action>")
    end = text.find("</action>", start + 1) if start != -1 else -1
    if start == -1 or end == -1:
        return text[-30:], False
    action = text[start + len("<action>"):end].strip()
    thought = text.find("<think>")
    valid = thought != -1 and text.find("</think>", thought) != -1
    return action, valid
