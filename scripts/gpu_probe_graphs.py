"""Probe (GPU): which nnsight trace kills an engine that replays CUDA graphs (``cuda_graphs=True``)?

    python scripts/gpu_probe_graphs.py [--cases a,b] [--timeout 120]

Seen on an H200 (vLLM 0.26): ``nv.patch`` on a graph engine ended the engine core with a CUDA error
at ``prepare_inputs_event.record()`` (an asynchronous error from an earlier kernel). Each case runs
in a fresh process with ``CUDA_LAUNCH_BLOCKING=1`` (the failing kernel raises where it is launched)
and ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (the engine core in that process, so its traceback is
printed there), on the embedded toy model in fp32:

- ``trace_read``: one trace, two invokes (prefill only), saving the logits: no edit.
- ``trace_edit``: one invoke writing block 0's output at one prompt position.
- ``trace_decode_edit``: the same at the first decode step (``tracer.iter[1:2]``).
- ``generate_then_trace``: an ``nv.generate`` capture, then ``trace_edit``.
- ``patch``: ``nv.patch`` itself (its refusal of graph engines bypassed).
- ``patch_eager``: ``nv.patch`` on an eager engine (the control).

Prints one line per case: ``ok`` or the error's last lines.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

CASES = ["trace_read", "trace_edit", "trace_decode_edit", "generate_then_trace", "patch", "patch_eager"]

CHILD = r"""
import sys, torch, nnvllm as nv, nnvllm.engine as eng
case = sys.argv[1]
graphs = case != "patch_eager"
m = nv.load(isolate=False, dtype="float32", gpu_memory_utilization=0.3, kv_cache_memory_bytes=1 << 30,
            cuda_graphs=graphs)
print("uses_cuda_graphs:", eng.uses_cuda_graphs(m), flush=True)
clean, corrupt = "The capital of France is", "The capital of Italy is"
if case in ("generate_then_trace",):
    run = nv.generate(m, [clean, corrupt] * 4, max_tokens=4, ignore_eos=True)
    print("generate ok", run.text[:2], flush=True)
if case == "trace_read":
    with m.trace(temperature=0.0, max_tokens=1) as tr:
        with tr.invoke(clean):
            a = m.logits.save()
        with tr.invoke(corrupt):
            b = m.logits.save()
    print("read ok", tuple(a.shape), tuple(b.shape), flush=True)
if case in ("trace_edit", "generate_then_trace"):
    with m.trace(temperature=0.0, max_tokens=1) as tr:
        with tr.invoke(corrupt):
            m.transformer.h[0].output[2] = 0
            a = m.logits.save()
    print("edit ok", tuple(a.shape), flush=True)
if case == "trace_decode_edit":
    with m.trace(temperature=0.0, max_tokens=2, ignore_eos=True) as tr:
        with tr.invoke(corrupt):
            for _ in tr.iter[1:2]:
                m.transformer.h[0].output[0] = 0
                a = m.logits.save()
    print("decode edit ok", tuple(a.shape), flush=True)
if case in ("patch", "patch_eager"):
    eng.uses_cuda_graphs = lambda model: False  # bypass nv.patch's refusal
    res = nv.patch(m, clean, corrupt, " Paris", " Rome", progress=False)
    print("patch ok", res, flush=True)
m.close()
print("CASE OK", flush=True)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--timeout", type=float, default=120)
    args = ap.parse_args()
    env = {**os.environ, "CUDA_LAUNCH_BLOCKING": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_PLUGINS": ""}
    for case in args.cases.split(","):
        t = time.perf_counter()
        try:
            p = subprocess.run([sys.executable, "-c", CHILD, case], env=env, capture_output=True, text=True,
                               timeout=args.timeout)
            out = p.stdout + p.stderr
            ok = "CASE OK" in p.stdout
        except subprocess.TimeoutExpired as e:
            out = f"TIMEOUT after {args.timeout}s\n{(e.stdout or b'')[-3000:]!r}\n{(e.stderr or b'')[-3000:]!r}"
            ok = False
        dt = time.perf_counter() - t
        print(f"=== {case}: {'ok' if ok else 'FAILED'} ({dt:.0f}s)", flush=True)
        lines = [ln for ln in out.splitlines() if ln.strip()]
        keep = [ln for ln in lines if "ok" in ln or "uses_cuda_graphs" in ln] if ok else lines[-60:]
        print("\n".join(keep), flush=True)


if __name__ == "__main__":
    main()
