"""WebShop: buy the product an instruction asks for, by searching and clicking through a shop's
text pages (Yao et al. 2022, "WebShop: Towards Scalable Real-World Web Interaction with Grounded
Language Agents", repository princeton-nlp/WebShop: its text mode, offline, written here).

    pages:  search -> results (10 a page of the top 50, next / prev) -> item (options, Description,
            Features, Buy Now) -> bought; each page shown as WebShop's simple text mode does, its
            texts joined by " [SEP] ", the instruction first
    action: search[keywords] (on the search page) or click[x], x one of the page's clickables;
            anything else is invalid: a no-op step
    admissible_actions: the page's clickables as click[...]; on the search page one suggested search,
            the instruction itself (WebShop's rule baseline); any search[...] is accepted there
    reward: at click[buy now], WebShop's score (its engine/goal.py get_reward): (attributes matched
            + options matched + price under the limit) / (goal attributes + goal options + 1), times
            a type factor; won = reward 1; truncated after max_steps (15)

Departures: BM25 from the `bm25s` package replaces WebShop's pyserini/Lucene index (Java); the type
factor's noun match uses the title's words minus stop words instead of spaCy nouns; no colour
normalisation before option matching; no Reviews page and no Rating (no reviews file needed); a
product's price range becomes one price drawn from a seeded RNG per product, not a fresh draw.

Data (`--env_args data_dir=DIR` or $WEBSHOP_DATA), WebShop's own files (its setup.sh downloads them):
    items_shuffle_1000.json   products: asin, name, full_description, small_description, pricing,
                              customization_options, category, query, product_category
    items_ins_v2_1000.json    asin -> {"attributes": [...]}
    items_human_ins.json      asin -> [{"instruction", "instruction_attributes", "instruction_options"}]
`small=False` reads the full catalogue (items_shuffle.json, items_ins_v2.json) instead of the 1000.
Goals: the human instructions, shuffled with seed 233 as WebShop does; the first min(500, 1/5) are
the eval set "test", the rest train: reset(seed) plays train goal seed % N.
`python -m envs.demo webshop DIR` writes a small catalogue and instructions in these formats.
"""

import json
import os
import random
import re
from functools import lru_cache

import gymnasium
from rapidfuzz import fuzz, utils

from envs import TextSpace, test_set
from envs.search import BM25

PER_PAGE, TOP_N = 10, 50
TINY_CORPUS_EPISODES = 20
STOP = set("a an the and or of for to in on with by at from is are this that your you new set pack".split())


def title_words(text):
    return {w for w in re.findall(r"[a-z]+(?:-[a-z]+)*", text.lower()) if len(w) > 1 and w not in STOP}


def fuzzy(a, b):
    """thefuzz's token_set_ratio (WebShop's fuzzy match), through rapidfuzz with its default processing."""
    return fuzz.token_set_ratio(a, b, processor=utils.default_process)


def type_reward(product, goal):
    """1 when the query, 2+ category levels or > 20% of the goal title's words match; 0.5 when none
    does; 0.1 when < 10% of the title words match; 0 when none does (goal.py get_type_reward)."""
    query_match = product["query"] == goal["query"]
    levels = lambda p: {x.strip() for x in p["product_category"].split("›")}
    category_match = len(levels(product) & levels(goal)) >= 2
    wanted = title_words(goal["name"])
    title_score = len(title_words(product["Title"]) & wanted) / len(wanted) if wanted else 0.2
    r = 1.0 if query_match or category_match or title_score > 0.2 else 0.5
    return 0.0 if title_score == 0 else 0.1 if title_score < 0.1 else r


def in_text(value, product):
    text = " ".join([product["Title"], *product["BulletPoints"], product["Description"]]).lower()
    return value.lower() in text


def reward(product, goal, price, options):
    """WebShop's get_reward: attribute matches (fuzzy > 85 against the product's attributes, else a
    substring of its title, features or description), option matches (each chosen option: exactly
    for size, fuzzy > 85 otherwise, else a substring of the texts), price <= the goal's limit."""
    attrs = sum(
        any(fuzzy(p, g) > 85 for p in product["Attributes"]) or in_text(g, product)
        for g in goal["attributes"]
    )
    wanted = (
        list(goal["goal_options"].values())
        if isinstance(goal["goal_options"], dict)
        else goal["goal_options"]
    )
    opts = sum(
        (v in wanted if k.lower() == "size" else any(fuzzy(g, v) > 85 for g in wanted)) or in_text(v, product)
        for k, v in options.items()
    )
    total = (attrs + opts + (price <= goal["price_upper"])) / (len(goal["attributes"]) + len(wanted) + 1)
    return total * type_reward(product, goal)


