"""The lint rules that find bugs (pyproject.toml's ``[tool.ruff.lint]``: undefined names, closures over
loop variables, ...) pass over the package, the tests, the benchmarks, the scripts and the notebooks."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing():
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "nnvllm", "tests", "benchmarks",
                        "scripts", "notebooks"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, f"ruff check (make setup installs it):\n{r.stdout}{r.stderr}"
