"""A small AppWorld task set in AppWorld's own on-disk format, made with AppWorld's own code. Runs in
AppWorld's virtualenv, never in ours: `python -m envs.demo appworld DIR` starts it there.

    DIR/data/api_docs/standard/<app>.json    the API docs, built from the installed apps' code
    DIR/data/tasks/<id>/specs.json           instruction, supervisor, datetime, db_version
    DIR/data/tasks/<id>/dbs/<app>.db         each app's starting database (sqlite, AppWorld's models)
    DIR/data/tasks/<id>/ground_truth/        evaluation.py, answer, test_data, metadata, required_apps
    DIR/data/datasets/{train,dev,test_normal}.txt   the task ids of each split

Three task kinds (the scenario is the id's first part, as AppWorld's are): `notetitle` (which of my
Simple Note notes mentions a word: answer its title), `newnote` (write a note with a given title and
content: the evaluation reads the final database) and `zipcode` (the zip code of one of my
addresses, from the supervisor app). Deterministic in the seed.
usage: python envs/appworld_tasks.py DIR [N_TRAIN N_TEST SEED]
"""

import json
import os
import random
import sys
from datetime import datetime

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != HERE]  # else appworld = envs/appworld.py
ROOT = os.path.abspath(sys.argv[1])
os.environ["APPWORLD_ROOT"] = ROOT  # before appworld is imported: its path store reads it

from appworld.apps import get_all_apps  # noqa: E402
from appworld.apps.admin.models import MainUserMunch  # noqa: E402
from appworld.collections.api_docs import ApiDocCollection  # noqa: E402
from appworld.collections.models import ModelCollection  # noqa: E402
from appworld.common.constants import CANARY_STRING, DB_VERSION  # noqa: E402
from appworld.task import Task  # noqa: E402

FIRST = ["Ada", "Bo", "Cleo", "Dev", "Esme", "Finn", "Gia", "Hugo", "Ines", "Jun", "Kai", "Lena"]
LAST = ["Lind", "Okafor", "Marsh", "Quist", "Reyes", "Sato", "Varga", "Weir"]
WORDS = [
    "plums",
    "kayak",
    "violin",
    "cactus",
    "lantern",
    "glacier",
    "saffron",
    "falcon",
    "quartz",
    "tulip",
    "harbor",
    "meteor",
    "walnut",
    "pepper",
    "compass",
    "canyon",
]
ANSWER_EVAL = """import json


def evaluate(test, public_data, private_data, main_user, models, ground_truth_answer):
    task = models.end.supervisor.Task.all()[0]
    with test("the task is marked complete with the right answer"):
        test.answer(json.loads(task.answer), ground_truth_answer)
"""
NOTE_EVAL = (
    ANSWER_EVAL
    + """    users = models.end.simple_note.User.all()
    user = [u for u in users if u.email == main_user.email][0]
    notes = [n for n in models.end.simple_note.Note.all() if n.user_id == user.id]
    with test("a note with the asked title and content exists"):
        asked = (public_data.title, public_data.content)
        made = [n for n in notes if (n.title.strip(), n.content.strip()) == asked]
        test.case(len(made), ">", 0)
"""
)


def api_docs(apps):
    """AppWorld's data ships these docs; ApiDocCollection.build makes them from the apps' code (its
    save() also writes the openapi format, which needs a package we skip)."""
    folder = os.path.join(ROOT, "data", "api_docs", "standard")
    os.makedirs(folder, exist_ok=True)
    docs = ApiDocCollection.build(tuple(apps))
    for app, by_name in docs.items():
        with open(os.path.join(folder, f"{app}.json"), "w") as f:
            json.dump({k: {**v, "canary_string": CANARY_STRING} for k, v in by_name.items()}, f)
    return docs


