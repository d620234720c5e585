import json
import random
import re

import gymnasium
import pytest
from gymnasium.utils.env_checker import check_env

from envs import demo as demo_sets
from envs.webshop import WebShop, eval_sets, type_reward
from prompts import prompt_module


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return demo_sets.webshop(str(tmp_path_factory.mktemp("webshop_demo")))


def expert(env):
    """Search the wanted product's title, page to it, pick the instruction's options, buy."""
    env.step(f"search[{env.goal['name']}]")
    while env.goal["asin"] not in env.results[(env.page_no - 1) * 10 : env.page_no * 10]:
        env.step("click[next >]")
    env.step(f"click[{env.goal['asin'].lower()}]")
    for value in env.goal["goal_options"]:
        env.step(f"click[{value}]")
    return env.step("click[buy now]")


def test_scripted_expert_wins_every_goal(demo):
    for split in ("test", "train"):
        env = WebShop(data_dir=demo, split=split)
        for seed in range(len(env.goals)):
            env.reset(seed)
            obs, r, term, trunc, info = expert(env)
            assert (r, term, trunc, info["won"]) == (1.0, True, False, True), env.goal
            assert obs.endswith("[SEP] 1.000")
    assert (
        len(env.goals) == 58 and len(WebShop(data_dir=demo, split="test").goals) == 14
    )  # 72 goals: 1/5 test
    base = demo_sets.baselines("webshop", demo)
    assert (
        base["rule"][0] == 0 and 0.5 < base["rule"][1] < 0.9
    )  # buys a fitting item, never picks its options
    assert base["random"][0] == 0 and base["random"][1] < base["rule"][1]


def write_shop(folder):
    """Three hand-written products in WebShop's formats: the wanted t-shirt A ($20), a t-shirt B that
    shares one of the two wanted attributes ($75: over any price limit A's $20 gets), a mug C."""

    def product(asin, name, query, path, price, bullets, options):
        return {
            "asin": asin,
            "name": name,
            "full_description": "Plain text.",
            "small_description": bullets,
            "pricing": price,
            "category": "x",
            "query": query,
            "product_category": path,
            "images": [""],
            "customization_options": {
                k: [{"value": v, "image": None} for v in vs] for k, vs in options.items()
            },
        }

    shirt = {"color": ["Black", "White"], "size": ["Small", "Large"]}
    items = [
        product(
            "BAAAAAAAAA",
            "Acmex Classic T-Shirt",
            "men's t-shirts",
            "Clothing › Men › Shirts",
            "$20.0",
            ["Soft."],
            shirt,
        ),
        product(
            "BBBBBBBBBB",
            "Halden Urban T-Shirt",
            "t-shirts",
            "Clothing › Men › Tops",
            "$75.0",
            ["Soft."],
            shirt,
        ),
        product(
            "BCCCCCCCCC",
            "Quill Pro Coffee Mug",
            "coffee mugs",
            "Home › Mugs",
            "$12.0",
            ["Big."],
            {"size": ["11 oz"]},
        ),
    ]
    attrs = {
        "BAAAAAAAAA": {"attributes": ["machine wash", "slim fit"]},
        "BBBBBBBBBB": {"attributes": ["machine washable", "short sleeve"]},
        "BCCCCCCCCC": {"attributes": ["dishwasher safe"]},
    }
    human = {
        "BAAAAAAAAA": [
            {
                "instruction": "i want a slim fit machine wash t-shirt, black, large.",
                "instruction_attributes": ["machine wash", "slim fit"],
                "instruction_options": ["black", "large"],
            }
        ]
    }
    for name, data in (
        ("items_shuffle_1000.json", items),
        ("items_ins_v2_1000.json", attrs),
        ("items_human_ins.json", human),
    ):
        (folder / name).write_text(json.dumps(data))
    return str(folder)


@pytest.mark.parametrize(
    "asin, clicks, expected",
    [
        ("baaaaaaaaa", ["black", "large"], 1.0),  # (2 attributes + 2 options + price) / (2 + 2 + 1)
        ("baaaaaaaaa", ["black", "small"], 0.8),  # the wrong size: (2 + 1 + 1) / 5
        ("baaaaaaaaa", ["large", "small"], 0.6),  # the last choice of an option counts: (2 + 0 + 1) / 5
        ("baaaaaaaaa", [], 0.6),  # no option chosen: (2 + 0 + 1) / 5
        ("bbbbbbbbbb", ["black", "large"], 0.6),  # B: "machine washable" fuzzy-matches, slim fit nowhere,
        # $75 over the limit: (1 + 2 + 0) / 5; same category
        # levels Clothing, Men: type factor 1
        ("bccccccccc", ["11 oz"], 0.0),  # the mug: (0 + 0 + 1) / 5, times type 0 (no shared
        # query, category level or title word)
    ],
)
def test_reward_of_wrong_items_and_options(tmp_path, asin, clicks, expected):
    env = WebShop(
        data_dir=write_shop(tmp_path)
    )  # one goal: the train split (test gets 1/5 of them, here none)
    assert len(env.goals) == 1
    obs, info = env.reset(0)
    assert (
        env.goal["instruction_text"].startswith(
            "i want a slim fit machine wash t-shirt, black, large, and price lower than "
        )
        and 40 <= env.goal["price_upper"] <= 60
    )
    env.step("search[t-shirt mug soft big]")
    env.step(f"click[{asin}]")
    for c in clicks:
        env.step(f"click[{c}]")
    obs, r, term, trunc, info = env.step("click[buy now]")
    assert term and r == pytest.approx(expected) and info["won"] == (expected == 1.0)


