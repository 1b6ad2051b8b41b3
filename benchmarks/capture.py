"""Capture cost, side by side in one run, as ratios to bare vLLM generate.

    python benchmarks/capture.py [--prompts 32] [--tokens 16] [--layers 6] [--d-model 256] [--repeats 3]

Cases (same engine, same greedy workload; each capturing case keeps the residual stream of the
blocks it names at every position the engine computes):

- ``bare``: ``model.llm.generate`` on nnvllm's engine, nothing captured (vLLM's own path).
- ``plain vLLM``: ``vllm.LLM`` on the same checkpoint with the engine's dtype, context and eager
  setting, without nnsight's runner or nnvllm's taps: what the engine itself costs over vLLM.
- ``nv.generate all``: nnvllm's worker-side hooks, all blocks' residuals, logits and samples.
- ``nv.generate 1 layer``: the same for one block.
- ``nnsight per-invoke``: one nnsight invoke per prompt, all blocks stacked per step under
  ``tracer.all()`` (the pattern nnvllm replaces).
- ``nnsight on transformers``: ``LanguageModel.generate`` on the HF model, batch of all prompts,
  all blocks saved per step under ``tracer.all()``.

Prints medians of ``--repeats`` rounds (after one warm-up each; each round runs every vLLM case
once, so background load hits them alike) and ratios to ``bare``, and records them as the run
``<prompts>x<tokens> L<layers> d<d-model>`` of ``benchmarks/results/capture_<machine>.json`` (or
``--out``), with the command, commit, vLLM version and date (``benchmarks/provenance.py``).
Absolute seconds only mean something on a GPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from provenance import provenance, record


def _interleaved(cases: list, repeats: int) -> dict[str, float]:
    """Median seconds per case; rounds alternate the cases so background load hits all alike."""
    for _, fn in cases:
        fn()  # warm-up
    ts: dict[str, list] = {name: [] for name, _ in cases}
    for _ in range(repeats):
        for name, fn in cases:
            t = time.perf_counter()
            fn()
            ts[name].append(time.perf_counter() - t)
    return {name: statistics.median(v) for name, v in ts.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-hf", action="store_true", help="leave out nnsight on transformers")
    ap.add_argument("--skip-invokes", action="store_true", help="leave out nnsight one-invoke-per-prompt (slow)")
    ap.add_argument("--out", type=str, default=None,
                    help="result file (default benchmarks/results/capture_<machine>.json)")
    args = ap.parse_args()
    prov = provenance()

    import nnvllm as nv
    from nnvllm.testing import tiny_checkpoint

    tmp = tempfile.mkdtemp(prefix="nnvllm-bench-")
    path = tiny_checkpoint("gpt2", Path(tmp) / "gpt2", n_layers=args.layers, d_model=args.d_model)
    words = [f for f, _ in nv.toy.FACTS]
    prompts = [words[i % len(words)] for i in range(args.prompts)]
    T, L = args.tokens, args.layers

    model = nv.load(path, isolate=False)  # bare generate needs the engine in this process
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=T, temperature=0.0, ignore_eos=True)

    def bare():
        model.llm.generate(prompts, params, use_tqdm=False)

    from vllm import LLM

    from nnvllm.engine.models import cpu_defaults, fit_gpu_memory

    mc = model.llm.llm_engine.vllm_config.model_config
    kw = fit_gpu_memory({}) if torch.cuda.is_available() else cpu_defaults()  # beside nnvllm's engine
    kw.update(dtype=mc.dtype, max_model_len=mc.max_model_len, enforce_eager=mc.enforce_eager)
    plain_llm = LLM(str(path), **kw)

    def plain():
        plain_llm.generate(prompts, params, use_tqdm=False)

    def nv_all():
        nv.generate(model, prompts, max_tokens=T, ignore_eos=True)

    def nv_one():
        nv.generate(model, prompts, max_tokens=T, ignore_eos=True, layers=[L // 2])

    def nnsight_invokes():
        with model.trace(temperature=0.0, max_tokens=T, ignore_eos=True) as tracer:
            for p in prompts:
                with tracer.invoke(p):
                    steps = list().save()
                    for _ in tracer.all():
                        steps.append(torch.stack([model.transformer.h[i].output.clone() for i in range(L)]))

    cases = [("bare vLLM generate", bare), ("plain vLLM, no nnsight", plain), ("nv.generate, all layers", nv_all),
             ("nv.generate, 1 layer", nv_one)]
    if not args.skip_invokes:
        cases.append(("nnsight, one invoke per prompt", nnsight_invokes))
    results = _interleaved(cases, args.repeats)
    model.close()

    if not args.skip_hf:
        from nnsight import LanguageModel

        lm = LanguageModel(path, dispatch=True, dtype=torch.float32)
        lm.tokenizer.padding_side = "left"
        lm.tokenizer.pad_token = lm.tokenizer.eos_token

        def hf():
            with lm.generate(prompts, max_new_tokens=T, do_sample=False, min_new_tokens=T,
                             pad_token_id=lm.tokenizer.eos_token_id) as tracer:
                steps = list().save()
                for _ in tracer.all():
                    steps.append(torch.stack([lm.transformer.h[i].output.clone() for i in range(L)]))

        # Its own process state (no vLLM engine alive); re-time bare vLLM is not possible here, so
        # this ratio carries more run-to-run noise than the others.
        results.update(_interleaved([("nnsight on transformers (batched)", hf)], args.repeats))

    base = results["bare vLLM generate"]
    print(f"\n{args.prompts} prompts x {T} tokens, GPT-2 shape {L} layers d={args.d_model}, "
          f"{'cuda' if torch.cuda.is_available() else 'cpu'}; median of {args.repeats}")
    print(f"{'case':36s} {'seconds':>9s} {'x bare':>8s}")
    for name, s in results.items():
        print(f"{name:36s} {s:9.3f} {s / base:8.2f}")
    name = f"{args.prompts}x{T} L{L} d{args.d_model}"
    path = record("capture", name, {"args": vars(args), "seconds": results,
                                    "ratio_to_bare": {k: v / base for k, v in results.items()}}, args.out, prov)
    print(f"recorded as run {name!r} in {path}")


if __name__ == "__main__":
    main()
