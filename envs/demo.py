"""Small data sets in the real formats of WebShop and Search-R1, made here, for the tests and a
demo when the real data is not at hand (docs/envs.md says where to get it):

    python -m envs.demo webshop DIR   WebShop's items_shuffle_1000.json, items_ins_v2_1000.json and
                                      items_human_ins.json: 72 products of 6 types, one instruction each
    python -m envs.demo search DIR    Search-R1's corpus.jsonl ({"id", "contents"}) and train/test.jsonl
                                      ({"question", "golden_answers"}): 1-3 hop questions
    python -m envs.demo appworld DIR  AppWorld's data/ (tasks with their databases and evaluation, API
                                      docs, datasets/*.txt): 18 tasks of 3 kinds, made by AppWorld's own
                                      code in its virtualenv ($APPWORLD_VENV; envs/appworld_tasks.py)

Then `--env webshop --env_args data_dir=DIR` (or `--env search`). Deterministic in `seed`. The
command also prints two baselines on the set's test split: a random admissible action, and `rule`
(not for appworld: playing it needs servers).
"""

import json
import os
import random

TYPES = [  # noun, category, query, product category, attribute pool, options
    (
        "t-shirt",
        "fashion",
        "men's t-shirts",
        "Clothing › Men › Shirts › T-Shirts",
        ["machine wash", "short sleeve", "cotton spandex", "slim fit", "moisture wicking"],
        {
            "color": ["black", "white", "navy blue", "heather grey"],
            "size": ["small", "medium", "large", "x-large"],
        },
    ),
    (
        "running shoes",
        "fashion",
        "men's running shoes",
        "Clothing › Men › Shoes › Athletic",
        ["non slip", "rubber sole", "lace up", "arch support", "breathable mesh"],
        {"color": ["black", "white", "charcoal"], "size": ["8", "9", "10", "11"]},
    ),
    (
        "coffee mug",
        "home",
        "coffee mugs",
        "Home & Kitchen › Dining › Mugs",
        ["dishwasher safe", "microwave safe", "bpa free", "double wall"],
        {"size": ["11 oz", "15 oz", "20 oz"]},
    ),
    (
        "laptop backpack",
        "fashion",
        "laptop backpacks",
        "Luggage › Backpacks › Laptop Backpacks",
        ["water resistant", "usb charging port", "anti theft", "padded straps"],
        {"color": ["black", "olive", "burgundy"]},
    ),
    (
        "desk lamp",
        "home",
        "led desk lamps",
        "Tools › Lighting › Lamps › Desk Lamps",
        ["dimmable", "eye caring", "touch control", "adjustable arm"],
        {"color": ["black", "white", "silver"]},
    ),
    (
        "face moisturizer",
        "beauty",
        "face moisturizer",
        "Beauty › Skin Care › Face › Moisturizers",
        ["fragrance free", "sensitive skin", "hyaluronic acid", "paraben free", "oil free"],
        {"size": ["1.7 fl oz", "3.4 fl oz"]},
    ),
]
BRANDS = [
    "Acmex",
    "Nordlys",
    "Kestrel",
    "Vantor",
    "Halden",
    "Solvik",
    "Marlow",
    "Tessin",
    "Quill",
    "Orbis",
    "Lumio",
    "Zephyr",
]
STYLES = ["classic", "premium", "everyday", "essential", "pro", "urban", "studio", "travel"]


def webshop(out_dir, per_type=12, seed=0):
    """Write a small catalogue in WebShop's file formats: `per_type` products of each of 6 types
    (distinct titles, 2-3 attributes, the type's options), one human-style instruction per product
    (two of its attributes, one value per option). A product's texts name its own attributes and
    no option value (asserted), so the reward's substring fallbacks never fire by accident."""
    rng, products, attributes, human = random.Random(seed), [], {}, {}
    for noun, category, query, path, pool, opts in TYPES:
        titles = rng.sample([f"{b} {s} {noun}" for b in BRANDS for s in STYLES], per_type)
        for title in titles:
            asin = f"B{rng.randrange(16**9):09X}"
            attrs = rng.sample(pool, rng.randint(2, 3))
            price = round(rng.uniform(8, 60), 2)
            pricing = f"${price}" if rng.random() < 0.8 else f"${price} - ${round(price * 1.2, 2)}"
            products.append(
                {
                    "asin": asin,
                    "name": title.title(),
                    "full_description": f"The {title} for daily use.",
                    "small_description": [f"{a.capitalize()}." for a in attrs],
                    "pricing": pricing,
                    "customization_options": {
                        k: [{"value": v, "image": None} for v in vs] for k, vs in opts.items()
                    },
                    "category": category,
                    "query": query,
                    "product_category": path,
                    "images": [""],
                }
            )
            attributes[asin] = {
                "attributes": attrs,
                "instruction": f"i need a {title}",
                "instruction_attributes": attrs,
            }
            wanted, picks = rng.sample(attrs, 2), [rng.choice(vs) for vs in opts.values()]
            human[asin] = [
                {
                    "asin": asin,
                    "instruction": f"i need a {noun} that is {wanted[0]} and {wanted[1]}, "
                    + ", ".join(f"{k} {v}" for k, v in zip(opts, picks)),
                    "instruction_attributes": wanted,
                    "instruction_options": picks,
                }
            ]
    values = {v for *_, opts in TYPES for vs in opts.values() for v in vs}
    for p in products:  # the guarantee the docstring gives
        text = " ".join([p["name"], p["full_description"], *p["small_description"]]).lower()
        assert not any(v in text for v in values), p["name"]
    os.makedirs(out_dir, exist_ok=True)
    for name, data in (
        ("items_shuffle_1000.json", products),
        ("items_ins_v2_1000.json", attributes),
        ("items_human_ins.json", human),
    ):
        with open(os.path.join(out_dir, name), "w") as f:
            json.dump(data, f, indent=1)
    return out_dir


