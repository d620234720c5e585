import json
import os
import re
import shutil
import subprocess
import sys
import types

import pytest
import torch
from conftest import SMALL_RUN

import policy
from tiny import is_tiny

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_train(*args, timeout=600):
    return subprocess.run(
        [sys.executable, "train.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


BAD_INPUT = [
    (["--bogus", "1"], "unknown flag --bogus"),
    (["--env", "chess"], "--env"),
    (["--memory", "diary"], "--memory"),
    (["--algo", "dqn"], "--algo"),
    (["--loss", "grpo"], "--loss"),
    (["--group_size", "1"], "--group_size"),
    (["--mini_batch", "0"], "--mini_batch"),
    (["--micro_batch_tokens", "0"], "--micro_batch_tokens"),
    (["--lr", "fast"], "--lr wants a float"),
    (["--env_args", "size=5,colour=red"], "--env_args"),
    (["--env_args", "size=1"], "--env_args"),
    (["--lora_rank", "-1"], "--lora_rank"),
    (["--prompt", "choice"], "--prompt choice: prompts/treasure.py has the variants chat"),
    (["--iterations"], "needs a value"),
    (["--compile", "yes"], "unknown compile 'yes': use --compile with one of auto, 1, 0"),
]


@pytest.fixture(scope="module")
def bad_input_runs(request):
    """The selected BAD_INPUT cases' `python train.py` runs, started at once, 4 at a time (each is
    mostly the interpreter's and torch's imports: ~6.5 s alone): case index -> its future."""
    from concurrent.futures import ThreadPoolExecutor

    chosen = [
        item.callspec.params["k"]
        for item in request.session.items
        if item.originalname == "test_bad_input_is_one_line_before_work"
    ]
    with ThreadPoolExecutor(4) as pool:
        yield {k: pool.submit(run_train, *BAD_INPUT[k][0], timeout=180) for k in chosen}


@pytest.mark.parametrize("k", range(len(BAD_INPUT)), ids=[" ".join(a) for a, _ in BAD_INPUT])
def test_bad_input_is_one_line_before_work(k, bad_input_runs):
    words, r = BAD_INPUT[k][1], bad_input_runs[k].result()
    assert r.returncode != 0
    lines = [l for l in r.stderr.strip().splitlines() if l]
    assert len(lines) == 1 and words in lines[0] and "Traceback" not in r.stderr
    assert "batch:" not in r.stdout  # stopped before any work


def test_help_lists_every_flag_with_the_env_s_defaults():
    from train import Config

    r = run_train("--env", "alfworld", "--help", timeout=60)
    assert r.returncode == 0 and "batch:" not in r.stdout, r.stderr
    flags = [line.split()[0] for line in r.stdout.splitlines() if line.startswith("  --")]
    assert flags == [f"--{name}" for name in Config.__dataclass_fields__]
    assert "  --model 'Qwen/Qwen2.5-1.5B-Instruct'" in r.stdout  # the preset's, not the embedded default's
    assert "  --env 'alfworld'" in r.stdout
    lines = [line.split(None, 2) for line in r.stdout.splitlines() if line.startswith("  --")]
    assert all(len(x) == 3 for x in lines), [x for x in lines if len(x) < 3]  # each flag has its meaning
    notes = {x[0]: x[2] for x in lines}
    assert notes["--resume"].startswith("continue from out_dir/ckpt") and "--resume 0 " in r.stdout  # 1/0
    assert notes["--tis_cap"].startswith("> 0: truncated importance sampling")  # a comment ruff wrapped
    assert notes["--compile"].endswith("else 0 (docs/training.md)")  # the comment line after it joins
    assert "env, memory" not in r.stdout  # Config's section titles are no flag's meaning


@pytest.mark.parametrize(
    "args, words",
    [
        (["--temperature", "0"], "--temperature"),  # the trainer divides the logits by it
        (["--lr", "nan"], "--lr"),
        (["--lr", "-1"], "--lr"),
        (["--lr", "0"], "--lr"),
        (["--kl_coef", "inf"], "--kl_coef"),
        (["--entropy_coef", "-inf"], "--entropy_coef"),
        (["--model", "/nonexistent"], "--model"),
        (["--model", str(ROOT) + "/tests"], "--model"),  # a folder, no model in it
        (["--eval_only", "1", "--model", str(ROOT) + "/tests"], "--model"),
        (["--lr_min", "2"], "--lr_min"),  # a floor above --lr: the lr rose over the run
        (["--out_dir", "/proc/x"], "--out_dir"),
        (["--out_dir", "A_FILE"], "--out_dir"),
        (["--eval_every", "0"], "--eval_every"),
        (["--threads", "0"], "--threads"),
        (["--env_args", "progress=abc"], "--env_args"),
        (["--device", "tpu"], "--device"),
        (["--metrics", "some"], "--metrics"),
        (["--eval_episodes", "0"], "--eval_episodes"),
        (["--memory_k", "-1"], "--memory_k"),
        (["--eval_temperature", "-1"], "--eval_temperature"),
        (["--tis_cap", "-1"], "--tis_cap"),
        (["--clip_high", "-0.1"], "--clip_high"),
        (["--loss", "gspo", "--tis_cap", "2"], "--tis_cap"),
        (["--group_size", "1", "--algo", "ppo", "--dynamic_sampling", "1"], "--group_size"),
        (["--tied_step", "0", "--algo", "grpo"], "--tied_step"),
    ],
)
def test_bad_values_are_one_line_that_names_the_flag(args, words, tmp_path):
    """Values that used to pass check_config and then fail mid-run (a traceback after up to 26 s),
    train on NaN, or run silently wrong (--device tpu on CPU, --eval_episodes 0 an eval of nan,
    --memory_k -1 an unbounded memory). In-process: check_config, which main runs first."""
    import train

    (tmp_path / "file").write_text("")
    args = [str(tmp_path / "file") if a == "A_FILE" else a for a in args]
    cfg = train.parse_args(args if "--out_dir" in args else [*args, "--out_dir", str(tmp_path / "out")])
    with pytest.raises(SystemExit) as e:
        train.check_config(cfg)
    msg = str(e.value.code)
    assert msg.startswith("error: ") and words in msg and "\n" not in msg, msg
    if "--out_dir" not in args:  # a bad flag leaves no out_dir behind (it was made only by the check)
        assert not (tmp_path / "out").exists()
    assert train.check_config(train.Config(eval_temperature=0.0, out_dir=str(tmp_path / "ok"))) is None


def test_compile_auto_is_on_only_where_vllm_generates_on_a_gpu():
    """--compile auto (the default) compiles where every measurement was made (vLLM on a GPU, the FSDP
    update), not on CPU, with --engine hf or with LoRA; 1 / 0 (or true / false) force it."""
    import train
    from engine import HFEngine

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    on = lambda args, device, engine=None: policy.compiled(train.parse_args(args), device, engine)
    assert train.Config().compile == "auto"
    assert on([], cuda) and on(["--engine", "vllm"], cuda) and not on([], cpu)
    assert not on(["--engine", "hf"], cuda) and not on(["--lora_rank", "8"], cuda)
    hf = HFEngine.__new__(HFEngine)  # what auto fell back to: its generate runs on the trainer's layers
    vllm = types.SimpleNamespace(shares_layers=False)  # an engine with its own copy of the weights
    assert on([], cuda, engine=vllm) and not on([], cuda, engine=hf)
    assert on(["--compile", "1"], cpu) and on(["--compile", "true"], cpu, engine=hf)
    assert not on(["--compile", "0"], cuda) and not on(["--compile", "False"], cuda)


def test_compile_reaches_the_kl_reference_too():
    """--compile 1 compiles the frozen KL reference's layers as well as the policy's: its log-prob
    pass is as long as the old log-probs' (it ran eager before)."""
    import train

    cfg = train.parse_args(["--compile", "1", "--kl_coef", "0.01", "--engine", "hf", "--threads", "1"])
    model, _, ref, *_ = policy.build_policy(cfg, torch.device("cpu"), 1, lambda *a, **k: None)
    assert ref is not None and ref is not model
    for m in (model, ref):
        assert all(hasattr(layer.forward, "_torchdynamo_orig_callable") for layer in m.model.layers)
    cfg = train.parse_args(["--compile", "0", "--kl_coef", "0.01", "--engine", "hf", "--threads", "1"])
    ref = policy.build_policy(cfg, torch.device("cpu"), 1, lambda *a, **k: None)[2]
    assert not any(hasattr(layer.forward, "_torchdynamo_orig_callable") for layer in ref.model.layers)


@pytest.mark.parametrize("flag", [["--eval_every", "0"], ["--temperature", "0"]])
def test_bad_flag_never_empties_an_existing_log(tmp_path, flag):
    """--eval_every 0 (and --top_p 0, a flag since removed) used to truncate the run's metrics.jsonl,
    then crash."""
    import train

    log = tmp_path / "metrics.jsonl"
    log.write_text('{"iteration": 1}\n')
    with pytest.raises(SystemExit, match=flag[0]):
        train.main(
            [
                *flag,
                *"--engine hf --n_groups 2 --group_size 2 --eval_episodes 2 --out_dir".split(),
                str(tmp_path),
            ]
        )
    assert log.read_text() == '{"iteration": 1}\n'


def test_training_seeds_are_never_held_out_seeds():
    """--seed 100 used to train on 10**9 + [0, 256), the held-out seeds; now no --seed or iteration
    count reaches them, and the default run's seeds (--seed 0, 250 iterations x 32 groups) are as before."""
    import train
    from evaluate import HELD_OUT, eval_plan

    held_out = set(eval_plan(train.Config())["held-out"][1])
    assert held_out == set(range(10**9, 10**9 + 256))
    assert [train.train_seed(0, it, g, 32) for it in range(1, 251) for g in range(32)] == list(
        range(32, 8032)
    )
    for seed in (0, 1, 99, 100, 101, 200, 12345, -1, -100):
        for it in [*range(1, 300), *range(312_000, 313_000), 10**6, 10**9]:
            seeds = {train.train_seed(seed, it, g, 32) for g in range(32)}
            assert len(seeds) == 32 and not any(HELD_OUT <= s < 2 * HELD_OUT for s in seeds), (seed, it)


def test_two_iterations_end_to_end(tmp_path):
    out = tmp_path / "run"
    r = run_train(
        "--iterations",
        "2",
        "--eval_every",
        "1",
        "--n_groups",
        "4",
        "--group_size",
        "4",
        "--eval_episodes",
        "16",
        "--mini_batch",
        "32",
        "--micro_batch_tokens",
        "64",
        "--kl_coef",
        "0.01",
        "--entropy_coef",
        "0.001",
        "--env_args",
        "max_steps=4",
        "--tis_cap",
        "2",
        "--metrics",
        "all",
        "--out_dir",
        str(out),
    )
    assert r.returncode == 0, r.stderr[-2000:]
    last = r.stdout.strip().splitlines()[-1]
    assert last.startswith("held-out success") and "random policy" in last
    assert last.endswith("at iteration 2"), last
    rows = [json.loads(l) for l in open(out / "metrics.jsonl")]
    assert [m["iteration"] for m in rows] == [1, 2]
    for key in (
        "success",
        "reward",
        "valid_ratio",
        "episode_length",
        "tokens",
        "prompt_tokens",
        "response_tokens",
        "zero_var_group_frac",
        "won_group_frac",
        "step_group_size_hist",
        "kl_ref",
        "entropy",
        "logp_gap",
        "time_gen",
        "time_env",
        "time_update",
        "time_logprobs",
        "time_sync",
        "samples_per_s",
        "eval_success",
    ):
        assert key in rows[-1], key
    assert all(0 < m["time_logprobs"] < m["time_update"] for m in rows)  # the log-prob passes: part of it
    assert rows[-1]["kl_ref"] >= 0 and rows[-1]["logp_gap"] < 1e-3
    # truncated IS: float32 on CPU, rollout and trainer agree, so every weight is ~1 and none capped
    assert all(abs(m["tis_weight"] - 1) < 1e-3 and m["tis_trunc_frac"] == 0 for m in rows)
    assert rows[-1]["optimizer_steps"] >= 2  # ~30-60 samples / mini-batch 32
    assert max(m["episode_length"] for m in rows) <= 4 < 10  # --env_args reached the envs
    # the HF export loads as is, and the checkpoint has what resume needs
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(out / "model")
    tok = AutoTokenizer.from_pretrained(out / "model")
    assert tok("at (1, 2)").input_ids[:2] == [tok.convert_tokens_to_ids("at"), tok.convert_tokens_to_ids("1")]
    meta = json.load(open(out / "ckpt" / "meta.json"))
    assert meta["iteration"] == 2 and meta["config"]["n_groups"] == 4 and os.listdir(out / "ckpt")
    # the export evaluates as the run did: with the tiny model's prompt, to the same greedy success
    assert is_tiny(str(out / "model")) and not is_tiny(str(tmp_path))
    r = run_train(
        "--eval_only",
        "1",
        "--model",
        str(out / "model"),
        "--eval_episodes",
        "16",
        "--env_args",
        "max_steps=4",
        "--out_dir",
        str(tmp_path / "ev"),
    )
    assert r.returncode == 0, r.stderr[-2000:]
    last = r.stdout.strip().splitlines()[-1]
    assert f"success {rows[-1]['eval_success']:.3f}" in last and last.endswith(
        "prompt prompts.treasure.build)"
    ), (rows[-1], last)
    # eval.json: the last eval's rates and games, game by game the same as the eval-only's
    run_eval, only_eval = (json.load(open(d / "eval.json")) for d in (out, tmp_path / "ev"))
    assert run_eval["iteration"] == 2 and only_eval["iteration"] is None
    assert len(run_eval["games"]["held-out"]) == 16 and run_eval["games"] == only_eval["games"]
    assert (
        run_eval["rates"]["held-out"] == rows[-1]["eval_success"] == sum(run_eval["games"]["held-out"]) / 16
    )
    from evaluate import compare

    assert "| held-out | 16 |" in compare(str(out), str(tmp_path / "ev")) and compare(
        str(out), str(out)
    ).endswith("| 0 | 0 | 1.000 |")


def test_paired_sign_test_by_hand():
    """Only the games two evals disagree on count: 6 won by B alone, none by A: p = 2 / 2^6."""
    from evaluate import paired

    assert paired([0] * 6 + [1] * 4, [1] * 10) == (0, 6, 2 / 64)
    assert paired([1, 1, 0, 0, 1], [0, 1, 1, 0, 0]) == (2, 1, 1.0)  # 2 vs 1: 2 * (1 + 3) / 8, capped
    assert paired([1, 0], [1, 0]) == (0, 0, 1.0)
    with pytest.raises(ValueError, match="not the same set"):
        paired([1, 0], [1])


def test_eval_json_keeps_the_sets_done(tmp_path, monkeypatch):
    """An eval cut short in its second set (the host gone, the disk full) leaves the first set's games
    and types on disk, in eval.partial.json, and the last whole eval.json as it was."""
    import evaluate
    import train

    class Envs:
        n = 2

        def close(self):
            pass

    played = []

    def rollout(set_envs, *args, **kwargs):
        if played:
            raise RuntimeError("cut short")
        played.append(1)
        return (
            [],
            [
                {"won": True, "task_type": "pick", "invalid": 0, "length": 3},
                {"won": False, "task_type": "heat", "invalid": 1, "length": 50},
            ],
            None,
        )

    monkeypatch.setattr(evaluate, "rollout", rollout)
    monkeypatch.setattr(
        evaluate,
        "eval_plan",
        lambda cfg: {"seen": ({"split": "seen"}, [0, 1]), "unseen": ({"split": "unseen"}, [0, 1])},
    )
    monkeypatch.setattr(evaluate, "eval_envs_for", lambda *args: Envs())
    last = json.dumps({"iteration": 6, "games": {"seen": [1, 1], "unseen": [0, 1]}, "rates": {}})
    (tmp_path / "eval.json").write_text(last)  # the eval before: whole
    with pytest.raises(RuntimeError, match="cut short"):
        evaluate.evaluate(None, train.Config(out_dir=str(tmp_path)), None, None, None, iteration=7)
    assert (tmp_path / "eval.json").read_text() == last and evaluate.complete(tmp_path)
    saved = json.load(open(tmp_path / "eval.partial.json"))
    assert (
        saved["iteration"] == 7
        and saved["games"] == {"seen": [1, 0]}
        and saved["types"] == {"seen": ["pick", "heat"]}
    )
    assert saved["rates"] == {"seen": 0.5, "seen/heat": 0.0, "seen/pick": 1.0}
    # marked cut short: bench.pair plays it again, and a comparison refuses it (unseen would drop out)
    assert saved["complete"] is False and not evaluate.complete(tmp_path / "eval.partial.json")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "eval.json").write_text(json.dumps({**saved, "complete": True}))
    with pytest.raises(ValueError, match="cut short"):
        evaluate.compare(str(tmp_path / "b"), str(tmp_path / "eval.partial.json"))
    won = {"won": True, "task_type": "pick", "invalid": 0, "length": 3}
    monkeypatch.setattr(evaluate, "rollout", lambda *args, **kwargs: ([], [won, won], None))
    evaluate.evaluate(None, train.Config(out_dir=str(tmp_path)), None, None, None, iteration=8)
    assert json.load(open(tmp_path / "eval.json"))["iteration"] == 8 and evaluate.complete(tmp_path)
    assert not (tmp_path / "eval.partial.json").exists()


def test_eval_leaves_out_games_a_dead_worker_cut_short(tmp_path, monkeypatch):
    """A game cut short by a dead env worker is no result: null in eval.json, out of every rate, and
    out of the game-by-game comparison (not a loss)."""
    import evaluate
    import train

    class Envs:
        n = 3

        def close(self):
            pass

    eps = [
        {"won": True, "task_type": "pick", "invalid": 0, "length": 3},
        {"won": False, "task_type": "pick", "invalid": 0, "length": 7, "worker_died": True},
        {"won": False, "task_type": "heat", "invalid": 0, "length": 50},
    ]
    monkeypatch.setattr(evaluate, "rollout", lambda *a, **k: ([], eps, None))
    monkeypatch.setattr(evaluate, "eval_plan", lambda cfg: {"seen": ({"split": "seen"}, [0, 1, 2])})
    monkeypatch.setattr(evaluate, "eval_envs_for", lambda *args: Envs())
    rates = evaluate.evaluate(None, train.Config(out_dir=str(tmp_path / "a")), None, None, None, iteration=1)
    assert rates == {"seen": 0.5, "seen/heat": 0.0, "seen/pick": 1.0}
    assert json.load(open(tmp_path / "a" / "eval.json"))["games"] == {"seen": [1, None, 0]}
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "eval.json").write_text(
        json.dumps({"iteration": 2, "rates": {"seen": 1 / 3}, "games": {"seen": [0, 1, 0]}})
    )
    assert evaluate.compare(str(tmp_path / "a"), str(tmp_path / "b")).splitlines()[3] == (
        "| seen | 2 | 0.500 | 0.000 | 1 | 0 | 1.000 |"
    )
    (tmp_path / "b" / "eval.json").write_text(
        json.dumps({"iteration": 2, "rates": {}, "games": {"seen": [None] * 3}})
    )
    assert evaluate.compare(str(tmp_path / "a"), str(tmp_path / "b")).splitlines()[3] == (
        "| seen | 0 | nan | nan | 0 | 0 | 1.000 |"
    )  # no game with a result in both: a row, not a crash