def data_root(data_dir=None):
    root = data_dir or os.environ.get("WEBSHOP_DATA")
    if not root or not os.path.isdir(root):
        raise FileNotFoundError(
            f"webshop: no data dir ({root or 'none given'}): give --env_args data_dir=DIR "
            "or set $WEBSHOP_DATA to a "
            f"folder with WebShop's items_shuffle_1000.json, items_ins_v2_1000.json and items_human_ins.json "
            f"(WebShop's setup.sh downloads them), or make the demo set: python -m envs.demo webshop DIR"
        )
    return root


def _read(root, name):
    path = os.path.join(root, name)
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"webshop: no {path}; WebShop's setup.sh downloads it, or make the demo set: "
            f"python -m envs.demo webshop DIR"
        )
    with open(path) as f:
        return json.load(f)


def _product(p, attributes):
    """One raw product -> the fields the pages and the reward use (as WebShop's engine.load_products)."""
    prices = [
        float(x)
        for x in (re.sub(r"[^\d.]", "", x) for x in (p.get("pricing") or "").split("$")[1:])
        if x.strip(".")
    ][:2] or [100.0]  # WebShop: a product without a price costs $100
    options = {
        name.lower(): [o["value"].strip().replace("/", " | ").lower() for o in values]
        for name, values in (p.get("customization_options") or {}).items()
        if values
    }
    bullets = p["small_description"] if isinstance(p["small_description"], list) else [p["small_description"]]
    return {
        "asin": p["asin"],
        "Title": p["name"],
        "Description": p.get("full_description") or "",
        "BulletPoints": bullets,
        "options": options,
        "query": p["query"].lower().strip(),
        "category": p["category"],
        "product_category": p["product_category"],
        "Attributes": attributes.get(p["asin"], {}).get("attributes") or ["DUMMY_ATTR"],
        "Price": f"${prices[0]}" if len(prices) == 1 else f"${prices[0]} to ${prices[1]}",
        "price": prices[0] if len(prices) == 1 else random.Random(p["asin"]).uniform(*prices),
    }


@lru_cache(maxsize=2)
def load(root, small=True):
    """-> (products by asin, asins in index order, BM25 index, goals), once per process."""
    suffix = "_1000" if small else ""
    raw, attributes = _read(root, f"items_shuffle{suffix}.json"), _read(root, f"items_ins_v2{suffix}.json")
    human = _read(root, "items_human_ins.json")
    products = {}
    for p in raw:
        if p["asin"] != "nan" and len(p["asin"]) <= 10 and p["asin"] not in products:
            products[p["asin"]] = _product(p, attributes)
    asins = list(products)
    index = BM25(
        [
            " ".join([q["Title"], *q["BulletPoints"], q["Description"], *sum(q["options"].values(), [])])
            for q in products.values()
        ]
    )
    # in catalogue order, as WebShop builds them: its shuffle (seed 233) then picks the same test goals
    goals = []
    for asin in asins:
        for k, ins in enumerate(human.get(asin, [])):
            if not ins.get("instruction_attributes"):
                continue
            p = products[asin]
            above = [10.0 * i for i in range(1, 100) if 10.0 * i > p["price"]][:4]
            upper = max(random.Random(f"{asin}/{k}").sample(above, 2)) if len(above) >= 2 else 1e6
            limit = f", and price lower than {upper:.2f} dollars" if len(above) >= 2 else ""
            goals.append(
                {
                    "asin": asin,
                    "query": p["query"],
                    "name": p["Title"],
                    "product_category": p["product_category"],
                    "price_upper": upper,
                    "instruction_text": ins["instruction"].strip(".") + limit,
                    "attributes": ins["instruction_attributes"],
                    "goal_options": ins["instruction_options"],
                }
            )
    random.Random(233).shuffle(goals)
    if not goals:
        raise FileNotFoundError(
            f"webshop: no instruction in {root}/items_human_ins.json is for a product of the catalogue"
        )
    return products, asins, index, goals


