"""Heads on a GPU: what capturing q, k, z costs against the residual stream, patterns of a long request,
and a direct logit attribution over a batch.

    python benchmarks/heads_gpu.py

Llama-1B shape (``capture_gpu.py``'s ``llama1b``: 16 layers, d=2048, 32 query heads and 8 KV heads of
64), random fp16 weights, the in-process engine with CUDA graphs:

- capture: 64 prompts x 128 greedy tokens, every layer; tokens only (no activations, no logits), the
  residual stream, and the residual stream plus q, k and z. GB/s of each recording = its bytes over
  its time beyond the tokens-only call (medians of ``--repeats`` after a warm-up on the full batch).
- patterns: one request of 2,048 positions, every layer and head (``nnvllm.heads.patterns`` on the
  GPU, q and k moved there once), its time and the peak memory it added.
- attribution: ``nv.attribute`` of one token pair over the 64 x 128 run, on the live engine (the
  weights read there: ``W_O[h]^T g`` per head by the engine) and with ``weights=`` read from
  transformers beforehand (the projection on the client), and how far its terms' sum is from the
  engine's logit difference (fp16 captures); medians of ``--repeats``, the two ways in turn.

Recorded in ``benchmarks/results/heads_gpu_<machine>.json`` (``benchmarks/provenance.py``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from capture_gpu import PROMPT_LEN, SHAPES, build, prompts  # noqa: E402
from provenance import provenance, record  # noqa: E402


def in_turn(cases: dict, repeats: int, res: dict, prefix: str = "") -> None:
    """Time each of ``cases`` (name -> call, warmed up by the caller) ``repeats`` times, the cases in
    turn, so a drift of the machine's speed lands on all alike; ``res[prefix + name + "_s"]`` is the
    median, ``..._all_s`` every time."""
    times: dict = {k: [] for k in cases}
    for _ in range(repeats):
        for k, fn in cases.items():
            t = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t)
    for k, ts in times.items():
        res[f"{prefix}{k}_s"] = statistics.median(ts)
        res[f"{prefix}{k}_all_s"] = ts


def gbps(res: dict) -> dict:
    """GB/s of each recording: its bytes over its time beyond the tokens-only call. Where a call took
    no longer than the one it is compared with (the difference is inside the run-to-run spread), the
    rate is not measurable here: None, and ``<name>_not_resolved`` says so."""
    out = {}
    for name, nbytes, slow, fast in (("resid", res["resid_bytes"], "resid_s", "tokens_only_s"),
                                     ("qkz", res["qkz_bytes"], "resid_qkz_s", "resid_s"),  # beyond the resid call
                                     ("resid_qkz", res["resid_bytes"] + res["qkz_bytes"], "resid_qkz_s", "tokens_only_s")):
        extra = res[slow] - res[fast]
        out[f"{name}_GBps"] = nbytes / extra / 1e9 if extra > 0 else None
        if extra <= 0:
            out[f"{name}_not_resolved"] = f"{slow} {res[slow]:.3f} <= {fast} {res[fast]:.3f}: within the spread"
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--long", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--name", default=None)
    a = ap.parse_args()

    prov = provenance()
    import torch

    import nnvllm as nv
    from nnvllm import capture
    from nnvllm.arch import AttentionSpec, arch_for
    from nnvllm.heads import HeadWeights, patterns
    from nnvllm.reference import load_reference

    shape = SHAPES["llama1b"]
    path = build("llama1b", Path(tempfile.gettempdir()) / "nnvllm-bench")
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"  # (the CPU: a smoke run of the script, not a measurement)
    model = nv.load(path, isolate=False, dtype="float16" if cuda else "float32", max_model_len=4096 if cuda else max(PROMPT_LEN + a.tokens, a.long) + 16,
                    **({"gpu_memory_utilization": 0.6, "cuda_graphs": True} if cuda else {}))
    ps, T, L = prompts(a.prompts), a.tokens, shape["layers"]
    res: dict = {"shape": shape, "prompts": a.prompts, "tokens": T, "repeats": a.repeats}
    name = a.name or f"llama1b_{a.prompts}x{T}"

    def keep():  # after each part: a command killed at its time limit keeps what finished
        record("heads_gpu", name, res, a.out, prov)

    def gen(**kw):
        return nv.generate(model, ps, max_tokens=T, ignore_eos=True, logits=False, **kw)

    # The three calls in turn, repeat after repeat: a drift of the machine's speed during the run
    # lands on all three alike (their differences are a few tenths of a second).
    cases = {"tokens_only": lambda: gen(layers=None), "resid": lambda: gen(layers="all"),
             "resid_qkz": lambda: gen(layers="all", sites=["q", "k", "z"])}
    for k, fn in cases.items():  # warm-up on the full batch, each once
        fn()
        res[f"{k}_eager_steps"] = bool(capture._LAST_STATS.get("eager"))
    in_turn(cases, a.repeats, res)
    pos = a.prompts * (PROMPT_LEN + T - 1)
    d, hd = shape["d"], shape["d"] // shape["heads"]
    widths = {"resid": d, "q": shape["heads"] * hd, "k": shape["kv"] * hd, "z": shape["heads"] * hd}
    b_resid = pos * L * widths["resid"] * 2
    b_qkz = pos * L * (widths["q"] + widths["k"] + widths["z"]) * 2
    res["resid_bytes"], res["qkz_bytes"] = b_resid, b_qkz
    res.update(gbps(res))
    keep()

    # patterns of one long request, every layer and head, on the GPU
    long = " ".join(f"t{(3 * j) % 8000 + 1}" for j in range(a.long))
    run = nv.generate(model, long, max_tokens=1, sites=["q", "k"], logits=False)
    spec = AttentionSpec.from_dict(run.meta["attention"])
    qs = [run.sites["q"][0][j].to(dev) for j in range(L)]
    ks = [run.sites["k"][0][j].to(dev) for j in range(L)]
    res["long_positions"] = int(qs[0].shape[0])

    def all_patterns(qs, ks):
        s = 0.0
        for j in range(L):
            s += float(patterns(qs[j], ks[j], spec, j)[:, -1].sum())  # each layer's result, then dropped
        return s

    all_patterns(qs, ks)
    if cuda:
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    total = all_patterns(qs, ks)
    res["patterns_all_layers_s"] = time.perf_counter() - t
    if cuda:
        res["patterns_peak_added_GiB"] = (torch.cuda.max_memory_allocated() - base) / 2**30
    res["patterns_one_layer_result_GiB"] = spec.n_heads * res["long_positions"] ** 2 * 4 / 2**30
    res["patterns_rows_sum"] = total / (L * spec.n_heads)  # each last row sums to 1
    t = time.perf_counter()
    float(run.attention(L - 1, device=dev)[0, -1].sum())
    res["run_attention_one_layer_s"] = time.perf_counter() - t  # with the transfer of q and k
    del qs, ks, run
    keep()

    # attribution of one token pair over the batch: on the live engine, then with transformers' weights
    run = nv.generate(model, ps, max_tokens=T, ignore_eos=True, sites=["z", "mlp"])
    hf, _ = load_reference(path, "float16" if cuda else "float32")
    weights = HeadWeights.from_module(hf, arch_for(hf.config.architectures), hf.config)
    ways = {"engine": lambda: nv.attribute(run, 5, 9), "weights": lambda: nv.attribute(run, 5, 9, weights=weights)}
    got = {k: fn() for k, fn in ways.items()}  # warm-up (the engine's readout path)
    in_turn(ways, a.repeats, res, "attribute_")
    att, att_w = got["engine"], got["weights"]
    for key, a_ in (("engine", att), ("weights", att_w)):
        res[f"attribute_{key}_identity_max_abs"] = max(float((a_.total(i) - a_.logit_diff[i]).abs().max())
                                                        for i in range(len(run)))
    res["attribute_engine_vs_weights_heads_max_abs"] = max(float((att.heads[i] - att_w.heads[i]).abs().max())
                                                           for i in range(len(run)))
    res["attribute_logit_diff_max_abs"] = max(float(x.abs().max()) for x in att.logit_diff)
    model.close()
    print(json.dumps(res, indent=1), flush=True)
    print("recorded in", record("heads_gpu", name, res, a.out, prov))


if __name__ == "__main__":
    main()