def test_won_group_frac_counts_groups_that_won_every_episode():
    from types import SimpleNamespace

    import numpy as np

    import records

    eps = [
        {"won": w, "group": g, "return": float(w), "length": 3}
        for g, w in [(0, True), (0, True), (1, True), (1, False), (2, False), (2, False)]
    ]
    sample = SimpleNamespace(valid=True, prompt_ids=[1, 2], response_ids=[3])
    m = records.training_metrics([sample], [], eps, 0, np.zeros(0), [])
    assert m["won_group_frac"] == pytest.approx(1 / 3) and m["success"] == pytest.approx(0.5)


def test_an_iteration_all_cut_short_stops_in_one_line(tmp_path, monkeypatch):
    """Every episode of an iteration lost to dead env workers (the disk full): a one-line stop, not
    a division by zero."""
    import train

    real = train.rollout

    def rollout(*args, **kwargs):
        samples, episodes, timing = real(*args, **kwargs)
        return samples, [{**e, "worker_died": True} for e in episodes], timing

    monkeypatch.setattr(train, "rollout", rollout)
    with pytest.raises(SystemExit, match="iteration 1: every episode was cut short by a dead env worker"):
        train.main([*SMALL_RUN, "--iterations", "2", "--out_dir", str(tmp_path)])


