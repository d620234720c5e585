"""Prompt and parser for the treasure hunt.

The prompt is deliberately terse (about 14 tokens without memory): the default policy is a tiny
model trained from scratch on a word-level vocabulary, and every prompt token costs it time. A
pretrained chat model (--model NAME) gets the same words wrapped by its own chat template.
"""


def build(task, history_text, obs, admissible, step):
    history = f"{history_text} " if history_text else ""
    return [{"role": "user", "content": f"{history}{obs}"}]


def parse(response_text, admissible):
    """The whole response, stripped and lowercased, must be one admissible action."""
    text = (response_text or "").strip().lower()
    if text in admissible:
        return text, True
    return text[-30:], False  # like the reference: the env still gets the text, a no-op here
