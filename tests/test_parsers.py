"""Fuzz every parser (prompts/): random and adversarial strings, a fixed seed, thousands of cases.
A parser never raises, `valid` means a well-formed action (treasure: an admissible word; ALFWorld:
one line between the tags, no tag pieces, with a <think> </think>), and an invalid reply is a no-op
for the env (treasure: text that is no move; ALFWorld: the empty action)."""

import random
import re

from envs.treasure import MOVES
from prompts import alfworld, prompt_module, treasure

ADM_T = list(MOVES)
ADM_A = ["go to fridge 1", "open fridge 1", "look", "take apple 2 from countertop 1", "inventory"]
PIECES = [
    "<think>",
    "</think>",
    "<action>",
    "</action>",
    "<",
    ">",
    "/",
    "think",
    "action",
    "<act",
    "ion>",
    "</",
    "<THINK>",
    "</ACTION>",
    "<action >",
    " ",
    "\n",
    "\t",
    "\r",
    "\x00",
    "\u2028",
    ".",
    "!",
    "'",
    '"',
    "*",
    "`",
    ",",
    "é",
    "İ",
    "ß",
    "中文",
    "🙂",
    "\ufeff",
    *ADM_T,
    *(a.upper() for a in ADM_T),
    *ADM_A,
    "go to",
    "fridge",
    "1",
]


def fuzz_strings(n, seed=0):
    rng = random.Random(seed)
    adversarial = [
        "",
        None,
        " ",
        "\n",
        "<action></action>",
        "<think></think><action></action>",
        "<think>x</think><action>look</think></action>",
        "<think>x</think><action>look</think>",
        "<think>x</think><action> \n </action>",
        "<think>x</think><action>go to\nfridge 1</action>",
        "<action>look</action><think>x</think>",
        "</think><think><action>look</action>",
        "<think>x</think><action><action>look</action>",
        "<think>x</think><action>look<</action>",
        "look</think>",
        "look",
        "<action>look</action>",
        "x" * 10_000,
        "<" * 500,
        "Down.",
        "**Left**",
    ]
    out = list(adversarial)
    for _ in range(n):
        k = rng.choice([1, 2, 3, 5, 8, 20])
        junk = lambda: "".join(rng.choice(PIECES) for _ in range(rng.randrange(0, 4)))  # noqa: E731
        u = rng.random()
        if u < 0.2:  # plain random characters, printable or not
            out.append("".join(chr(rng.randrange(0, 0x3000)) for _ in range(rng.randrange(0, 40))))
        elif u < 0.6:  # the reply format, with junk in every gap (and sometimes in the action)
            action = rng.choice(ADM_A + ADM_T) if rng.random() < 0.5 else junk()
            out.append(f"{junk()}<think>{junk()}</think>{junk()}<action>{action}</action>{junk()}")
        else:
            out.append("".join(rng.choice(PIECES) for _ in range(k)))
    return out


def test_treasure_parsers_fuzz():
    for parse in (treasure.parse, treasure.parse_chat):
        for text in fuzz_strings(6000, seed=1):
            action, valid = parse(text, ADM_T)
            assert isinstance(action, str) and valid in (True, False), (parse, text)
            if valid:
                assert action in ADM_T
            else:
                assert action not in MOVES and len(action) <= 30, (parse, text, action)  # a no-op move
        if parse is treasure.parse:
            assert all(parse(t, ADM_T)[1] == ((t or "").strip().lower() in ADM_T) for t in fuzz_strings(500))


def alfworld_oracle(text):
    """The rule in prompts/alfworld.py's docstring, written independently with regexes."""
    text = (text or "").lower()
    m = re.search(r"<action>(.*?)</action>", text, re.S)
    if not m or not re.search(r"<think>.*</think>", text, re.S):
        return "", False
    action = m.group(1).strip()
    if not action or re.search(r"[<>]", action) or len(action.splitlines()) != 1:
        return "", False
    return action, True


def test_alfworld_parser_fuzz():
    n_valid = 0
    for text in fuzz_strings(12000, seed=2):
        action, valid = alfworld.parse(text, ADM_A)
        assert (action, valid) == alfworld_oracle(text), text
        if valid:  # a well-formed action: one non-empty line, no tag pieces, found in the reply
            n_valid += 1
            assert action and action == action.strip() and "<" not in action and ">" not in action
            assert action in (text or "").lower() and "\n" not in action
        else:
            assert action == ""  # the env answers "Nothing happens."
    assert n_valid > 50  # the fuzz reaches the valid branch too


def test_alfworld_valid_means_well_formed():
    p, adm = alfworld.parse, ADM_A
    assert p("<think>x</think> <action> Go To Fridge 1 </action>", adm) == ("go to fridge 1", True)
    assert p("<think>x</think><action>jump</action>", adm) == (
        "jump",
        True,
    )  # not admissible: the env says no
    for bad in [
        "<think>x</think><action></action>",
        "<think>x</think><action>look</think></action>",
        "<think>x</think><action>look</think>",
        "<think>x</think><action>go to\nfridge 1</action>",
        "<action>look</action>",
        "look",
        "look</think>",
        "<think>x</think><action><b>look</action>",
    ]:
        assert p(bad, adm) == ("", False), bad


def test_webshop_chat_action_is_one_line():
    from prompts import webshop

    adm = ["search[<your query>]", "click[buy now]"]
    assert webshop.parse_chat("<think>x</think><action>click[buy now]</action>", adm) == (
        "click[buy now]",
        True,
    )
    for brk in ("\n", "\r", "\r\n", "\u2028"):
        assert webshop.parse_chat(f"<think>x</think><action>click[buy now]{brk}search[x]</action>", adm) == (
            "",
            False,
        ), repr(brk)


def test_alfworld_choice_variant():
    """--prompt choice: numbered admissible actions ("help" left out) in an order drawn from the
    list (the same list, the same order; not the env's order everywhere), the reply's first whole
    number picks the action listed under it; the parser never raises and is valid exactly for 1..n."""
    p = prompt_module("alfworld", variant="choice")
    adm = ["go to desk 1", "help", "look", "take pen 1 from desk 1"]
    text = p.build("put a pen in a drawer", "", "You are in a room.", adm, 0)[0]["content"]
    listed = [line.split(". ", 1)[1] for line in text.splitlines() if line[:1].isdigit()]
    assert sorted(listed) == ["go to desk 1", "look", "take pen 1 from desk 1"] and "help" not in text
    assert listed == [
        line.split(". ", 1)[1]
        for line in p.build("t", "", "o", adm, 3)[0]["content"].splitlines()
        if line[:1].isdigit()
    ]  # the same list, the same order
    from prompts.alfworld import choices

    lists = [[f"go to desk {k}", f"go to bed {k}", "look"] for k in range(20)]
    assert sum(choices(opts)[0] != opts[0] for opts in lists) >= 5  # "1" is not always the env's first
    for k, action in enumerate(listed, 1):
        assert p.parse(str(k), adm) == (action, True) and p.parse(f" {k}.", adm) == (action, True)
        assert p.parse(f"Answer: {k}", adm) == (action, True)
    for reply in ("4", "0", "two", "²", "-1", " -2."):
        assert p.parse(reply, adm) == ("", False), reply
    for t in fuzz_strings(3000, seed=2):
        action, valid = p.parse(t, adm)
        assert (action in adm and action != "help") if valid else action == ""