def test_type_factor_cases():
    goal = {"query": "q", "product_category": "A › B › C", "name": "Alpha Beta Gamma Delta Epsilon Zeta"}

    def item(title, query="other", path="X › Y"):
        return {"Title": title, "query": query, "product_category": path}

    assert type_reward(item("Alpha Omega"), goal) == 0.5  # 1/6 of the words, nothing else
    assert type_reward(item("Alpha Omega", query="q"), goal) == 1.0  # the same query
    assert type_reward(item("Alpha Omega", path="A › B › Z"), goal) == 1.0  # two category levels
    assert type_reward(item("Alpha Beta Omega"), goal) == 1.0  # 2/6 > 0.2 of the words
    assert type_reward(item("Omega", query="q"), goal) == 0.0  # no title word: 0 whatever else
    long_goal = {**goal, "name": " ".join(f"w{c}" for c in "abcdefghijk") + " alpha"}  # 12 words
    assert type_reward(item("Alpha", query="q"), long_goal) == 0.1  # 1/12 < 0.1


def test_page_flow_and_junk_actions(demo):
    env = WebShop(data_dir=demo, max_steps=40)
    obs, info = env.reset(1)
    assert obs.startswith("WebShop [SEP] Instruction: [SEP] i need a") and obs.endswith("[SEP] Search")
    assert info["admissible_actions"] == [f"search[{env.goal['instruction_text']}]"]
    for junk in (
        None,
        "",
        "search[]",
        "click[buy now]",
        "click[back to search]",
        "buy",
        "search[x",
        "\x00" * 9,
    ):
        assert env.step(junk)[:4] == (obs, 0.0, False, False)  # invalid: nothing changes
    obs, _, _, _, info = env.step("search[black white oz]")  # option values are indexed
    assert "Page 1 (Total results: 50) [SEP] Next >" in obs and "< Prev" not in obs
    assert info["admissible_actions"][:2] == ["click[back to search]", "click[next >]"]
    assert len(info["admissible_actions"]) == 12
    assert env.step("search[mug]")[0] == obs  # no search bar here
    obs2, _, _, _, info = env.step("click[next >]")
    assert (
        "Page 2 (Total results: 50) [SEP] < Prev [SEP] Next >" in obs2
        and "click[< prev]" in info["admissible_actions"]
    )
    asin = info["admissible_actions"][3][6:-1]
    obs3, _, _, _, info = env.step(f"click[{asin.upper()}]")  # arguments are lowercased
    assert "[SEP] Buy Now" in obs3 and "click[buy now]" in info["admissible_actions"]
    assert env.step("click[description]")[0].endswith("for daily use.")
    assert env.step("click[< prev]")[0] == obs3  # description -> item
    assert env.step("click[< prev]")[0] == obs2  # item -> its results page
    assert env.step("click[back to search]")[0] == env.reset(1)[0]
    env = WebShop(data_dir=demo, max_steps=3)
    env.reset(0)
    outs = [env.step("click[nothing]") for _ in range(3)]
    assert [o[3] for o in outs] == [False, False, True] and not any(o[2] for o in outs)


def test_check_env_make_eval_sets_and_missing_data(demo, tmp_path, monkeypatch):
    import train

    check_env(WebShop(data_dir=demo), skip_render_check=True)
    env = gymnasium.make("gigpo/WebShop-v0", data_dir=demo)
    assert env.observation_space.contains(env.reset(seed=2)[0])
    assert eval_sets(5, data_dir=demo) == {"test": ({"split": "test"}, [0, 1, 2, 3, 4])}
    assert len(eval_sets(None, data_dir=demo)["test"][1]) == 14
    monkeypatch.delenv("WEBSHOP_DATA", raising=False)
    with pytest.raises(FileNotFoundError) as e:
        WebShop()
    assert (
        "$WEBSHOP_DATA" in str(e.value)
        and "--env_args data_dir=DIR" in str(e.value)
        and "\n" not in str(e.value)
    )
    with pytest.raises(FileNotFoundError, match="items_shuffle_1000.json"):
        WebShop(data_dir=str(tmp_path))
    for env_args, words in (
        ("", "$WEBSHOP_DATA"),
        (f"data_dir={demo},max_steps=0", "max_steps"),
        (f"data_dir={demo},small=False", "items_shuffle.json"),
    ):
        cfg = train.parse_args(
            ["--env", "webshop", "--env_args", env_args, "--out_dir", str(tmp_path / "out")]
        )
        with pytest.raises(SystemExit) as e:
            train.check_config(cfg)
        msg = str(e.value.code)
        assert msg.startswith("error: ") and words in msg and "\n" not in msg, msg


