"""Direct logit attribution on the client: ``nv.attribute(run, target, versus, weights=...)`` over a
synthetic run of the Llama-1B shape, beside the straightforward computation it replaced.

    python benchmarks/attribute.py [--prompts 64] [--tokens 128] [--repeats 5]

What ``nv.attribute`` spends after the generate, apart from the engine's readout (a few small
vectors; on a live engine one RPC): reading every block's z and MLP output at every generated step
through the direction being explained. The run is synthetic (random fp16 z, MLP outputs and stream
of 16 layers, d=2048, 32 heads of 64, vocabulary 8192; prompts of 16 tokens), built in the process:
the computation depends on the shapes only, so the script needs torch and nnvllm, not vLLM, and
runs on any machine. Cases, each the median of ``--repeats`` after a warm-up, in turn:

- ``attribute``: ``nv.attribute`` with ``weights=`` (the engine path differs only in who makes the
  readout).
- ``gathered``: the same terms computed the plain way: every request's positions gathered and
  concatenated, z converted to float32, one ``einsum`` per layer (how ``nv.attribute`` computed them
  before; kept here as the baseline). Its heads are checked equal to ``attribute``'s.

Recorded in ``benchmarks/results/attribute_<machine>.json`` (``benchmarks/provenance.py``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from provenance import provenance, record  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    prov = provenance()
    import torch

    import nnvllm as nv
    from nnvllm.heads import HeadWeights, Readout, direction
    from nnvllm.lens import Norm
    from nnvllm.results import Run

    N, T, P = a.prompts, a.tokens, 16
    L, d, H, D, V = 16, 2048, 32, 64, 8192
    g = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return (torch.randn(*shape, generator=g) * 0.1).to(torch.float16)

    pos = P + T - 1
    z = [rnd(L, pos, H * D) for _ in range(N)]
    mlp = [rnd(L, pos, d) for _ in range(N)]
    resid = [rnd(L, pos, d) for _ in range(N)]
    logits = [torch.randn(T, V, generator=g) for _ in range(N)]
    w = HeadWeights(w_o=rnd(L, d, H * D), final_norm=Norm("rmsnorm", torch.ones(d), None, 1e-5),
                    unembed=rnd(V, d), embed=rnd(V, d))
    run = Run(prompts=["x"] * N, prompt_ids=[list(range(P))] * N, tokens=[list(range(T))] * N, text=[""] * N,
              logits=logits, samples=[None] * N, resid=resid, layers=list(range(L)), sites={"z": z, "mlp": mlp},
              meta={"attention": {"n_heads": H}})

    def gathered():
        gv, _ = direction(w.unembed, w.final_norm, 5, 9)
        ro = Readout.from_weights(w, gv, H)
        where = [torch.arange(P - 1, P - 1 + T)] * N
        zz = torch.cat([z[i].index_select(1, p) for i, p in enumerate(where)], 1).unflatten(-1, (H, D))
        mm = torch.cat([mlp[i].index_select(1, p) for i, p in enumerate(where)], 1)
        heads = torch.zeros(zz.shape[1], L, H)
        mt = torch.zeros(zz.shape[1], L)
        for layer in range(L):
            heads[:, layer] = torch.einsum("nhd,hd->nh", zz[layer].float(), ro.heads[layer])
            mt[:, layer] = mm[layer].float() @ ro.mlp[layer]
        return heads, mt

    cases = {"attribute": lambda: nv.attribute(run, 5, 9, weights=w), "gathered": gathered}
    out = {k: fn() for k, fn in cases.items()}  # warm-up
    times: dict = {k: [] for k in cases}
    for _ in range(a.repeats):
        for k, fn in cases.items():
            t = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t)
    att, (heads, _) = out["attribute"], out["gathered"]
    # the gathered terms are before the frozen final-norm scale divides them
    scale = torch.cat([resid[i][-1, P - 1: P - 1 + T].float().pow(2).mean(-1).add(1e-5).sqrt() for i in range(N)])
    diff = float((torch.cat(att.heads) - heads / scale[:, None, None]).abs().max())
    res = {"shape": {"layers": L, "d": d, "heads": H, "d_head": D, "vocab": V}, "prompts": N, "tokens": T,
           "repeats": a.repeats, "threads": torch.get_num_threads(),
           "seconds": {k: statistics.median(v) for k, v in times.items()}, "all": times,
           "heads_max_abs_diff": diff}
    res["gathered / attribute"] = res["seconds"]["gathered"] / res["seconds"]["attribute"]
    print(json.dumps(res, indent=1), flush=True)
    print("recorded in", record("attribute", f"llama1b_{N}x{T}", res, a.out, prov))


if __name__ == "__main__":
    main()
