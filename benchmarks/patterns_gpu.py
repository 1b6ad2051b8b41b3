"""Attention patterns of one long request on a GPU: ``nnvllm.heads.patterns`` over every layer and head.

    python benchmarks/patterns_gpu.py [--positions 2048 4096] [--out FILE]

Llama-1B's attention shape (16 layers, 32 query heads, 8 KV heads of 64, grouped-query), q and k
random on the GPU in fp16 and fp32 (what a capture holds there): the time to rebuild every layer's
``[heads, pos, pos]`` pattern (each layer's result made, then dropped; median of 5 after a warm-up)
and the peak GPU memory it adds. Needs torch only (no vLLM), so it runs on a bare GPU image.
Recorded in ``benchmarks/results/patterns_gpu_<machine>.json`` (``benchmarks/provenance.py``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))
from provenance import provenance, record  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--positions", type=int, nargs="+", default=[2048, 4096])
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    prov = provenance()
    import torch

    from nnvllm.arch import AttentionSpec
    from nnvllm.heads import patterns

    L, H, KV, D = 16, 32, 8, 64
    spec = AttentionSpec(family="llama", n_layers=L, n_heads=H, n_kv_heads=KV, d_head=D, scale=D ** -0.5)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    res: dict = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "torch": torch.__version__,
                 "layers": L, "heads": H, "kv_heads": KV, "d_head": D}
    g = torch.Generator(device=dev).manual_seed(0)
    for dtype in (torch.float16, torch.float32):
        for P in a.positions:
            qs = [torch.randn(P, H, D, device=dev, dtype=dtype, generator=g) for _ in range(L)]
            ks = [torch.randn(P, KV, D, device=dev, dtype=dtype, generator=g) for _ in range(L)]

            def every_layer(qs, ks):
                return sum(float(patterns(qs[j], ks[j], spec, j)[:, -1].sum()) for j in range(L))

            every_layer(qs, ks)  # warm-up
            if dev == "cuda":
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            ts = []
            for _ in range(5):
                t = time.perf_counter()
                total = every_layer(qs, ks)
                ts.append(time.perf_counter() - t)
            key = f"{str(dtype).removeprefix('torch.')}_{P}"
            res[key] = {"seconds_median": statistics.median(ts), "seconds": ts,
                        "last_rows_sum_per_head": total / (L * H),  # each last row sums to 1
                        "peak_added_GiB": (torch.cuda.max_memory_allocated() - base) / 2**30 if dev == "cuda" else None}
            print(key, res[key], flush=True)
            del qs, ks
    print("recorded in", record("patterns_gpu", "llama1b_attention", res, a.out, prov))


if __name__ == "__main__":
    main()