@pytest.mark.parametrize("chat", [False, True])
def test_parsers_never_raise(chat, demo):
    env = WebShop(data_dir=demo)
    env.reset(0)
    env.step("search[lamp]")
    admissible = env._info(False, "")["admissible_actions"]
    prompt, rng = prompt_module("webshop", chat=chat), random.Random(0)
    alphabet = [
        "click",
        "search",
        "[",
        "]",
        " ",
        "buy",
        "now",
        "next",
        ">",
        "<action>",
        "</action>",
        "<think>",
        "</think>",
        "b",
        "0",
        "\n",
    ]
    for _ in range(2000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))
        action, valid = prompt.parse(text, admissible)
        assert isinstance(action, str) and (valid or action == "")
    tiny = prompt_module("webshop")
    spaced = " ".join(
        admissible[2].replace("[", " [ ").replace("]", " ] ")
    )  # the tokenizer's digit-by-digit decode
    assert tiny.parse(spaced, admissible) == (admissible[2], True)
    assert tiny.parse("click [ next > ]", admissible) == ("click[next >]", True)
    assert tiny.parse("search [ red mug ]", admissible) == ("", False)  # no search bar on this page
    assert tiny.parse("search [ red  mug ]", ["search[x]"]) == ("search[red mug]", True)
    assert tiny.parse("search [ ]", ["search[x]"]) == ("", False)
    chat_ = prompt_module("webshop", chat=True)
    assert chat_.parse("<think>ok</think><action>click[Next >]</action>", admissible) == (
        "click[next >]",
        True,
    )
    msg = chat_.build("buy x", "", "WebShop [SEP] Search", ["search[buy x]"], 0)[0]["content"]
    assert "'search[<your query>]'" in msg and "buy x" in msg and "<action>" in msg


def test_train_one_iteration_with_the_tiny_model(demo, train_tiny):
    last, row = train_tiny("webshop", f"data_dir={demo},max_steps=4", 8)
    assert re.search(r"held-out success test \d\.\d{3} \(test 4 games", last), last
    assert row["iteration"] == 1 and 4 <= row["samples"] <= 16 and row["episode_length"] <= 4


def test_real_format_quirks(tmp_path):
    """What WebShop's files hold besides the clean case: a price range, no price, a description as
    one string, options None or with '/' in a value, an asin 'nan', a repeated asin, a product with
    no attribute record (WebShop: DUMMY_ATTR), instructions without attributes (skipped)."""

    def raw(asin, pricing, small, options):
        return {
            "asin": asin,
            "name": f"Item {asin}",
            "full_description": None,
            "small_description": small,
            "pricing": pricing,
            "customization_options": options,
            "category": "c",
            "query": " Q ",
            "product_category": "A › B",
            "images": [""],
        }

    items = [
        raw("B1", "$10.00 - $20.00", "One line.", {"Color": [{"value": "Black/Red ", "image": None}]}),
        raw("B2", None, ["a", "b"], None),
        raw("nan", "$1", "x", None),
        raw("B1", "$5", "dup", None),
    ]
    human = {
        "B1": [
            {
                "instruction": "want b1.",
                "instruction_attributes": ["x"],
                "instruction_options": ["black | red"],
            },
            {"instruction": "no attributes", "instruction_attributes": [], "instruction_options": []},
        ],
        "B2": [{"instruction": "want b2", "instruction_attributes": ["y"], "instruction_options": []}],
        "B9": [
            {
                "instruction": "not in the catalogue",
                "instruction_attributes": ["z"],
                "instruction_options": [],
            }
        ],
    }
    for name, data in (
        ("items_shuffle_1000.json", items),
        ("items_ins_v2_1000.json", {"B1": {"attributes": ["x"]}}),
        ("items_human_ins.json", human),
    ):
        (tmp_path / name).write_text(json.dumps(data))
    env = WebShop(data_dir=str(tmp_path))
    p1, p2 = env.products["B1"], env.products["B2"]
    assert list(env.products) == ["B1", "B2"] and p1["BulletPoints"] == ["One line."]
    assert p1["Price"] == "$10.0 to $20.0" and 10 <= p1["price"] <= 20 and p2["Price"] == "$100.0"
    assert p1["options"] == {"color": ["black | red"]} and p2["options"] == {} and p1["query"] == "q"
    assert p1["Attributes"] == ["x"] and p2["Attributes"] == ["DUMMY_ATTR"] and p1["Description"] == ""
    assert sorted(g["asin"] for g in env.goals) == ["B1", "B2"]
    env.reset([g["asin"] for g in env.goals].index("B1"))
    assert env.goal["instruction_text"].startswith("want b1, and price lower than ")
    for action in ("search[item]", "click[b1]", "click[black | red]"):
        env.step(action)
    assert env.step("click[buy now]")[1:3] == (1.0, True)
