"""environment.yml (conda) and pyproject.toml describe the same environment: no drift."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _name(req: str) -> str:
    return re.split(r"[<>=!~\[ ;]", req.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _pins(reqs) -> dict[str, str]:
    return {_name(r): r.strip().replace(" ", "") for r in reqs}


def test_environment_yml_matches_pyproject():
    py = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = py["optional-dependencies"]
    want = _pins(py["dependencies"] + extras["cpu"] + extras["notebooks"] + extras["docs"] + extras["dev"])
    text = (ROOT / "environment.yml").read_text().split("- pip:", 1)[1]  # the pip section
    got = _pins(m.group(1) for m in re.finditer(r"^\s+- (?!-)([^#\n]+?)\s*$", text, re.M)
                if not m.group(1).startswith(("python=", "pip", "-e")))
    assert set(want) == set(got), f"only in pyproject: {set(want) - set(got)}; only in environment.yml: {set(got) - set(want)}"
    for name, spec in want.items():
        assert got[name] == spec, f"{name}: pyproject says {spec!r}, environment.yml says {got[name]!r}"


def test_toy_model_is_package_data():
    py = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "toy_model/*" in py["tool"]["setuptools"]["package-data"]["nnvllm"]


def test_environment_yml_names_the_gpu_pin():
    """The CUDA recipe in environment.yml's header is the `gpu` extra, character for character."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (gpu,) = extras["gpu"]
    assert gpu.startswith("vllm>=") and "<" in gpu, f"the gpu extra should pin a range, got {gpu!r}"
    header = (ROOT / "environment.yml").read_text().split("name:", 1)[0]
    assert gpu in header, f"environment.yml's header should name {gpu!r} for CUDA machines"
