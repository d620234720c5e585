import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
torch.set_num_threads(2)
# a train.py run of a few seconds: 2 x 2 envs, the transformers engine, an eval of 2 at every iteration
SMALL_RUN = "--n_groups 2 --group_size 2 --eval_episodes 2 --engine hf --eval_every 1 --mini_batch 8".split()


@pytest.fixture(scope="module")
def done_run(request, tmp_path_factory):
    """A finished 2-iteration run with the test module's ARGS, checkpointed at both; tests work on copies."""
    import train

    out = tmp_path_factory.mktemp("done") / "run"
    train.main([*request.module.ARGS, "--iterations", "2", "--out_dir", str(out)])
    return out


@pytest.fixture
def run(done_run, tmp_path):
    """A copy of done_run, the test's own."""
    shutil.copytree(done_run, tmp_path / "run")
    return tmp_path / "run"


def iterations(out):
    """The iteration of each line of a run's metrics.jsonl."""
    return [json.loads(line)["iteration"] for line in open(out / "metrics.jsonl")]


@pytest.fixture(scope="session")
def tiny_model():
    from tiny import build_tiny

    model, tok = build_tiny("treasure", seed=0)
    return model.eval(), tok


@pytest.fixture
def train_tiny(tmp_path):
    """run(env, env_args, max_tokens): `train.py --model tiny`, one iteration of 2 x 2 envs and an
    eval of 4 episodes, on the hf engine and one thread -> (its last stdout line, last metrics row)."""

    def run(env, env_args, max_tokens):
        out = tmp_path / "run"
        r = subprocess.run(
            [
                sys.executable,
                "train.py",
                "--env",
                env,
                "--model",
                "tiny",
                "--env_args",
                env_args,
                *(
                    "--n_groups 2 --group_size 2 --iterations 1 --eval_every 1 --eval_episodes 4 "
                    "--max_response_tokens"
                ).split(),
                str(max_tokens),
                *"--memory none --mini_batch 16 --engine hf --threads 1 --out_dir".split(),
                str(out),
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.returncode == 0, r.stderr[-3000:]
        return r.stdout.strip().splitlines()[-1], json.loads(
            (out / "metrics.jsonl").read_text().splitlines()[-1]
        )

    return run
