"""What a trace sends with each invoke: nnsight's payload against nnvllm's, timed side by side.

    python benchmarks/trace_payload.py [--model PATH] [--prompts 64] [--tokens 32] [--repeats 3]

One in-process engine (the embedded toy unless ``--model``). The trace is the collecting idiom, one
invoke per prompt, every block's output stacked at every step::

    steps = list().save()
    for _ in tracer.iter[:T]:
        outs = [block.output for block in blocks]
        steps.append(torch.stack(outs))

Three payloads (:mod:`nnvllm.engine.trace_payload`), in turns:

- ``nnsight``: every name the block reads travels, ``steps`` too, and the model's envoy tree is
  pickled by value with every invoke (nnsight alone);
- ``names``: a name the block assigns before reading it stays behind; envoys still by value;
- ``nnvllm``: that, and the envoys travel as ``Envoy:<path>`` ids (nnvllm's default).

Each runs "fresh" (``steps`` unbound in the calling scope, as in a cell's first run) and "again"
(``steps`` holding the fresh run's result, as in the same cell run a second time). Prints each
median and the ratios; records them as the run ``<prompts>x<tokens>`` of
``benchmarks/results/trace_payload_<machine>.json`` (or ``--out``).
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
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None, help="result file (default benchmarks/results/trace_payload_<machine>.json)")
    args = ap.parse_args()
    prov = provenance()

    import torch
    from nnsight.intervention import serialization

    import nnvllm as nv
    from nnvllm.engine.trace_payload import envoy_ids

    model = nv.load(args.model or nv.toy.check(), isolate=False)  # nnvllm's payload
    names = {"nnvllm": serialization._referenced_names, "nnsight": serialization._referenced_names.__wrapped__}
    ids = envoy_ids(model)

    def payload(which: str) -> None:
        serialization._referenced_names = names["nnsight" if which == "nnsight" else "nnvllm"]
        for pid, envoy in ids.items():
            if which == "nnvllm":
                envoy.__dict__["_persistent_id"] = pid
            else:
                envoy.__dict__.pop("_persistent_id", None)

    blocks = model.transformer.h if hasattr(model, "transformer") else model.model.layers  # GPT-2 or Llama
    n, T = len(blocks), args.tokens
    prompts = [f"Prompt number {i} says that the capital of France is" for i in range(args.prompts)]
    cases = ("nnsight", "names", "nnvllm")
    times: dict[str, list[float]] = {f"{c} {w}": [] for c in cases for w in ("fresh", "again")}
    for rep in range(args.repeats + 1):  # the first round warms up and is not kept
        for case in cases:
            payload(case)
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
                    times[f"{case} {when}"].append(time.perf_counter() - t)
    payload("nnvllm")
    model.close()

    med = {k: statistics.median(v) for k, v in times.items()}
    ratios = {"fresh: nnsight / nnvllm": med["nnsight fresh"] / med["nnvllm fresh"],
              "fresh: envoys by value / by id (names / nnvllm)": med["names fresh"] / med["nnvllm fresh"],
              "again: nnsight / nnvllm": med["nnsight again"] / med["nnvllm again"],
              "again / fresh, nnsight": med["nnsight again"] / med["nnsight fresh"],
              "again / fresh, nnvllm": med["nnvllm again"] / med["nnvllm fresh"]}
    for k, v in med.items():
        print(f"{k}: {v:.3f} s (median of {args.repeats})")
    for k, v in ratios.items():
        print(f"{k}: {v:.2f}x")
    res = {"model": args.model or "toy", "prompts": args.prompts, "tokens": T, "blocks": n,
           "repeats": args.repeats, "seconds": med, "all": times, "ratios": ratios}
    name = f"{args.prompts}x{T}"
    print(f"recorded as run '{name}' in {record('trace_payload', name, res, args.out, prov)}")


if __name__ == "__main__":
    main()