def test_compare_rows_per_task_type(tmp_path):
    """Evals that list each game's task type get a paired row per type under the set's row; an
    eval without types (or with other ones) gets the set's row only."""
    from evaluate import compare

    evals = {"a": {"valid": [1, 0, 0, 1, 0]}, "b": {"valid": [1, 1, 1, 0, 0]}}
    for name, games in evals.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "eval.json").write_text(
            json.dumps(
                {
                    "iteration": 1,
                    "rates": {"valid": sum(games["valid"]) / 5},
                    "games": games,
                    "types": {"valid": ["pick", "pick", "heat", "heat", "pick"]},
                }
            )
        )
    rows = compare(str(tmp_path / "a"), str(tmp_path / "b")).splitlines()[3:]
    assert rows == [
        "| valid | 5 | 0.400 | 0.600 | 1 | 2 | 1.000 |",
        "| valid/heat | 2 | 0.500 | 0.500 | 1 | 1 | 1.000 |",
        "| valid/pick | 3 | 0.333 | 0.667 | 0 | 1 | 1.000 |",
    ]
    (tmp_path / "b" / "eval.json").write_text(
        json.dumps({"iteration": 1, "rates": {"valid": 0.6}, "games": evals["b"]})
    )
    assert len(compare(str(tmp_path / "a"), str(tmp_path / "b")).splitlines()) == 4