def split_goals(goals, split):
    n_test = min(500, len(goals) // 5)
    return goals[:n_test] if split == "test" else goals[n_test:]


class WebShop(gymnasium.Env):
    def __init__(self, data_dir=None, split="train", small=True, max_steps=15):
        if split not in ("train", "test") or type(max_steps) is not int or max_steps < 1:
            raise ValueError(
                f"webshop: split must be train or test and max_steps an integer >= 1; got "
                f"split={split!r} max_steps={max_steps!r}"
            )
        self.root, self.small = data_root(data_dir), bool(small)
        self.products, self.asins, self.index, goals = load(self.root, self.small)
        self.goals, self.max_steps = split_goals(goals, split), max_steps
        if not self.goals:
            raise ValueError(
                f"webshop: the {split} split of {self.root} has no goals ({len(goals)} in all; "
                f"test takes 1/5)"
            )
        self.observation_space, self.action_space = TextSpace(), TextSpace(["click[back to search]"])

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        seed = seed if seed is not None else int(self.np_random.integers(2**62))
        self.goal = self.goals[seed % len(self.goals)]
        self.page, self.steps, self.results, self.page_no, self.asin, self.chosen = (
            "search",
            0,
            [],
            1,
            None,
            {},
        )
        obs = self._obs()
        return obs, self._info(False, obs)

    def shown(self):
        """The results page's asins, and whether a next page follows."""
        end = self.page_no * PER_PAGE
        return self.results[end - PER_PAGE : end], end < len(self.results)

    def clickables(self):
        if self.page == "results":
            shown, more = self.shown()
            return (
                ["back to search"]
                + ["< prev"] * (self.page_no > 1)
                + ["next >"] * more
                + [a.lower() for a in shown]
            )
        if self.page == "item":
            values = [v for vs in self.products[self.asin]["options"].values() for v in vs]
            return ["back to search", "< prev", *dict.fromkeys(values), "description", "features", "buy now"]
        return ["back to search", "< prev"] if self.page in ("description", "features") else []

    def step(self, action):
        self.steps += 1
        m = re.fullmatch(r"(search|click)\[(.+)\]", (action or "").strip(), re.DOTALL)
        kind, arg = (m.group(1), m.group(2).strip().lower()) if m else (None, "")
        if kind == "search" and self.page == "search" and arg:
            scores = self.index.search(arg, TOP_N)
            self.results, self.page, self.page_no = [self.asins[i] for i, _ in scores], "results", 1
        elif kind == "click" and arg in self.clickables():
            if arg == "buy now":
                p = self.products[self.asin]
                r = reward(p, self.goal, p["price"], self.chosen)
                self.page = "done"
                obs = f"Thank you for shopping with us! [SEP] Your score (min 0.0, max 1.0) [SEP] {r:.3f}"
                return obs, r, True, False, self._info(r == 1.0, obs)
            self._click(arg)
        obs = self._obs()
        return obs, 0.0, False, self.steps >= self.max_steps, self._info(False, obs)

    def _click(self, arg):
        if arg == "back to search":
            self.page, self.asin, self.chosen = "search", None, {}
        elif arg in ("next >", "< prev") and self.page == "results":
            self.page_no += 1 if arg == "next >" else -1
        elif arg == "< prev":  # item -> results, description / features -> item
            self.page = "results" if self.page == "item" else "item"
        elif self.page == "results":
            self.asin, self.chosen, self.page = next(a for a in self.results if a.lower() == arg), {}, "item"
        elif arg in ("description", "features"):
            self.page = arg
        else:  # an option value: WebShop keeps the last choice per option name
            name = next(k for k, vs in self.products[self.asin]["options"].items() if arg in vs)
            self.chosen[name] = arg

    def _obs(self):
        texts = ["Instruction:", self.goal["instruction_text"]]
        if self.page == "search":
            texts = ["WebShop", *texts, "Search"]
        elif self.page == "results":
            shown, more = self.shown()
            texts += ["Back to Search", f"Page {self.page_no} (Total results: {len(self.results)})"]
            texts += ["< Prev"] * (self.page_no > 1) + ["Next >"] * more
            for a in shown:
                texts += [a, self.products[a]["Title"], self.products[a]["Price"]]
        else:
            p = self.products[self.asin]
            texts += ["Back to Search", "< Prev"]
            if self.page == "item":
                for name, values in p["options"].items():
                    texts += [name, *values]
                texts += [p["Title"], f"Price: {p['Price']}", "Description", "Features", "Buy Now"]
            else:
                texts += [p["Description"]] if self.page == "description" else p["BulletPoints"]
        return " [SEP] ".join(texts)

    def _info(self, won, obs):
        actions = [f"click[{c}]" for c in self.clickables()]
        if self.page == "search":
            actions = [f"search[{self.goal['instruction_text']}]"]
        chosen = " ".join(f"{k}: {v}" for k, v in sorted(self.chosen.items()))  # the page does not show them
        return {
            "task": self.goal["instruction_text"],
            "admissible_actions": actions,
            "won": won,
            "anchor": f"{obs} {chosen}".strip(),
        }


def eval_sets(n=None, names=None, **env_args):
    """One eval set, "test": the test split in order (envs.test_set)."""

    def size():
        env = WebShop(**env_args)
        return len(split_goals(load(env.root, env.small)[3], "test"))

    return test_set("webshop", names, n, size)
