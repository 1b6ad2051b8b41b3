"""In-process vs isolated engine, side by side: start time, per-call overhead, memory.

    python benchmarks/engines.py [--model PATH] [--repeats 5] [--out FILE]

Each engine kind runs in a fresh Python process (the same way a notebook kernel would meet it),
one after the other, on the same model (the embedded toy model unless ``--model``):

- ``start``: seconds from ``nv.load(...)`` to a usable model (nnvllm, torch already imported; vLLM's
  own imports are part of it, as they are for a user).
- ``first call``: the first ``nv.generate`` after start (warm-up lands here).
- ``generate 1x1``: one prompt, one token, nothing captured: the fixed cost of a call.
- ``generate 16x16 all layers``: 16 prompts x 16 tokens with every block's residual and the
  logits: what travels back grows with the capture.
- ``trace 10 tokens``: ``with model.trace(prompt, max_tokens=10)`` saving the logits at each step
  (nnsight's path; isolated, through the serve protocol over one kept-alive HTTP connection).
- ``engine RSS``: resident memory of the engine's process tree while loaded (in-process: this process).
- ``RSS after close``: this process and its children after ``close()``.

Prints medians of ``--repeats`` calls and the ratio isolated / in-process, and records them as the
run named after the model (``toy`` by default) in ``benchmarks/results/engines_<machine>.json`` (or
``--out``), with the command, commit, vLLM version and date (``benchmarks/provenance.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from provenance import provenance, record


def _one(kind: str, model_path: str | None, repeats: int) -> dict:
    import gc

    import psutil

    import nnvllm as nv

    def tree_rss() -> float:
        me = psutil.Process()
        return sum(p.memory_info().rss for p in [me, *me.children(recursive=True)]) / 2**20

    out: dict = {}
    t = time.perf_counter()
    model = nv.load(model_path, isolate=(kind == "isolated"), dtype="float32")
    out["start"] = time.perf_counter() - t
    t = time.perf_counter()
    nv.generate(model, "The capital of France is", max_tokens=1, layers=None)
    out["first call"] = time.perf_counter() - t

    prompts = [f"The capital of France is {i}" for i in range(16)]

    def trace():
        with model.trace("The capital of France is", temperature=0.0, max_tokens=10, ignore_eos=True) as tr:
            for _ in tr.iter[:10]:
                lg = model.logits.save()  # every step's, the last one kept
        return lg

    calls = {
        "generate 1x1": lambda: nv.generate(model, "The capital of France is", max_tokens=1, layers=None),
        "generate 16x16 all layers": lambda: nv.generate(model, prompts, max_tokens=16, ignore_eos=True),
        "trace 10 tokens": trace,
    }
    for name, fn in calls.items():
        fn()  # warm-up
        ts = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        out[name] = statistics.median(ts)
    out["engine RSS (MiB)"] = next(e.rss_mib for e in nv.engines())
    model.close()
    model = None
    gc.collect()
    time.sleep(0.5)
    out["RSS after close (MiB)"] = tree_rss()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the embedded toy model)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None, help="result file (default benchmarks/results/engines_<machine>.json)")
    ap.add_argument("--kind", choices=["in-process", "isolated"], help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.kind:  # a worker: one engine kind in this fresh process
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        print("RESULT " + json.dumps(_one(args.kind, args.model, args.repeats)), flush=True)
        return

    prov = provenance()
    res = {}
    for kind in ("in-process", "isolated"):
        cmd = [sys.executable, __file__, "--kind", kind, "--repeats", str(args.repeats)]
        if args.model:
            cmd += ["--model", args.model]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode or not lines:
            sys.exit(f"{kind} run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        res[kind] = json.loads(lines[-1][len("RESULT "):])

    import torch

    print(f"engines on {'GPU' if torch.cuda.is_available() else f'CPU ({os.cpu_count()} cores)'}, "
          f"model {args.model or 'toy'}, medians of {args.repeats}")
    print(f"{'':28s}{'in-process':>12s}{'isolated':>12s}{'ratio':>8s}")
    for key in res["in-process"]:
        a, b = res["in-process"][key], res["isolated"][key]
        unit = "" if "MiB" in key else " s"
        fmt = "{:>10.0f}" if "MiB" in key else "{:>10.3f}"
        print(f"{key:28s}{fmt.format(a)}{unit:2s}{fmt.format(b)}{unit:2s}{b / a:>7.2f}x")
    name = Path(args.model).name if args.model else "toy"
    path = record("engines", name, {"repeats": args.repeats, **res}, args.out, prov)
    print(f"recorded as run {name!r} in {path}")


if __name__ == "__main__":
    main()
