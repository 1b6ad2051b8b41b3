"""Where the time of a big ``nv.collect`` goes: cProfile of the notebook process, per-chunk wall times.

    python benchmarks/profile_collect.py --shape llama1b --prompts 1024 --tokens 128 --budget 8GB
    python benchmarks/profile_collect.py --saes 16384 --budget 4GB     (a feature dataset, as sae_gpu.py --collect)

Records the wall times, the per-chunk timings and the 40 costliest functions by cumulative and by own
time (``profile``, one line each; cProfile sees the main thread only, the shard writers run in
threads) as the run ``<shape> <prompts>x<tokens>`` of ``benchmarks/results/profile_collect_<machine>.json``
(or ``--out``), with the command, commit, vLLM version and date (``benchmarks/provenance.py``). Shards are written while the next chunk generates, so a chunk's
``generate`` and ``write_shard`` overlap. On a GPU this also needs the engine's
side: the worker timings of each chunk are in ``nnvllm.capture._LAST_TIMINGS`` after each generate.

``--saes D_SAE`` collects what ``sae_gpu.py --collect`` does: no activations and no logits, the top
``--k`` features of a random standard SAE (``sae_gpu.random_saes``, ``--sae-dtype``) on every layer's
residual stream; its run is named ``<shape> <prompts>x<tokens> saes<D_SAE>``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from capture_gpu import build, prompts
from provenance import provenance, record


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama1b")
    ap.add_argument("--prompts", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--budget", default="8GB")
    ap.add_argument("--root", default="/tmp/nnvllm-prof")
    ap.add_argument("--logits", default="chosen")
    ap.add_argument("--saes", type=int, default=0, help="features of an SAE this wide on every layer, no activations")
    ap.add_argument("--k", type=int, default=32)
    ap.add_argument("--sae-dtype", default="float32")
    ap.add_argument("--out", default=None, help="result file (default benchmarks/results/profile_collect_<machine>.json)")
    args = ap.parse_args()
    prov = provenance()
    import torch

    import nnvllm as nv
    from nnvllm import capture, store
    from vllm import SamplingParams

    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    path = build(args.shape, root)
    what: dict = {"logits": args.logits}
    if args.saes:
        from capture_gpu import SHAPES
        from sae_gpu import random_saes

        shape = SHAPES[args.shape]
        folders = random_saes(root, shape["layers"], shape["d"], args.saes, args.sae_dtype)
        what = {"logits": "none", "layers": None, "saes": [nv.SAE.load(f) for f in folders], "sae_k": args.k}
    ps = prompts(args.prompts)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    kw = {"gpu_memory_utilization": 0.6, "cuda_graphs": True} if dev == "cuda" else {"max_model_len": 512}
    model = nv.load(path, isolate=False, dtype="float16" if dev == "cuda" else "float32", **kw)
    sp = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    model.llm.generate(ps[:64], sp, use_tqdm=False)
    t = time.perf_counter()
    model.llm.generate(ps, sp, use_tqdm=False)
    bare = time.perf_counter() - t
    chunks = []
    real_gen, real_write = capture.generate, store.write_shard

    def gen(*a, **k):
        t0 = time.perf_counter()
        r = real_gen(*a, **k)
        chunks.append({"generate": time.perf_counter() - t0, "n": len(r), "worker": dict(capture._LAST_TIMINGS)})
        return r

    def write(run, path, *a, **k):  # in a writer thread, while the next chunk generates
        t0 = time.perf_counter()
        r = real_write(run, path, *a, **k)
        c = chunks[int(Path(path).stem.split("-")[1])]  # shard k is the k-th chunk (a fresh dataset)
        c["write_shard"] = time.perf_counter() - t0
        c["bytes"] = r["bytes"]
        return r

    capture.generate, store.write_shard = gen, write
    d = root / "collect"
    shutil.rmtree(d, ignore_errors=True)
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    nv.collect(model, ps, d, max_tokens=args.tokens, ignore_eos=True, memory_budget=args.budget,
               progress=False, **what)
    prof.disable()
    dt = time.perf_counter() - t
    s = io.StringIO()
    st = pstats.Stats(prof, stream=s)
    st.sort_stats("cumulative").print_stats(40)
    st.sort_stats("tottime").print_stats(40)
    res = {"args": vars(args), "bare": bare, "collect": dt, "ratio": dt / bare, "chunks": chunks,
           "bytes": sum(f.stat().st_size for f in d.iterdir()), "profile": s.getvalue().splitlines()}
    name = f"{args.shape} {args.prompts}x{args.tokens}" + (f" saes{args.saes}" if args.saes else "")
    path = record("profile_collect", name, res, args.out, prov)
    print(json.dumps({k: v for k, v in res.items() if k not in ("chunks", "profile")}), flush=True)
    print(f"recorded as run {name!r} in {path}")
    shutil.rmtree(d, ignore_errors=True)
    model.close()


if __name__ == "__main__":
    main()
