"""The code's style, as the repo's linter sees it: `ruff format --check .` and `ruff check .` (the rules in
pyproject.toml: line length 110, pycodestyle, pyflakes, import order)."""

import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUFF = shutil.which("ruff")


@pytest.mark.skipif(RUFF is None, reason="ruff is not installed (requirements.txt)")
@pytest.mark.parametrize("command", [["format", "--check", "."], ["check", "."]])
def test_ruff_passes(command):
    r = subprocess.run([RUFF, *command], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-1000:]