@pytest.mark.parametrize(
    "text, words",
    [(None, "No such file"), ('{"valid_seen": 0.2}', "no games or rates"), ("{not json", "eval.json")],
)
def test_compare_bad_eval_is_one_line(tmp_path, text, words):
    if text is not None:
        (tmp_path / "eval.json").write_text(text)
    r = subprocess.run(
        [sys.executable, "-m", "evaluate", str(tmp_path), str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1 and r.stderr.startswith("error: ") and words in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_lora_end_to_end(tmp_path):
    """--lora_rank: only the adapters train; the engine gets the merged weights (its log-probs match
    the trainer's after updates), the KL reference is the model with adapters off, and the HF
    export holds merged weights under the plain model's names."""
    out = tmp_path / "lora"
    r = run_train(
        "--lora_rank",
        "4",
        "--iterations",
        "3",
        "--eval_every",
        "3",
        "--n_groups",
        "4",
        "--group_size",
        "4",
        "--eval_episodes",
        "16",
        "--kl_coef",
        "0.01",
        "--lr",
        "1e-2",
        "--out_dir",
        str(out),
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "in LoRA adapters" in r.stdout
    rows = [json.loads(l) for l in open(out / "metrics.jsonl")]
    assert rows[0]["kl_ref"] == 0 and rows[-1]["kl_ref"] > 0  # adapters moved away from the base
    assert max(m["logp_gap"] for m in rows) < 1e-3  # merged weights == LoRA forward
    from transformers import AutoModelForCausalLM

    from tiny import build_tiny

    exported = AutoModelForCausalLM.from_pretrained(out / "model").state_dict()
    base = build_tiny("treasure", seed=0)[0].state_dict()
    assert set(exported) == set(base)  # no lora_A/lora_B, HF names
    assert torch.equal(exported["model.embed_tokens.weight"], base["model.embed_tokens.weight"])  # frozen
    assert any(not torch.equal(exported[k], base[k]) for k in base if "proj" in k)  # merged updates


def test_learns_the_action_format(tmp_path):
    """Learning test that fits in CI. A fresh tiny model says one of the 4 action words ~20% of the
    time (1-token responses, 21 words); the invalid-action penalty (through the advantage and the
    clipped update) must lift that above 90% within 15 iterations. (Held-out success needs
    ~100+ iterations: README, "Results".)"""
    out = tmp_path / "learn"
    r = run_train(
        "--iterations",
        "15",
        "--n_groups",
        "8",
        "--group_size",
        "8",
        "--eval_every",
        "15",
        "--eval_episodes",
        "16",
        "--out_dir",
        str(out),
    )
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(l) for l in open(out / "metrics.jsonl")]
    assert rows[0]["valid_ratio"] < 0.4, rows[0]["valid_ratio"]
    assert min(m["valid_ratio"] for m in rows[-3:]) > 0.9, [m["valid_ratio"] for m in rows]
    assert rows[-1]["entropy"] < rows[0]["entropy"]


def test_nan_reward_is_one_line(tmp_path, monkeypatch):
    """An env that returns NaN rewards stops the run with one line naming the iteration."""
    import train
    from envs.treasure import TreasureHunt

    monkeypatch.setattr(
        TreasureHunt,
        "step",
        lambda self, a: ("at (0, 0) treasure (1, 1)", float("nan"), True, False, {"won": False}),
    )
    with pytest.raises(SystemExit, match="iteration 1: NaN/inf reward"):
        train.main(
            [
                *"--iterations 1 --n_groups 2 --group_size 2 --eval_episodes 2 --out_dir".split(),
                str(tmp_path),
            ]
        )


def test_dead_worker_episodes_are_neither_trained_on_nor_counted(tmp_path, monkeypatch):
    """Episodes a dead env worker cut short (info["worker_died"], envs/vector.py) used to count as
    failures in `success` and go into the update. Here env 0's worker "dies" at its first step and
    every other episode wins at once: success is 1.0 and no sample of env 0 is trained on."""
    import train
    from envs import GroupedEnvs
    from envs.treasure import TreasureHunt

    monkeypatch.setattr(
        TreasureHunt, "step", lambda self, a: (self._obs(), 1.0, True, False, self._info(True))
    )
    real_receive, real_update, trained = GroupedEnvs.receive, train.update, []

    def receive(self, until="all"):
        res = real_receive(self, until)
        if self.n == 4 and 0 in res:  # the training envs (the eval envs are 2 groups of 1)
            res[0] = self._truncated(0)  # what a dead worker's env returns
        return res

    def update(model, opt, sched, samples, *a, **k):
        trained.extend(s.traj for s in samples)
        return real_update(model, opt, sched, samples, *a, **k)

    monkeypatch.setattr(GroupedEnvs, "receive", receive)
    monkeypatch.setattr(train, "update", update)
    train.main(
        [
            *(
                "--iterations 1 --n_groups 2 --group_size 2 --eval_episodes 2 --engine hf --metrics all "
                "--out_dir"
            ).split(),
            str(tmp_path),
        ]
    )  # in-process envs: all
    row = json.loads(open(tmp_path / "metrics.jsonl").readline())
    assert (row["success"], row["samples"]) == (1.0, 3) and sorted(trained) == [1, 2, 3]
    assert row["worker_died"] == 1


def test_wandb_without_an_account_is_one_line_before_the_build(tmp_path):
    """--wandb 1 with no API key (and not offline) used to end in wandb's 26-line traceback after the
    model was built; now one line naming the ways on, with no metrics line written."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env["HOME"] = str(tmp_path)  # no ~/.netrc key
    out = tmp_path / "run"
    cmd = [sys.executable, "train.py", "--iterations", "1", "--wandb", "1", "--out_dir", str(out)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert last.startswith("error: --wandb 1:") and "wandb login" in last and "WANDB_MODE=offline" in last
    assert not (out / "metrics.jsonl").exists()


def test_episodes_on_disk_and_wandb_offline(tmp_path):
    """--log_groups: whole episodes in out_dir/episodes.jsonl (one training group per iteration, 8
    episodes per eval), each step with GiGPO's parts; --wandb 1 (offline) logs the metrics and, at
    each eval, a table of the recorded steps."""
    out = tmp_path / "run"
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    r = subprocess.run(
        [
            sys.executable,
            *(
                "train.py --iterations 2 --eval_every 1 --n_groups 4 --group_size 4 --eval_episodes 16 "
                "--wandb 1 --out_dir"
            ).split(),
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    import records  # the default metrics line: its ~20 keys, no opt-in one (docs/training.md, "Metrics")

    rows = [json.loads(l) for l in open(out / "metrics.jsonl")]
    assert all(set(m) == set(records.DEFAULT_METRICS) for m in rows) and len(rows[0]) <= 20
    recs = [json.loads(l) for l in open(out / "episodes.jsonl")]
    train_recs = [x for x in recs if x["split"] == "train"]
    assert [x["iteration"] for x in train_recs] == [1] * 4 + [2] * 4  # one group of 4 episodes each
    assert len({x["group"] for x in train_recs if x["iteration"] == 1}) == 1
    assert sum(x["split"] == "held-out" for x in recs) == 16  # 8 per eval, 2 evals
    for x in train_recs:
        assert x["length"] == len(x["steps"]) >= 1
        for s in x["steps"]:
            assert s["adv"] == pytest.approx(s["adv_episode"] + s["adv_step"])  # omega 1: A = A^E + A^S
            assert s["prompt"] and s["step_group_size"] >= 1 and s["anchor"].startswith("at (")
    run = next((out / "wandb").glob("offline-run-*"))
    blob = next(run.glob("run-*.wandb")).read_bytes()
    assert all(k in blob for k in (b"success", b"eval_success", b"logp_gap"))
    tables = sorted(run.glob("files/media/table/episodes_*.table.json"))
    assert len(tables) == 2
    table = json.load(open(tables[-1]))
    assert table["columns"][:3] == ["iteration", "traj", "step"] and len(table["data"]) == sum(
        x["length"] for x in train_recs if x["iteration"] == 2
    )

    # the viewer: curves + a self-contained page; a real headless browser runs its script
    import plots

    plots.main([str(out)])
    assert (out / "curves.png").stat().st_size > 10_000
    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if browser is None:
        pytest.skip("no chromium for the page check (.ci/run installs Debian's)")
    dom = subprocess.run(
        [
            browser,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--dump-dom",
            (out / "report.html").as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    body = dom[dom.index("<body") : dom.index(">", dom.index("<body"))]
    assert 'data-ready="1"' in body and "data-errors" not in body, body
    assert 'data-shown="4"' in body  # the newest training group: 4 trajectories
    assert dom.count('class="episode"') == 4 and dom.count('class="step"') == sum(
        x["length"] for x in train_recs if x["iteration"] == 2
    )


def test_gpu_memory_is_logged_only_where_cuda_was_used():
    import records
    import train

    cfg = train.Config()
    line = {k: 0.0 for k in records.DEFAULT_METRICS}
    gpu = records.metrics_line(cfg, {**line, "gpu_mem_gib": 17.2, "gpu_alloc_gib": 9.1})
    assert gpu["gpu_mem_gib"] == 17.2 and gpu["gpu_alloc_gib"] == 9.1
    cpu = records.metrics_line(cfg, {**line, "gpu_mem_gib": None, "gpu_alloc_gib": None})
    assert "gpu_mem_gib" not in cpu and "gpu_alloc_gib" not in cpu  # a CPU run


def test_viewer_bad_out_dir_is_one_line(tmp_path):
    import plots

    for bad in (tmp_path / "missing", tmp_path):  # no such dir; a dir without metrics.jsonl
        with pytest.raises(SystemExit) as e:
            plots.main([str(bad)])
        assert str(e.value.code).startswith("error: no ") and "--out_dir" in str(e.value.code)
    (tmp_path / "metrics.jsonl").write_text('{"iteration": 1, "succ')  # a line a crash cut short
    with pytest.raises(SystemExit) as e:
        plots.main([str(tmp_path)])
    assert "no complete line" in str(e.value.code)


def test_episode_log_on_resume_keeps_the_checkpointed_iterations(tmp_path):
    import records

    path = tmp_path / "episodes.jsonl"
    path.write_text('{"iteration": 1}\n{"iteration": 2}\n{"iteration": 3}\n{"iterat')
    records.EpisodeLog(str(tmp_path), 1, start=2)  # resumed from the checkpoint of iteration 2
    assert path.read_text() == '{"iteration": 1}\n{"iteration": 2}\n'
    log = records.EpisodeLog(str(tmp_path), 1)  # a new run starts afresh
    assert path.read_text() == ""
    log.write([{"iteration": 1, "x": "y" * (2 << 20)}])  # over its cap of 1 MiB: not written, one note
    assert path.read_text() == "" and log.full


# ---- the paper's baselines and verl-agent's other estimators: PPO's critic, REINFORCE++, GSPO, DAPO ----


def test_critic_reads_the_last_prompt_token_and_its_loss_falls():
    """--algo ppo's value head (ppo.Critic): V(s) is read at each sample's last prompt token (the same
    from padded rows, a packed row, and the prompt alone), and ppo.update's clipped value loss falls on
    a fixed toy batch (advantages 0: only the value loss trains; targets of mean 0, so a bias alone
    cannot fit them)."""
    import numpy as np

    import ppo
    import train
    from tiny import build_tiny

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from dist_update import fixed_batch

    cpu = torch.device("cpu")
    model, tok = build_tiny("treasure", seed=0)
    samples, _ = fixed_batch(16)
    cfg = train.Config(algo="ppo", lr=1e-2, mini_batch=16, micro_batch_tokens=64)
    critic = ppo.Critic(model.config.hidden_size, cpu, lambda head: policy.make_optimizer(cfg, head, cpu))
    assert not critic.head.weight.any()  # zero-initialised: V = 0 everywhere
    with torch.no_grad():
        torch.nn.init.normal_(critic.head.weight)  # any head, to compare the layouts
        idx = list(range(len(samples)))
        padded = ppo.score(model, ppo.make_batch(samples, idx, 0, False), cpu, critic=critic)[2]
        packed = ppo.score(model, ppo.make_batch(samples, idx, 0, True), cpu, critic=critic)[2]
        alone = torch.stack(
            [
                critic(
                    model(input_ids=torch.tensor([s.prompt_ids]), output_hidden_states=True).hidden_states[
                        -1
                    ][0, -1]
                )
                for s in samples
            ]
        )
        torch.nn.init.zeros_(critic.head.weight)
    assert torch.allclose(padded, alone, atol=1e-5) and torch.allclose(packed, alone, atol=1e-5)
    opt, sched = policy.make_optimizer(cfg, model, cpu)
    lp = dict(cfg=cfg, device=cpu, pad_id=tok.pad_token_id, packed=False)
    returns, losses = np.linspace(-1, 1, len(samples)), []
    for _ in range(25):
        old, values = ppo.logprobs(model, samples, **lp), ppo.state_values(model, critic, samples, **lp)
        upd = ppo.update(
            model,
            opt,
            sched,
            samples,
            old=old,
            ref=None,
            adv=np.zeros(len(samples)),
            critic=critic,
            targets=np.column_stack([values, returns]),
            **lp,
        )
        losses.append(upd["value_loss"])
    assert losses[0] == pytest.approx(0.5 * np.mean(returns**2))  # V = 0 at the start
    assert losses[-1] < 0.3 * losses[0], losses


def test_ppo_resume_keeps_the_value_head(tmp_path, monkeypatch):
    """--algo ppo saves the head (and its optimizer) in ckpt/extra.pt; --resume 1 starts from it, not
    from a fresh zero head."""
    import train

    out = tmp_path / "ppo"
    train.main([*SMALL_RUN, "--algo", "ppo", "--iterations", "2", "--out_dir", str(out)])
    saved = torch.load(out / "ckpt" / "extra.pt", weights_only=False)["critic"]
    assert saved["head"]["weight"].abs().sum() > 0 and saved["opt"]["state"]  # trained, Adam state kept
    seen, real = [], train.state_values

    def state_values(model, critic, samples, **kw):
        seen.append(critic.head.weight.detach().clone())
        return real(model, critic, samples, **kw)

    monkeypatch.setattr(train, "state_values", state_values)
    train.main([*SMALL_RUN, "--algo", "ppo", "--iterations", "3", "--out_dir", str(out), "--resume", "1"])
    assert len(seen) == 1 and torch.equal(seen[0], saved["head"]["weight"])
    row = json.loads(open(out / "metrics.jsonl").readlines()[-1])
    assert row["iteration"] == 3 and row["value_loss"] > 0 and 0 <= row["vf_clip_frac"] <= 1


@pytest.mark.parametrize(
    "args, overlong",
    [
        (["--algo", "reinforce_pp"], 0.0),
        (["--algo", "ppo"], 0.0),
        (["--algo", "grpo", "--loss", "gspo", "--clip", "3e-4", "--clip_high", "4e-4"], 0.0),
        (["--algo", "grpo", "--clip_high", "0.28"], 0.1),
    ],
)
def test_every_estimator_and_loss_trains(tmp_path, monkeypatch, args, overlong):
    import train

    monkeypatch.setattr(train, "OVERLONG_PENALTY", overlong)  # DAPO's overlong penalty, with clip-higher
    train.main([*SMALL_RUN, *args, "--iterations", "1", "--metrics", "all", "--out_dir", str(tmp_path)])
    row = json.loads(open(tmp_path / "metrics.jsonl").readline())
    assert row["optimizer_steps"] >= 1 and row["dropped_groups"] == 0 and row["adv_abs"] > 0


@pytest.mark.parametrize("tied_step, omega", [("1", 1.0), ("0", 1.0), ("1", 0.5)])
def test_logged_parts_are_those_the_update_saw(tmp_path, monkeypatch, tied_step, omega):
    """OVERLONG_PENALTY (DAPO) shapes the rewards before the advantages: the logged parts of each step
    (episodes.jsonl) come from the same rewards, so A = A^E + omega A^S still holds there (also under
    the --tied_step 0 ablation); adv_step is the paper's A^S, before the weight omega."""
    import train

    monkeypatch.setattr(train, "OVERLONG_PENALTY", 0.5)
    monkeypatch.setattr(train, "OMEGA", omega)
    train.main(
        [
            *SMALL_RUN,
            "--log_groups",
            "2",
            "--iterations",
            "1",
            "--tied_step",
            tied_step,
            "--out_dir",
            str(tmp_path),
        ]
    )
    steps = [
        s
        for line in open(tmp_path / "episodes.jsonl")
        for s in json.loads(line)["steps"]
        if json.loads(line)["split"] == "train"
    ]
    assert steps and all(s["adv"] == pytest.approx(s["adv_episode"] + omega * s["adv_step"]) for s in steps)
    assert any(abs(s["adv_step"]) > 1e-6 for s in steps)  # the step term is really there to weigh
    last = [
        json.loads(line)["steps"][-1]
        for line in open(tmp_path / "episodes.jsonl")
        if json.loads(line)["split"] == "train"
    ]  # 1-token replies never end on EOS: every one is cut
    assert all(s["step_return"] == pytest.approx(s["reward"] - 0.5 - 0.1 * (not s["valid"])) for s in last)


@pytest.mark.parametrize("algo", ["grpo", "gigpo"])
def test_dynamic_sampling_keeps_an_all_won_group_only_for_gigpo(algo):
    """Group 0: both walks win, in 1 and in 2 steps from the shared start s0, so the scores tie (A^E =
    0) but A^S ranks the two visits of s0; group 1: both lose. --dynamic_sampling 1 drops group 1
    always, group 0 only where its advantages are all 0 (GRPO)."""
    import numpy as np

    import train
    from rollout import Sample

    walks = [
        (0, 0, [("s0", 1.0)]),
        (0, 1, [("s0", 0.0), ("s1", 1.0)]),
        (1, 2, [("t0", 0.0)]),
        (1, 3, [("t0", 0.0)]),
    ]
    samples = [
        Sample([1], [2], [0.0], r, k == len(w) - 1, True, g, t, a, k)
        for g, t, w in walks
        for k, (a, r) in enumerate(w)
    ]
    cfg = train.Config(algo=algo, dynamic_sampling=True)
    _, _, keep, stats = train.advantages(cfg, samples, 1, 0)
    assert keep.tolist() == ([0, 1, 2] if algo == "gigpo" else [])
    assert stats["dropped_groups"] == (1 if algo == "gigpo" else 2)
    import records

    for tied_step in (True, False):  # the logged parts add up to the trained advantage, ablation or not
        cfg = train.Config(algo=algo, tied_step=tied_step)
        out = train.advantages(cfg, samples, 1, 0)[0]
        adv, parts = (
            out["adv"],
            records.advantage_parts(out, range(len(samples))),
        )  # what episodes.jsonl shows
        np.testing.assert_allclose(adv, parts["adv_episode"] + parts["adv_step"], atol=1e-9)
        assert (np.abs(adv[:3]).max() > 0) == (
            algo == "gigpo" and tied_step
        )  # group 0: A^S (+-0.025) or nothing


@pytest.mark.parametrize("algo", ["ppo", "reinforce_pp"])
def test_dynamic_sampling_keeps_tied_groups_of_the_batch_estimators(algo):
    """ppo and reinforce_pp have no group baseline: a group whose scores tie (both walks won, both
    lost) still gets non-zero advantages (discounted returns or GAE, whitened over the batch), so
    --dynamic_sampling 1 must keep it; it drops a group only where its advantages are all 0."""
    import numpy as np

    import train
    from rollout import Sample

    walks = [
        (0, 0, [("s0", 1.0)]),
        (0, 1, [("s0", 0.0), ("s1", 1.0)]),
        (1, 2, [("t0", 0.0)]),
        (1, 3, [("t0", 0.0)]),
    ]
    samples = [
        Sample([1], [2], [0.0], r, k == len(w) - 1, True, g, t, a, k)
        for g, t, w in walks
        for k, (a, r) in enumerate(w)
    ]
    values = np.array([0.5, 0.2, 0.6, 0.1, 0.3]) if algo == "ppo" else None
    out = train.advantages(train.Config(algo=algo, dynamic_sampling=True), samples, 1, 0, values)
    keep, stats = out[2], out[3]
    assert keep.tolist() == [0, 1, 2, 3, 4] and stats["dropped_groups"] == 0
    assert stats["zero_var_group_frac"] == 1.0  # both groups' scores do tie


def test_dynamic_sampling_trains_on_the_groups_whose_scores_differ(tmp_path, monkeypatch):
    """--dynamic_sampling 1 (DAPO): the update sees exactly the samples of the groups whose episode
    scores differ, dropped_groups counts the others; when every group ties nothing trains (the weights
    stay the initial ones) and the run goes on."""
    import numpy as np

    import gigpo
    import train

    seen, real_adv, real_update = [], train.advantages, train.update

    def advantages(cfg, samples, *a, **k):
        out = real_adv(cfg, samples, *a, **k)
        scores = gigpo.episode_scores(
            [s.reward for s in samples], [s.traj for s in samples], [s.valid for s in samples], train.PENALTY
        )
        by_group = {}
        for s, x in zip(samples, scores):
            by_group.setdefault(s.group, set()).add(x)
        seen.append(
            {
                "kept": {s.traj for s in samples if len(by_group[s.group]) > 1},
                "tied": sum(len(v) == 1 for v in by_group.values()),
            }
        )
        return out

    def update(model, opt, sched, samples, *a, **k):
        seen[-1]["trained"] = {s.traj for s in samples}
        return real_update(model, opt, sched, samples, *a, **k)

    monkeypatch.setattr(train, "advantages", advantages)
    monkeypatch.setattr(train, "update", update)
    args = [
        *SMALL_RUN,
        *(
            "--n_groups 8 --algo grpo --dynamic_sampling 1 --env_args progress=0,max_steps=2 --iterations 3"
        ).split(),
    ]
    train.main([*args, "--out_dir", str(tmp_path / "some")])
    rows = [json.loads(line) for line in open(tmp_path / "some" / "metrics.jsonl")]
    assert [r["dropped_groups"] for r in rows] == [x["tied"] for x in seen]
    assert all(x["trained"] == x["kept"] for x in seen) and sum(x["tied"] for x in seen) > 0
    monkeypatch.setattr(train, "silent_groups", lambda adv, *a: np.ones(len(adv), dtype=bool))
    train.main([*args, "--iterations", "1", "--out_dir", str(tmp_path / "none")])
    row = json.loads(open(tmp_path / "none" / "metrics.jsonl").readline())
    assert row["dropped_groups"] == 8 and row["samples"] > 0 and row["logp_gap"] == 0
    from transformers import AutoModelForCausalLM

    from tiny import build_tiny

    init = build_tiny("treasure", seed=0)[0].state_dict()
    after = AutoModelForCausalLM.from_pretrained(tmp_path / "none" / "model").state_dict()
    assert all(torch.equal(after[k], init[k]) for k in init)


def bench_iteration(tmp_path, flags):
    """python -m bench.iteration with the tiny model on the treasure hunt -> (its run, its JSON line)."""
    small = "--shape tiny --env treasure --engine hf --n_groups 2 --group_size 2 --max_response_tokens 8"
    out = tmp_path / "it.json"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.iteration",
            *f"{small} {flags}".split(),
            "--out",
            str(tmp_path),
            "--json",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    return r, json.loads(out.read_text())


def test_bench_iteration_reports_every_iteration_and_the_last_as_steady_state(tmp_path):
    """bench.iteration (the GPU's headline timing) runs train.py for --iterations and reports each
    one, with the old and the KL reference's log-prob passes apart; the JSON's top level is the last
    iteration, the steady state a long run repeats."""
    r, res = bench_iteration(tmp_path, "--env_workers 0 --iterations 2 --kl_coef 0.01")
    its = res["per_iteration"]
    assert len(its) == 2 and res["time_iteration"] == its[-1]["time_iteration"]
    for m in its:
        assert 0 < m["time_ref_logprobs"] < m["time_logprobs"] < m["time_update"] < m["time_iteration"]
        assert m["samples"] > 0 and m["response_tokens"] <= 8
    assert "steady state (iteration 2)" in r.stdout and "| 1 |" in r.stdout and "| 2 |" in r.stdout
    assert re.search(r"the env wait: \d+%", r.stdout), r.stdout[-500:]
    assert "--iterations 2" in r.stdout  # the train.py command it timed


def test_bench_iteration_warmup_turns_cut_only_the_first_iterations_episodes(tmp_path):
    """--warmup_turns 1: iteration 1 (compile's warm-up) plays one step an episode, iteration 2 whole
    episodes, so a steady state is timed without a whole first iteration; a negative one is one line."""
    r, res = bench_iteration(tmp_path, "--env_workers 0 --iterations 2 --warmup_turns 1")
    first, second = res["per_iteration"]
    assert first["episode_length"] == 1 and second["episode_length"] > 1
    assert first["samples"] == 4 and second["samples"] > 4  # 2 groups x 2 envs, one step each
    bad = subprocess.run(
        [sys.executable, "-m", "bench.iteration", "--warmup_turns", "-1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert (
        bad.returncode == 1
        and bad.stderr.strip() == "error: --warmup_turns -1: give 0 (off) or a number of steps"
    )