SYLLABLES = [
    "ka",
    "lo",
    "mi",
    "ren",
    "so",
    "ta",
    "vu",
    "bel",
    "dor",
    "fen",
    "gal",
    "hor",
    "jin",
    "mar",
    "nol",
    "pra",
    "quo",
    "ris",
    "tul",
    "zan",
    "ve",
    "ix",
    "ol",
    "um",
]
JOBS = ["engineer", "painter", "chemist", "sailor", "architect", "composer", "farmer", "surgeon"]


def search(out_dir, n_companies=60, seed=0, test_share=0.2):
    """Write a small multi-hop set in Search-R1's formats: invented companies, their founders, the
    founders' home cities and the cities' countries, one passage per entity, and 1-, 2- and 3-hop
    questions about them ("Who founded X?", "In which city was the founder of X born?", "In which
    country was the founder of X born?"). Deterministic in `seed`; -> out_dir."""
    rng, names = random.Random(seed), set()

    def name(parts):
        while True:
            word = "".join(rng.choice(SYLLABLES) for _ in range(parts)).capitalize()
            if word not in names and len(word) > 3:
                names.add(word)
                return word

    countries = [name(3) + "ia" for _ in range(8)]
    cities = {name(2): rng.choice(countries) for _ in range(20)}
    docs, questions = [], []
    for country in countries:
        docs.append((country, f"{country} is a country with {rng.randint(2, 90)} million people."))
    for city, country in cities.items():
        docs.append((city, f"{city} is a city in the country of {country}."))
    for _ in range(n_companies):
        company, person, city = name(3), f"{name(2)} {name(2)}", rng.choice(list(cities))
        year = rng.randint(1900, 2020)
        docs.append((company, f"{company} is a company founded by {person} in {year}."))
        docs.append((person, f"{person} is a {rng.choice(JOBS)} born in the city of {city}."))
        questions += [
            (f"Who founded {company}?", [person]),
            (f"In which city was the founder of {company} born?", [city]),
            (f"In which country was the founder of {company} born?", [cities[city]]),
        ]
    rng.shuffle(docs)
    rng.shuffle(questions)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "corpus.jsonl"), "w") as f:
        for i, (title, text) in enumerate(docs):
            f.write(json.dumps({"id": str(i), "contents": f'"{title}"\n{text}'}) + "\n")
    n_test = int(len(questions) * test_share)
    for split, rows in (("test", questions[:n_test]), ("train", questions[n_test:])):
        with open(os.path.join(out_dir, f"{split}.jsonl"), "w") as f:
            for i, (q, answers) in enumerate(rows):
                f.write(json.dumps({"id": f"{split}_{i}", "question": q, "golden_answers": answers}) + "\n")
    return out_dir


def appworld(out_dir, n_train=12, n_test=6, seed=0, venv=None):
    """Run envs/appworld_tasks.py in AppWorld's virtualenv (it needs AppWorld's code; we never import
    it) -> out_dir, an AppWorld root for --env_args data_dir= and `appworld serve environment --root`."""
    import subprocess
    import sys

    from envs.appworld import VENV

    python = os.path.join(venv or VENV, "bin", "python")
    if not os.path.exists(python):
        raise FileNotFoundError(
            f"appworld: no {python}: run `python -m envs.appworld install` or set $APPWORLD_VENV"
        )
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "appworld_tasks.py")
    r = subprocess.run(
        [python, script, out_dir, str(n_train), str(n_test), str(seed)], capture_output=True, text=True
    )
    if r.returncode != 0:
        sys.exit(f"appworld demo: {script} failed in {python}:\n{r.stderr[-3000:]}")
    return out_dir


def rule(info):
    """The rule baseline: WebShop's (search the instruction, click the first result, buy now); for
    Search, search the question and answer the first passage's title."""
    actions = info["admissible_actions"]
    if "click[buy now]" in actions:
        return "click[buy now]"
    items = [
        a
        for a in actions
        if a.startswith("click[") and a not in ("click[back to search]", "click[< prev]", "click[next >]")
    ]
    return (items or [a for a in actions if a.startswith("<answer>")] or actions)[0]


def baselines(name, data_dir, seed=0):
    """-> {policy: (success, mean reward)} on the test split: a random admissible action, and `rule`."""
    from envs import make_env

    env, rng, out = make_env(name, data_dir=data_dir, split="test"), random.Random(seed), {}
    for policy in ("random", "rule"):
        wins, rewards = [], []
        for s in range(len(getattr(env, "goals", None) or env.questions)):
            obs, info = env.reset(s)
            done = False
            while not done:
                action = rng.choice(info["admissible_actions"]) if policy == "random" else rule(info)
                obs, r, term, trunc, info = env.step(action)
                done = term or trunc
            wins.append(info["won"])
            rewards.append(r)
        out[policy] = (sum(wins) / len(wins), sum(rewards) / len(rewards))
    return out


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 3 or sys.argv[1] not in ("webshop", "search", "appworld"):
        sys.exit("usage: python -m envs.demo webshop|search|appworld DIR")
    {"webshop": webshop, "search": search, "appworld": appworld}[sys.argv[1]](sys.argv[2])
    print(f"wrote {sys.argv[2]}; use --env {sys.argv[1]} --env_args data_dir={sys.argv[2]}")
    if sys.argv[1] == "appworld":
        print(f"then start its servers: python -m envs.appworld serve N {sys.argv[2]}")
        sys.exit()
    print(
        "test split: "
        + ", ".join(
            f"{policy} policy success {success:.3f} mean reward {reward:.3f}"
            for policy, (success, reward) in baselines(*sys.argv[1:]).items()
        )
    )
