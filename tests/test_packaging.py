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


def test_notebooks_are_committed_without_outputs():
    """Run All must not dirty git: notebooks are kept with no outputs, execution counts or widget
    state (nbstripout strips them; `make setup` installs its git filter, named in .gitattributes)."""
    import json

    notebooks = sorted((ROOT / "notebooks").glob("*.ipynb"))
    assert notebooks, "no notebooks found under notebooks/"
    dirty = {}
    for path in notebooks:
        nb = json.loads(path.read_text())
        found = [f"cell {i}: {k}" for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code"
                 for k, bad in (("outputs", c.get("outputs")), ("execution_count", c.get("execution_count") is not None),
                                ("execution metadata", "execution" in c.get("metadata", {}))) if bad]
        if "widgets" in nb.get("metadata", {}):
            found.append("widget state in the notebook's metadata")
        if found:
            dirty[path.name] = found
    assert not dirty, (f"notebooks with outputs: {dirty}; strip them with `.venv/bin/nbstripout notebooks/*.ipynb` "
                       "(`make setup` installs the git filter that does it on `git add`)")


def test_the_nbstripout_filter_is_what_setup_installs():
    """.gitattributes names the filter `nbstripout --install --attributes .gitattributes` writes (so
    installing it changes no tracked file), and nbstripout is a dev dependency."""
    lines = {ln.strip() for ln in (ROOT / ".gitattributes").read_text().splitlines() if not ln.startswith("#")}
    assert {"*.ipynb filter=nbstripout", "*.ipynb diff=ipynb"} <= lines
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert "nbstripout" in {_name(r) for r in extras["dev"]}
    assert "nbstripout --install --attributes .gitattributes" in (ROOT / "Makefile").read_text()


def test_python_m_nnvllm_toy_prints_no_runpy_warning():
    """`python -m nnvllm.toy --check` (make setup runs it): the package imports nnvllm.toy lazily, so
    runpy finds no half-imported module to warn about, and `nv.toy` is still there."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-W", "default", "-m", "nnvllm.toy", "--check"], capture_output=True,
                         text=True, check=True, cwd=ROOT)
    assert "toy model ok:" in out.stdout and "RuntimeWarning" not in out.stderr, out.stderr
    code = "import sys, nnvllm as nv; assert 'nnvllm.toy' not in sys.modules; assert nv.toy.path(); print('ok')"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "ok\n"


_PORT_TAKEN = '''
import socket
from jupyter_client.provisioning import local_provisioner

taken = socket.socket()
taken.bind(("127.0.0.1", 0))
taken.listen(1)
first = [True]
pick = local_provisioner.LocalPortCache.find_available_port


def find_available_port(self, ip):  # the first kernel's first port is one another process holds
    if first[0]:
        first[0] = False
        return taken.getsockname()[1]
    return pick(self, ip)


local_provisioner.LocalPortCache.find_available_port = find_available_port
'''


def test_a_notebook_whose_kernel_loses_a_port_runs_in_a_new_kernel(tmp_path):
    """tests/notebook_kernels.py: when another process takes a port jupyter_client picked for the kernel
    before the kernel binds it (the kernel dies before it answers), nbmake's run gets a new kernel and
    the notebook passes; without it the same run fails."""
    import os
    import subprocess
    import sys

    import nbformat

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("assert 6 * 7 == 42")])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, tmp_path / "probe.ipynb")
    (tmp_path / "port_taken.py").write_text(_PORT_TAKEN)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "port_taken", "-p", "no:cacheprovider", "-n", "0",
           "--nbmake", "probe.ipynb"]
    # The interpreter's own PYTHONPATH stays behind these two: where the packages live there (the GPU
    # bundle's site folder), the run needs it to import pytest's plugins.
    path = [str(tmp_path), str(ROOT / "tests"), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    bare = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert bare.returncode == 1 and "1 failed" in bare.stdout, (bare.stdout + bare.stderr)[-2000:]
    kept = subprocess.run([*cmd, "-p", "notebook_kernels"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=240)
    assert kept.returncode == 0 and "1 passed" in kept.stdout, (kept.stdout + kept.stderr)[-2000:]
    assert "running the notebook in a new kernel" in kept.stdout