def make_task(task_id, rng, docs, apps):
    kind = task_id.split("_")[0]
    first, last = rng.choice(FIRST), rng.choice(LAST)
    person = {
        "first_name": first,
        "last_name": last,
        "email": f"{first.lower()}.{last.lower()}@example.com",
        "phone_number": f"555{rng.randrange(10**7):07d}",
        "birthday": "1990-04-02",
    }
    mc = ModelCollection.load(
        to_db_home_path=f":memory:demo-{task_id}", load_apps=["admin", *apps], create_db=True
    )
    for by_name in docs.values():  # the api_docs app serves the docs from its database
        for doc in by_name.values():
            mc.api_docs.ApiDoc.create_save(
                **{("app_name_" if k == "app_name" else k): v for k, v in doc.items()}
            )
    mc.admin.MainUser.create_save(**person)
    sup = mc.supervisor.Supervisor.create_save(**person)
    password = f"{rng.choice(WORDS)}-{rng.randrange(10**4):04d}"
    mc.supervisor.AccountPassword.create_save(
        supervisor_id=sup.id, account_name="simple_note", password=password
    )
    zips = {}
    for name in ("Home", "Work"):
        zips[name] = rng.randrange(10**4, 10**5)
        street = f"{rng.randrange(1, 999)} {rng.choice(WORDS).title()} St"
        mc.supervisor.Address.create_save(
            supervisor_id=sup.id,
            name=name,
            street_address=street,
            city="Springfield",
            state="OR",
            country="United States",
            zip_code=zips[name],
        )
    user = mc.simple_note.User.create_save(
        first_name=first, last_name=last, email=person["email"], password=password, verified=True
    )  # login wants it verified
    words = rng.sample(WORDS, 5)
    titles = [f"{w.title()} {rng.choice(['list', 'ideas', 'plan', 'log'])}" for w in words]
    for w, title in zip(words, titles):
        mc.simple_note.Note.create_save(
            user_id=user.id,
            title=title,
            content=f"Remember the {w} on {rng.choice(WORDS)}",
            created_at=datetime(2023, 5, rng.randint(1, 17)),
        )
    public, required, evaluation = {}, ["simple_note"], ANSWER_EVAL
    if kind == "notetitle":
        k = rng.randrange(len(words))
        instruction, answer = f"What is the title of my Simple Note note that mentions {words[k]}?", titles[k]
    elif kind == "newnote":
        public = {"title": f"{rng.choice(WORDS).title()} trip", "content": f"pack the {rng.choice(WORDS)}"}
        instruction = (
            f'Create a note in Simple Note titled "{public["title"]}" with the content "{public["content"]}".'
        )
        answer, evaluation = None, NOTE_EVAL
    else:
        name = rng.choice(list(zips))
        instruction = f"What is the zip code of my {name.lower()} address?"
        answer, required = zips[name], ["supervisor"]
    mc.supervisor.Task.create_save(supervisor_id=sup.id, instruction=instruction)
    task = Task(
        id=task_id,
        instruction=instruction,
        datetime=datetime(2023, 5, 18, 12, 0),
        allowed_apps=apps,
        supervisor=MainUserMunch(**person, account_passwords={}, addresses={}, payment_cards={}),
        db_version=DB_VERSION,
        model_collection=mc,
    )
    task.save(delete_if_exists=True, save_ground_truth=False)  # GroundTruth.save runs ruff: written below
    folder = os.path.join(ROOT, "data", "tasks", task_id, "ground_truth")
    os.makedirs(folder, exist_ok=True)
    requirements = ["the task is marked complete with the right answer"] + [
        "a note with the asked title and content exists"
    ] * (kind == "newnote")
    files = {
        "metadata.json": {
            "difficulty": 1,
            "mode": "minimal",
            "num_apps": len(required),
            "num_apis": 3,
            "num_solution_code_lines": 3,
        },
        "public_data.json": public,
        "private_data.json": {},
        "answer.json": answer,
        "required_apps.json": required,
        "test_data.json": [{"requirement": r, "label": "no_op_fail"} for r in requirements],
    }
    for name, obj in files.items():
        with open(os.path.join(folder, name), "w") as f:
            json.dump(obj, f)
    with open(os.path.join(folder, "evaluation.py"), "w") as f:
        f.write(evaluation)
    task.close()


def main(n_train=12, n_test=6, seed=0):
    rng, apps = random.Random(seed), get_all_apps(skip_admin=True)
    docs = api_docs(apps)
    kinds = ["notetitle", "newnote", "zipcode"]
    splits = {
        "train": [f"{kinds[i % 3]}_{i // 3 + 1}" for i in range(n_train)],
        "test_normal": [f"{kinds[i % 3]}_{100 + i // 3}" for i in range(n_test)],
    }
    splits["dev"] = splits["test_normal"][:3]
    for task_id in dict.fromkeys(splits["train"] + splits["test_normal"]):
        make_task(task_id, rng, docs, apps)
    folder = os.path.join(ROOT, "data", "datasets")
    os.makedirs(folder, exist_ok=True)
    for split, ids in splits.items():
        with open(os.path.join(folder, f"{split}.txt"), "w") as f:
            f.write("\n".join(ids) + "\n")


if __name__ == "__main__":
    main(*map(int, sys.argv[2:5]))
