"""What a trace's saves cost on the way back: nnsight's tensor pickling against nnvllm's, side by side.

    python benchmarks/trace_saves.py [--model PATH] [--prompts 64] [--tokens 32] [--repeats 3]

One in-process engine (the embedded toy unless ``--model``) with vLLM's engine core in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so that both reductions can run in turns on the same engine:
the worker still pickles every request's saves once it ends and the engine still unpickles them, as
with the engine core in a process of its own, only without the socket between them. The traces are
one invoke per prompt, reading every block's output at every step, and keep:

- ``stacked``: the blocks' outputs stacked, one tensor a step (``steps.append(torch.stack(outs))``);
- ``per_block``: each block's output, one tensor a block a step (``steps.append(outs)``);
- ``nothing``: the same reads with nothing saved, the floor both others stand on.

``nv.generate`` keeping the same blocks (no logits) runs in the same rounds, for scale.

An isolated engine's server then sends the saves on to the client. That hop is timed on each trace's
saves as they arrived, in turns: a ``torch.save`` of them read back with ``torch.load(weights_only=True)``
(``torch_save``), against the same with the tensors packed into one buffer (``packed``:
:func:`nnvllm.engine.wire.pack_tensors` and ``unpack_tensors``).

Each runs with nnsight's reduction (torch's pickling, a ``torch.save`` archive a tensor) and with
nnvllm's (:mod:`nnvllm.engine.trace_saves`: raw bytes), and the two results are checked equal.
Prints each median and the ratios; records them as the run ``<prompts>x<tokens>`` of
``benchmarks/results/trace_saves_<machine>.json`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from provenance import provenance, record


def _tensors(value) -> list:
    """Every tensor in ``value`` (nested lists and tuples), in order."""
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return [value]


def _hop(steps) -> dict:
    """``{way: (seconds, the saves as the client reads them)}`` for an isolated server's reply holding
    ``steps``: written, then read back as the client reads it."""
    import io

    import torch

    from nnvllm.engine.wire import load_data, pack_tensors, to_data, unpack_tensors

    def torch_save():
        buf = io.BytesIO()
        torch.save({"saves": to_data({"steps": steps}, "the saves")}, buf)
        return load_data(buf.getvalue(), "the reply")["saves"]

    def packed():
        buf = io.BytesIO()
        torch.save({"packed_saves": pack_tensors(to_data({"steps": steps}, "the saves"))}, buf)
        return unpack_tensors(load_data(buf.getvalue(), "the reply")["packed_saves"], "the reply")

    out = {}
    for way, fn in (("torch_save", torch_save), ("packed", packed)):
        t = time.perf_counter()
        back = fn()
        out[way] = (time.perf_counter() - t, back)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint (default: the embedded toy)")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None, help="result file (default benchmarks/results/trace_saves_<machine>.json)")
    args = ap.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # (the worker's pickler is this process's)
    prov = provenance()

    import torch
    from nnsight.modeling.vllm import collect

    import nnvllm as nv

    model = nv.load(args.model or nv.toy.check(), isolate=False)
    reductions = {"nnvllm": collect._CompactPickler.reducer_override}
    reductions["nnsight"] = reductions["nnvllm"].__wrapped__
    blocks = model.transformer.h if hasattr(model, "transformer") else model.model.layers  # GPT-2 or Llama
    n, T = len(blocks), args.tokens
    prompts = [f"Prompt number {i} says that the capital of France is" for i in range(args.prompts)]

    def trace(keep: str):
        with model.trace(temperature=0.0, max_tokens=T, ignore_eos=True) as tracer:
            for p in prompts:
                with tracer.invoke(p):
                    steps = list().save()
                    for _ in tracer.iter[:T]:
                        outs = [blocks[i].output for i in range(n)]  # each block's output read once
                        outs = [o[0] if isinstance(o, tuple) else o for o in outs]
                        if keep == "stacked":
                            steps.append(torch.stack(outs))
                        elif keep == "per_block":
                            steps.append(outs)
        return steps

    kinds, ways = ("stacked", "per_block", "nothing"), ("nnsight", "nnvllm")
    times: dict[str, list[float]] = {f"{k} {w}": [] for k in kinds for w in ways}
    times["nv.generate"] = []
    times.update({f"{k} hop {h}": [] for k in ("stacked", "per_block") for h in ("torch_save", "packed")})
    for rep in range(args.repeats + 1):  # the first round warms up and is not kept
        t = time.perf_counter()
        nv.generate(model, prompts, max_tokens=T, ignore_eos=True, logits=False)
        if rep:
            times["nv.generate"].append(time.perf_counter() - t)
        for kind in kinds:
            got = {}
            for way in ways:
                collect._CompactPickler.reducer_override = reductions[way]
                t = time.perf_counter()
                got[way] = trace(kind)
                if rep:
                    times[f"{kind} {way}"].append(time.perf_counter() - t)
            a, b = _tensors(got["nnsight"]), _tensors(got["nnvllm"])
            if len(a) != len(b) or not all(torch.equal(x, y) for x, y in zip(a, b)):
                raise SystemExit(f"{kind}: the two reductions returned different saves")
            if kind != "nothing":
                for hop, arrived in _hop(got["nnvllm"]).items():
                    if rep:
                        times[f"{kind} hop {hop}"].append(arrived[0])
                    c = _tensors(arrived[1]["steps"])
                    if len(c) != len(b) or not all(torch.equal(x, y) for x, y in zip(b, c)):
                        raise SystemExit(f"{kind}: the {hop} hop returned different saves")
    collect._CompactPickler.reducer_override = reductions["nnvllm"]
    model.close()

    med = {k: statistics.median(v) for k, v in times.items()}
    floor = min(med["nothing nnsight"], med["nothing nnvllm"])
    ratios = {}
    for kind in ("stacked", "per_block"):
        ratios[f"{kind}: nnsight / nnvllm"] = med[f"{kind} nnsight"] / med[f"{kind} nnvllm"]
        ratios[f"{kind}: saving's cost above the floor, nnsight / nnvllm"] = (
            (med[f"{kind} nnsight"] - floor) / max(med[f"{kind} nnvllm"] - floor, 1e-9))
        for way in ways:
            ratios[f"{kind} {way} / nv.generate"] = med[f"{kind} {way}"] / med["nv.generate"]
        ratios[f"{kind}: isolated hop, torch_save / packed"] = med[f"{kind} hop torch_save"] / med[f"{kind} hop packed"]
    for k, v in med.items():
        print(f"{k}: {v:.3f} s (median of {args.repeats})")
    for k, v in ratios.items():
        print(f"{k}: {v:.2f}x")
    res = {"model": args.model or "toy", "prompts": args.prompts, "tokens": T, "blocks": n,
           "repeats": args.repeats, "seconds": med, "all": times, "ratios": ratios,
           "saved_tensors": {"stacked": args.prompts * T, "per_block": args.prompts * T * n, "nothing": 0}}
    name = f"{args.prompts}x{T}"
    print(f"recorded as run '{name}' in {record('trace_saves', name, res, args.out, prov)}")


if __name__ == "__main__":
    main()
