"""A trace run again from the same cell: nnvllm's rule for what a trace block sends against nnsight's.

    python benchmarks/trace_rerun.py [--model PATH] [--prompts 16] [--tokens 32] [--repeats 3]

One in-process engine (the embedded toy unless ``--model``). The trace is the collecting idiom, one
invoke per prompt, every block's output stacked at every step::

    steps = list().save()
    for _ in tracer.iter[:T]:
        steps.append(torch.stack([block.output for block in blocks]))

It runs "fresh" (``steps`` unbound in the calling scope, as in a cell's first run) and "again"
(``steps`` still holding the previous run's result, as in a cell run a second time), under nnsight's
own rule (every name the block reads travels, ``steps`` too) and under nnvllm's
(:func:`nnvllm.engine.trace_payload.trace_blocks_ship_only_what_they_read`: a name the block assigns before
reading it stays behind), in turns. Prints each median and the ratios; records them as the run
``<prompts>x<tokens>`` of ``benchmarks/results/trace_rerun_<machine>.json`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from provenance import provenance, record


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint (default: the embedded toy)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None, help="result file (default benchmarks/results/trace_rerun_<machine>.json)")
    args = ap.parse_args()
    prov = provenance()

    import torch
    from nnsight.intervention import serialization

    import nnvllm as nv

    model = nv.load(args.model or nv.toy.check(), isolate=False)  # installs nnvllm's rule
    rules = {"nnvllm": serialization._referenced_names, "nnsight": serialization._referenced_names.__wrapped__}
    blocks = model.transformer.h if hasattr(model, "transformer") else model.model.layers  # GPT-2 or Llama
    n, T = len(blocks), args.tokens
    prompts = [f"Prompt number {i} says that the capital of France is" for i in range(args.prompts)]

    times: dict[str, list[float]] = {f"{r} {w}": [] for r in rules for w in ("fresh", "again")}
    for rep in range(args.repeats + 1):  # the first round warms up and is not kept
        for rule, fn in rules.items():
            serialization._referenced_names = fn
            steps = None
            del steps  # "fresh": no `steps` in this scope, as in a cell's first run
            for when in ("fresh", "again"):  # "again": `steps` holds the fresh run's result
                t = time.perf_counter()
                with model.trace(temperature=0.0, max_tokens=T, ignore_eos=True) as tracer:
                    for p in prompts:
                        with tracer.invoke(p):
                            steps = list().save()
                            for _ in tracer.iter[:T]:
                                outs = [blocks[i].output for i in range(n)]  # each block's output read once
                                steps.append(torch.stack([o[0] if isinstance(o, tuple) else o for o in outs]))
                if rep:
                    times[f"{rule} {when}"].append(time.perf_counter() - t)
    serialization._referenced_names = rules["nnvllm"]
    model.close()

    med = {k: statistics.median(v) for k, v in times.items()}
    ratios = {"again / fresh, nnsight's rule": med["nnsight again"] / med["nnsight fresh"],
              "again / fresh, nnvllm's rule": med["nnvllm again"] / med["nnvllm fresh"],
              "again: nnsight's rule / nnvllm's": med["nnsight again"] / med["nnvllm again"]}
    for k, v in med.items():
        print(f"{k}: {v:.3f} s (median of {args.repeats})")
    for k, v in ratios.items():
        print(f"{k}: {v:.2f}x")
    res = {"model": args.model or "toy", "prompts": args.prompts, "tokens": T, "blocks": n,
           "repeats": args.repeats, "seconds": med, "all": times, "ratios": ratios}
    name = f"{args.prompts}x{T}"
    print(f"recorded as run '{name}' in {record('trace_rerun', name, res, args.out, prov)}")


if __name__ == "__main__":
    main()
