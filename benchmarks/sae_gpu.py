"""What SAE features cost inside the engine, against bare generate, on the Llama-1B shape.

    python benchmarks/sae_gpu.py                      # 64 x 128, a 16k-feature SAE on each of 16 layers, top-32
    python benchmarks/sae_gpu.py --sae-dtype bfloat16 --prompts 64 --tokens 128 --d-sae 16384 --k 32

One in-process engine with CUDA graphs (``nv.load(path, cuda_graphs=True)``), random fp16 weights
(``capture_gpu.build``), greedy, ``ignore_eos``, prompts of 16 tokens; random standard (ReLU) SAEs
saved in sae-lens's layout. Each case: a warm-up on the full batch, then the median of ``--repeats``
rounds in which every case runs once, in turn:

- ``engine_bare``: the engine's own ``model.llm.generate`` (nothing captured);
- ``tokens``: ``nv.generate(..., layers=None, logits=False)`` (tokens and samples only);
- ``features``: the same with ``saes=[one per layer]``, ``sae_k=k``: per position the top-k ids and
  activations and the reconstruction error of every layer;
- ``features_per_step``: the same with ``NNVLLM_SAE_BLOCK_ROWS=0``: each step's rows encoded as they
  come instead of a block of steps at a time (the default; the two agree to the rounding of the
  matmul's row count: ``check``);
- ``resid``: ``nv.generate(..., layers="all", logits=False)``: every layer's residual stream (the dense
  capture the features replace).
- with ``--collect N``: ``collect_bare``, the engine's own generate of N prompts (one timed run), and
  ``collect``, ``nv.collect`` of the same N prompts to disk keeping only the SAEs' top-k features
  (``layers=None, logits="none", saes=..., sae_k=k``, one timed run), with the bytes it wrote.

``bare_graphs`` (vLLM's defaults: torch.compile + CUDA graphs, nothing captured) runs first in a
process of its own (``capture_gpu.py --case bare_graphs``). Bytes handed to the client are counted
from the Runs. Recorded in ``benchmarks/results/sae_gpu_<machine>.json`` (``benchmarks/provenance.py``).
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
from capture_gpu import PROMPT_LEN, SHAPES, _timed, build, prompts
from provenance import provenance, record


def random_saes(root: Path, layers: int, d: int, d_sae: int, dtype: str) -> list[str]:
    """One random standard SAE per layer, saved in sae-lens's layout (folders under ``root``)."""
    import torch

    from nnvllm.sae import SAE

    out = []
    g = torch.Generator().manual_seed(0)
    for j in range(layers):
        folder = root / f"sae_{d_sae}_{dtype}_{j}"
        if not (folder / "cfg.json").is_file():
            w = torch.randn(d, d_sae, generator=g) / d ** 0.5
            # a negative encoder bias: a few percent of the features fire, as in trained SAEs
            cfg = {"architecture": "standard", "d_in": d, "d_sae": d_sae, "dtype": dtype,
                   "metadata": {"hook_name": f"blocks.{j}.hook_resid_post", "sae_lens_version": "6.54.12"}}
            SAE.from_state(cfg, {"W_enc": w, "W_dec": w.T.contiguous(), "b_dec": torch.zeros(d),
                                 "b_enc": torch.full((d_sae,), -1.5)}).save(folder)
        out.append(str(folder))
    return out


def in_turn(cases: dict, repeats: int, seconds: dict, out: dict) -> None:
    """Time the cases in turn, ``repeats`` rounds, so a drift of the machine's speed lands on all alike:
    ``seconds[name]`` the median, ``out["all_s"][name]`` every time; ``out["worker_timings"][name]``
    nnvllm's timings of the case's last call (worker and client: ``capture._LAST_TIMINGS``)."""
    from nnvllm import capture

    times: dict = {k: [] for k in cases}
    out["worker_timings"] = {}
    for _ in range(repeats):
        for k, fn in cases.items():
            capture._LAST_TIMINGS.clear()
            t = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t)
            out["worker_timings"][k] = dict(capture._LAST_TIMINGS)
            out.setdefault("eager_steps", {})[k] = bool(capture._LAST_STATS.get("eager"))
            out.setdefault("sae_encodings", {})[k] = capture._LAST_STATS.get("sae_encodings")  # blocks vs steps
    for k, ts in times.items():
        seconds[k] = statistics.median(ts)
    out["all_s"] = times


