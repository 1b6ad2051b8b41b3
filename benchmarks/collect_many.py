"""Throughput of one dataset collected by two engines against one engine, measured side by side.

    python benchmarks/collect_many.py                      # toy model, 2 isolated CPU engines, 2048 x 16
    python benchmarks/collect_many.py --prompts 512 --tokens 32 --reps 3

Starts two isolated engines of the toy model (on CPU each bound to a core of its own,
``VLLM_CPU_OMP_THREADS_BIND``), warms both, then alternates, ``--reps`` times: ``nv.collect(a, ...)``
(one engine) and ``nv.collect([a, b], ...)`` (the same prompts shared out, nnvllm.distributed), each
into a fresh directory, and checks the two datasets hold the same tokens. Prints and records
(``benchmarks/results/collect_many_<machine>.json``, run ``toy <prompts>x<tokens>``, with command,
commit, vLLM version and date: ``benchmarks/provenance.py``) the median wall time of each and their
ratio, requests per second, the CPU seconds of each case (this process and the engines' processes)
with the ratio they bound (cores / the cores one engine's collect keeps busy), and the machine's load
average before and after (the 2-core CPU box is shared: other processes take cores from both cases
alike, which is why they alternate).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from provenance import provenance, record

WORDS = ["the", "cat", "sat", "on", "a", "mat", "while", "the", "dog", "ran", "to", "Paris", "and", "Rome", "is",
         "a", "city", "in", "Italy", "where", "people", "live", "once", "upon", "a", "time", "there", "was",
         "a", "capital", "of", "France"]


def prompts(n: int) -> list[str]:
    """``n`` distinct prompts of 4-11 words from the toy model's vocabulary (deterministic)."""
    return [" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(4 + i % 8)) + f" {i % 10}"
            for i in range(n)]


def load_bound(core: int | None):
    """An isolated engine of the toy model; on CPU its OpenMP threads bound to ``core``."""
    import nnvllm as nv

    key = "VLLM_CPU_OMP_THREADS_BIND"
    old = os.environ.get(key)
    if core is not None:
        os.environ[key] = str(core)  # read by the engine's process when it starts
    try:
        return nv.load(isolate=True)
    finally:
        if core is not None:
            os.environ.pop(key) if old is None else os.environ.__setitem__(key, old)


def cpu_seconds() -> float:
    """CPU seconds (user + system) of this process and every process below it (the engines)."""
    import psutil

    me = psutil.Process()
    total = sum(me.cpu_times()[:2])
    for p in me.children(recursive=True):
        try:
            total += sum(p.cpu_times()[:2])
        except psutil.Error:  # ended meanwhile
            pass
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # 2,048 prompts: two engines get chunks of 512 and their steps run batches as full as one engine's
    # (vLLM's CPU engine steps at most 256 requests). With 512 prompts the chunks hold 128 and every
    # engine step runs half the batch: twice the steps, each with its fixed cost.
    ap.add_argument("--prompts", type=int, default=2048)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=None, help="prompts per chunk (default: from the budget)")
    ap.add_argument("--out", default=None, help="result file (default benchmarks/results/collect_many_<machine>.json)")
    args = ap.parse_args()
    prov = provenance()
    import torch

    import nnvllm as nv
    from nnvllm import store

    on_cpu = not torch.cuda.is_available()
    ps = prompts(args.prompts)
    kw = {"max_tokens": args.tokens, "layers": "all", "ignore_eos": True, "progress": False,
          "batch_size": args.batch_size}
    root = Path(tempfile.mkdtemp(prefix="nnvllm-collect-many-"))
    load_before = os.getloadavg()
    t = time.perf_counter()
    a = load_bound(0 if on_cpu else None)
    b = load_bound(1 if on_cpu and (os.cpu_count() or 1) > 1 else None)
    start = time.perf_counter() - t
    times: dict[str, list[float]] = {"one": [], "two": []}
    cpu: dict[str, list[float]] = {"one": [], "two": []}  # CPU seconds of this process and the engines'
    try:
        nv.collect(a, ps[:64], root / "warm-a", **kw)
        nv.collect(b, ps[:64], root / "warm-b", **kw)
        for rep in range(args.reps):
            for case, engines in (("one", a), ("two", [a, b])):
                d = root / f"{case}-{rep}"
                c, t = cpu_seconds(), time.perf_counter()
                ds = nv.collect(engines, ps, d, **kw)
                times[case].append(time.perf_counter() - t)
                cpu[case].append(cpu_seconds() - c)
                assert ds.complete
            one, two = store.open(root / f"one-{rep}"), store.open(root / f"two-{rep}")
            same = all(one[i].tokens == two[i].tokens for i in range(len(ps)))
            assert same, "the fanned-out dataset's tokens differ from one engine's"
            shards = {e["engine"] for e in two._index["shards"]}
            print(f"rep {rep}: one engine {times['one'][-1]:.2f} s, two engines {times['two'][-1]:.2f} s "
                  f"({len(two._index['shards'])} shards by {len(shards)} engines)", flush=True)
            shutil.rmtree(root / f"one-{rep}")
            shutil.rmtree(root / f"two-{rep}")
    finally:
        a.close()
        b.close()
        shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    cpu_med = {k: statistics.median(v) for k, v in cpu.items()}
    # One engine's collect keeps this many cores busy (its engine, its server, this process); two
    # engines can be at most (cores / that) times faster where the cores are what runs out.
    cores_one = cpu_med["one"] / med["one"]
    res = {"args": vars(args), "engines": "2 isolated, toy model" + (", one core each" if on_cpu else ""),
           "start_s": start, "times_s": times, "median_s": med,
           "requests_per_s": {k: args.prompts / v for k, v in med.items()},
           "ratio_two_over_one": med["one"] / med["two"],
           "cpu_s": cpu, "median_cpu_s": cpu_med, "cores_busy_one": cores_one,
           "ratio_bound_by_cores": (os.cpu_count() or 1) / cores_one,
           "loadavg_before": load_before, "loadavg_after": os.getloadavg(), "cpus": os.cpu_count()}
    name = f"toy {args.prompts}x{args.tokens}"
    path = record("collect_many", name, res, args.out, prov)
    print(json.dumps({k: res[k] for k in ("median_s", "requests_per_s", "ratio_two_over_one", "median_cpu_s",
                                          "ratio_bound_by_cores", "loadavg_before", "loadavg_after")}), flush=True)
    print(f"recorded as run {name!r} in {path}")


if __name__ == "__main__":
    main()