def nbytes(x) -> int:
    import torch

    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(nbytes(v) for v in x)
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--d-sae", type=int, default=16384)
    ap.add_argument("--k", type=int, default=32)
    ap.add_argument("--sae-dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--collect", type=int, default=0, help="also a feature dataset of this many prompts to disk")
    ap.add_argument("--root", default="/tmp/nnvllm-bench")
    ap.add_argument("--no-bare", action="store_true", help="skip vLLM's own bare_graphs process")
    ap.add_argument("--path", default=None, help="another checkpoint (e.g. the toy model, to try the script on a CPU)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--name", default=None)
    args = ap.parse_args()
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    prov = provenance()
    shape = SHAPES["llama1b"]
    path = args.path or build("llama1b", root)
    if args.path:
        cfg = json.loads((Path(path) / "config.json").read_text())
        shape = {"layers": cfg.get("num_hidden_layers") or cfg["n_layer"], "d": cfg.get("hidden_size") or cfg["n_embd"]}
        args.no_bare = True
    n, T, L = args.prompts, args.tokens, shape["layers"]
    name = args.name or f"llama1b_{n}x{T}_{args.d_sae}_top{args.k}_{args.sae_dtype}"
    out: dict = {"prompts": n, "tokens": T, "prompt_len": PROMPT_LEN, "layers": L, "d_sae": args.d_sae,
                 "k": args.k, "sae_dtype": args.sae_dtype, "repeats": args.repeats, "seconds": {}, "bytes": {}}
    if not args.no_bare:
        cmd = [sys.executable, str(Path(__file__).parent / "capture_gpu.py"), "--case", "bare_graphs", "--path", path,
               "--shape", "llama1b", "--prompts", str(n), "--tokens", str(T), "--repeats", str(args.repeats),
               "--root", str(root)]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=400, check=False,
                           env={**os.environ, "VLLM_PLUGINS": ""})
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
        if lines:
            out["seconds"]["bare_graphs"] = json.loads(lines[-1][7:])["bare_graphs"]["median"]
        else:
            out["bare_graphs_error"] = (p.stderr or p.stdout)[-2000:]
        print("bare_graphs", out["seconds"].get("bare_graphs"), flush=True)

    import torch
    from vllm import SamplingParams

    import nnvllm as nv
    t0 = time.perf_counter()
    folders = random_saes(root, L, shape["d"], args.d_sae, args.sae_dtype)
    saes = [nv.SAE.load(f) for f in folders]
    out["sae_write_load_s"] = time.perf_counter() - t0
    gpu = torch.cuda.is_available()
    model = nv.load(path, isolate=False, **({"dtype": "float16", "cuda_graphs": True, "gpu_memory_utilization": 0.5}
                                            if gpu else {"dtype": "float32"}))
    ps = prompts(n) if not args.path else [f"The capital of France is {i}" for i in range(n)]
    sp = SamplingParams(max_tokens=T, temperature=0.0, ignore_eos=True)
    s = out["seconds"]
    def gen(**kw):
        return lambda: nv.generate(model, ps, max_tokens=T, ignore_eos=True, logits=False, **kw)

    def per_step():  # each step's rows encoded as they come (NNVLLM_SAE_BLOCK_ROWS=0), for the A/B
        os.environ["NNVLLM_SAE_BLOCK_ROWS"] = "0"
        try:
            return gen(layers=None, saes=saes, sae_k=args.k)()
        finally:
            os.environ.pop("NNVLLM_SAE_BLOCK_ROWS", None)

    cases = {"engine_bare": lambda: model.llm.generate(ps, sp, use_tqdm=False), "tokens": gen(layers=None),
             "features": gen(layers=None, saes=saes, sae_k=args.k), "features_per_step": per_step,
             "resid": gen()}
    t0 = time.perf_counter()
    cases["features"]()
    out["features_first_call_s"] = time.perf_counter() - t0  # reads the SAEs onto the device
    for fn in cases.values():  # a warm-up each
        fn()
    in_turn(cases, args.repeats, s, out)
    feats = nv.generate(model, ps, max_tokens=T, ignore_eos=True, layers=None, logits=False, saes=saes, sae_k=args.k)
    alone = per_step()
    # Compared where both generated the same tokens: a GPU engine is not batch-invariant (a call's
    # first step may hold only some of its prompts), so a near-tie of a random model's logits can
    # flip a greedy token late in a request, and that request's later positions differ entirely.
    same = [i for i in range(n) if feats.tokens[i] == alone.tokens[i]]
    ids_same = [float((fa[i][0] == fb[i][0]).float().mean()) for fa, fb in zip(feats.features, alone.features)
                for i in same]
    values_diff = max(float((fa[i][1].float() - fb[i][1].float()).abs().max()) for fa, fb in
                      zip(feats.features, alone.features) for i in same)
    dense = nv.generate(model, ps, max_tokens=T, ignore_eos=True, logits=False)
    out["bytes"] = {"features": nbytes(feats.features) + nbytes(feats.sae_errors), "resid": nbytes(dense.resid)}
    out["bytes"]["resid / features"] = out["bytes"]["resid"] / out["bytes"]["features"]
    # the features are the SAEs' encoding of the stream the dense run captured (same greedy tokens)
    j = L // 2
    _, want_values = saes[j].top_features(dense.resid[0][j].float(), args.k)
    values = feats.features[j][0][1]
    out["check"] = {"tokens_equal": feats.tokens == dense.tokens, "per_step_same_tokens": len(same) / n,
                    "per_step_ids_equal_min_fraction": min(ids_same),
                    "per_step_values_max_abs": values_diff,
                    "values_max_abs": float((values.float() - want_values).abs().max()),
                    "fires_per_position": float((want_values > 0).sum(dim=-1).float().mean())}
    del feats, dense, alone
    if args.collect:
        import shutil

        many = prompts(args.collect) if not args.path else [f"The capital of France is {i}" for i in range(args.collect)]
        s["collect_bare"] = _timed(lambda: model.llm.generate(many, sp, use_tqdm=False), 1)["median"]
        folder = root / "sae_collect"
        shutil.rmtree(folder, ignore_errors=True)
        t0 = time.perf_counter()
        ds = nv.collect(model, many, folder, max_tokens=T, ignore_eos=True, layers=None, logits="none",
                        saes=saes, sae_k=args.k, progress=False)
        s["collect"] = time.perf_counter() - t0
        out["collect"] = {"prompts": args.collect, "requests": len(ds), "x collect_bare": s["collect"] / s["collect_bare"],
                          "bytes_on_disk": sum(f.stat().st_size for f in folder.iterdir() if f.is_file())}
        shutil.rmtree(folder, ignore_errors=True)
    model.close()
    out["ratios"] = {f"x {b}": {k: v / s[b] for k, v in s.items() if isinstance(v, float)}
                     for b in ("bare_graphs", "engine_bare") if b in s}
    print(json.dumps(out, indent=1), flush=True)
    print("recorded in", record("sae_gpu", name, out, args.out, prov))


if __name__ == "__main__":
    main()
