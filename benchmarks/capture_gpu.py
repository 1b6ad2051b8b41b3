"""Capture cost on a GPU, every case side by side in one command (each case in its own process).

    python benchmarks/capture_gpu.py --shape llama1b --prompts 64 --tokens 128
    python benchmarks/capture_gpu.py --shape gpt2s --prompts 64 --tokens 32
    python benchmarks/capture_gpu.py --shape llama1b --big 1024 --tokens 128
    python benchmarks/capture_gpu.py --all      # all three above, every case: one command
    python benchmarks/capture_gpu.py --table llama1b   # a recorded run as a markdown table

Each run is recorded in one file, ``benchmarks/results/capture_gpu_<machine>.json`` (or ``--out``),
as the run ``--name`` (default: the shape, or ``big`` with ``--big``), beside the other workloads'
runs, with its command, commit, vLLM version and date (``benchmarks/provenance.py``); it is written
after every case, so a killed command keeps what finished; an interrupted one (``timeout -s INT``, as
``scripts/gpu_lane.sh`` cuts a stage) also keeps, under ``errors``, what its running case printed so
far (a ``paired`` case prints each turn). ``--all`` runs the three workloads one
after the other, every case of each (``ALL_CASES``), as the runs ``llama1b``, ``gpt2s`` and ``big``
of that one file. Its cases take about a minute each on an H200 (start-up included), so it runs past
a ten-minute command limit: split it there with ``--cases`` and ``--name``, as
``scripts/gpu_lane.sh bench`` does.

Shapes (random fp16 weights, written once; a WordLevel tokenizer with the model's vocabulary):
``llama1b`` 16 layers, d=2048, 32/8 heads, d_mlp 8192, vocab 8192; ``gpt2s`` 12 layers, d=768, vocab
8192. Workload: greedy, ``ignore_eos``, prompts of 16 tokens. Every capturing case keeps every
block's output (the residual stream) at every position; nnvllm's cases also keep the logits of every
step and the sampling statistics.

Cases (each in a fresh process, vLLM keeps GPU memory until its process ends; warm-up on the full
batch, then the median of ``--repeats``):

- ``bare_graphs``: ``vllm.LLM`` with vLLM's defaults (torch.compile + CUDA graphs), nothing captured.
- ``bare_eager``: the same with ``enforce_eager=True``.
- ``bare_nocompile``: ``vllm.LLM`` with the settings of nnvllm's graph engine (no torch.compile, full
  CUDA graphs for decode), nothing captured: the part of nnvllm's cost that is not nnsight's runner.
- ``nv_graphs``: ``nv.generate`` on nnvllm's in-process engine (``cuda_graphs=True``); the
  same process also times ``model.llm.generate`` (nnvllm's engine, nothing captured) and, as
  ``<case>_tokens``, ``nv.generate`` keeping only tokens and samples (every ``nv_*`` case).
- ``nv_eager``: the same with ``cuda_graphs=False``.
- ``nv_graphs_nopieces``: ``nv_graphs`` with ``NNVLLM_TRACE_PIECES=0`` (whole graphs only, not also in
  pieces for traces): what recording the pieces costs ``nv.generate``. Every ``nv_*`` case also
  records ``<case>_load``, the seconds ``nv.load`` took (engine start and graph recording).
- ``<nv case>_residgraphs``: the same with ``NNVLLM_GRAPH_SITES=resid`` (the graphs record the
  residual stream's copies only): what recording every site's copies costs each replayed step.
- ``<nv case>_compiled``: the same with ``NNVLLM_COMPILE=1`` (vLLM's torch.compile runs the forward,
  the taps inside it as opaque ops); before ``_residgraphs`` where both are wanted.
- ``nv_default``: ``nv.load(path, dtype="float16")`` and nothing else: what a researcher gets
  (on a GPU: an isolated engine with CUDA graphs).
- ``nv_isolated``: ``nv.generate`` on an isolated engine (``isolate=True``, graphs on).
- ``nv_isolated_eager``: the same with ``cuda_graphs=False``.
- ``nv_fp32`` / ``nv_fp32_exact``: ``nv_graphs`` with the weights in fp32, without and with
  ``exact=True`` (the speed cost of full-precision fp32 attention).
- ``<nv case>_handover_<mode>``: the same with ``NNVLLM_HANDOVER=<mode>`` (stage, pin, plain).
- ``nv_steer`` / ``nv_steer_eager``: steering cost: on the graph (or eager) in-process
  engine, ``nv.generate`` reading nothing but tokens and samples (``layers=None, logits=False``),
  without and with one steering edit (a vector added to the residual stream after the middle block,
  every position, every prompt), and the same two with every layer and the logits captured; plus
  the engine's own generate. Ratios ``steer`` (steered / unsteered) in each pair.
- ``nv_trace`` / ``nv_trace_nopieces``: an nnsight trace reading every block's output at every step
  (one invoke per prompt) on the in-process graph engine, with its traced decode steps replayed in
  graph pieces (the default) or run eagerly (``NNVLLM_TRACE_PIECES=0``); beside ``<case>_generate``,
  ``nv.generate`` keeping the same on the same engine, and ``<case>_logits_only``, the trace reading
  only the logits (nnsight's cost per invoke without block reads; its decode steps replay the pieces
  too, as every traced step does); ``per_call`` has each call's step modes.
- ``nv_trace_isolated``: the ``nv_trace`` case on an isolated engine (``isolate=True``, nv.load's
  default on a GPU), without the step modes.
- ``nv_trace_profile``: the ``nv_trace`` case's 1- and 8-prompt calls (``nv.generate``, the trace, the
  logits-only trace) once each under cProfile, with the engine core in the case's process
  (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the profile sees the worker: seconds (profiler on) and
  the 30 costliest functions by own and by cumulative time.
- ``nv_split``: on one in-process graph engine, in turns, ``repeats`` times: the engine's own
  generate with text prompts (``_bare``) and with token ids as nv.generate sends them (``_ids``),
  ``nv.generate`` keeping only tokens and samples (``_tokens``), every layer (``_layers``), the
  logits (``_logits``) and both (``_all``): where nv.generate's cost over the engine's own generate
  goes. Each call's ``per_call`` entry has nv.generate's timings and this process's collection
  pauses (``process_gc``: seconds, ``process_gc_full``, ``process_gc_young``); the worker's and the
  client's are ``gc*`` and ``client_gc*`` there.
  ``nv_split_profile``: one call of each under cProfile, the engine core in the case's process.
  ``nv_split_kernels``: one call of each under torch.profiler, the engine core in the case's
  process: the device's busy time against the call's wall time (``_kernels``: where the device
  waits on the host), the costliest kernels, and the host's synchronizing and launching calls.
  ``bare_kernels``: bare vLLM's default run the same way, for the kernels it runs;
  ``bare_nocompile_kernels``: bare vLLM with nnvllm's engine settings (no torch.compile, full graphs
  for decode only) the same way. ``bare_profile`` and ``bare_nocompile_profile``: one call of each
  under cProfile, as ``nv_split_profile``. Each cProfile record also lists the 30 costliest
  functions of nnsight and nnvllm by cumulative time (``ours``), and every call that can make the
  host wait for the device (``synchronize``, ``item``, ``tolist``, ``cpu``, ``numpy``,
  ``pin_memory``) with its callers and their counts (``syncs``).
- ``paired``: nnvllm's defaults against vLLM's own, with a shared host's drift cancelled: in one process, bare
  vLLM's default engine (``vllm.LLM``, torch.compile + CUDA graphs), ``nv.load(path)`` (its default:
  isolated on a GPU) and ``nv.load(path, isolate=False)``, each with 0.28 of the GPU, called in turns
  (the order rotating each turn), ``repeats`` turns: what vLLM settled on for each engine
  (``paired_config``: async scheduling, torch.compile, graphs; the isolated engine's as its ``info()``
  reports them), each engine's median and every call (``paired_<engine>``); in ``paired_summary``,
  the median of each turn's ratio to bare (``x bare <engine>``), the interval that holds that median
  with at least 95% probability (``interval x bare <engine>``: :func:`median_interval`), each
  engine's fastest call against bare's fastest (``x bare fastest <engine>``: a shared host's noise only
  adds time) and each engine's largest distance of a call from its median (``spread <engine>``, a fraction); nnvllm's
  timings of each call (``per_call``, with each process's collection pauses: ``gc*`` the worker's, ``client_server_gc*`` the isolated server's, ``client_gc*`` this process's),
  and this process's pauses in each bare call (``paired_bare_gc``).
  ``paired_split``: the same with three more forms, each engine with 0.16 of the GPU: vLLM with nnvllm's
  engine settings (``settings``: no torch.compile, full graphs for decode only), the same on vLLM's V1
  model runner, the one nnsight instruments (``v1``: bare vLLM 0.33 runs V2; each engine's runner is in
  ``paired_split_config``), and the in-process engine's own generate, nothing captured (``own``).
  ``paired_split_summary`` also has each step of the gap, per turn: ``x bare settings``, ``x settings
  v1``, ``x v1 own`` (nnsight's runner and nnvllm's taps), ``x settings own``, ``x own in_process``
  (the capture) and ``x in_process default`` (the isolation), and the same steps between the fastest
  calls (``fastest x bare settings``...).
  ``paired_mirror``: the paired case with a fourth engine, each with 0.19 of the GPU: ``nv.load(path)``
  started with ``NNVLLM_HANDOVER=mirror`` (``mirror``: the hand-off written during the generation),
  and ``x default mirror`` / ``fastest x default mirror`` in ``paired_mirror_summary``.
- ``vllm_lens``: vllm-lens 1.2.1, ``output_residual_stream`` = all layers (llama shape).
- ``hf_nnsight``: nnsight ``LanguageModel.generate`` on transformers, all blocks' outputs each step.
- ``nnsight_taps``: nnsight ``VLLM(taps=[blocks])``, one invoke per prompt (slow: one timed run).

``--big N``: N prompts streamed to disk with ``nv.collect`` (memory budget ``--budget``) against
bare generate of the same prompts on the same engine, and the notebook-process peak RSS; with
``--big-batches 64,128`` also the same collect at each ``batch_size``.

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
from provenance import provenance, record, result_path

SHAPES = {
    "llama1b": dict(kind="llama", layers=16, d=2048, heads=32, kv=8, d_mlp=8192, vocab=8192),
    "gpt2s": dict(kind="gpt2", layers=12, d=768, heads=12, kv=12, d_mlp=3072, vocab=8192),
}
PROMPT_LEN = 16
# --all: every case, per shape (vllm-lens reads the Llama shape only)
ALL_CASES = {
    "llama1b": "bare_graphs,bare_eager,nv_default,nv_graphs,nv_eager,nv_isolated,nv_isolated_eager,nv_trace,vllm_lens,"
               "hf_nnsight,nnsight_taps",
    "gpt2s": "bare_graphs,bare_eager,nv_graphs,nv_eager,nv_isolated,nv_isolated_eager,hf_nnsight,nnsight_taps",
}


def median_interval(xs: list[float], level: float = 0.95) -> tuple[float, float] | None:
    """A distribution-free interval for the median of what ``xs`` samples: the order statistics
    ``x(k)`` and ``x(n+1-k)`` with the largest ``k`` for which P(Binomial(n, 1/2) < k) <= (1 - level)/2,
    so that it holds the median with probability at least ``level`` (12 values: the 3rd and the 10th,
    96.1%); None where ``xs`` is too short for ``level`` (fewer than 6 values for 95%)."""
    from math import comb

    n, k, below = len(xs), 0, 0.0
    while k < n:
        below += comb(n, k) / 2 ** n  # P(Binomial(n, 1/2) <= k)
        if below > (1 - level) / 2:
            break
        k += 1
    if k == 0:
        return None
    s = sorted(xs)
    return s[k - 1], s[n - k]


def build(shape: str, root: Path) -> str:
    """Write a random fp16 checkpoint of ``shape`` with a word-level tokenizer; return its path."""
    out = root / shape
    if (out / "config.json").is_file():
        return str(out)
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    s = SHAPES[shape]
    vocab = {f"t{i}": i for i in range(s["vocab"] - 1)} | {"<eos>": s["vocab"] - 1}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    from tokenizers import decoders

    tk.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>", unk_token="<eos>", pad_token="<eos>")
    eos = s["vocab"] - 1
    torch.manual_seed(0)
    if s["kind"] == "llama":
        cfg = LlamaConfig(vocab_size=s["vocab"], hidden_size=s["d"], intermediate_size=s["d_mlp"],
                          num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                          num_key_value_heads=s["kv"], max_position_embeddings=4096, tie_word_embeddings=False,
                          bos_token_id=eos, eos_token_id=eos, torch_dtype="float16")
        cls = LlamaForCausalLM
    else:
        cfg = GPT2Config(vocab_size=s["vocab"], n_embd=s["d"], n_layer=s["layers"], n_head=s["heads"],
                         n_positions=4096, bos_token_id=eos, eos_token_id=eos, torch_dtype="float16")
        cls = GPT2LMHeadModel
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(dev):
        model = cls(cfg).half()
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return str(out)


def prompts(n: int) -> list[str]:
    return [" ".join(f"t{(7 * i + j) % 8000 + 1}" for j in range(PROMPT_LEN)) for i in range(n)]


def _timed(fn, repeats: int, snap=None) -> dict:
    """Warm-up on the full batch, then ``repeats`` timed calls: their median, every time, and (with
    ``snap``) what ``snap()`` returns after each call (nnvllm's per-call worker and client timings).
    The warm-up is timed too (``first``); ``repeats=0`` times it alone."""
    t = time.perf_counter()
    fn()  # warm-up on the full batch
    first = time.perf_counter() - t
    if repeats == 0:
        return {"first": first, "all": [first], "per_call": [snap()] if snap is not None else []}
    if snap is not None:
        snap()  # (the warm-up's share of what it counts)
    ts, per_call = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
        if snap is not None:
            per_call.append(snap())
    out = {"median": statistics.median(ts), "all": ts, "first": first}
    if snap is not None:
        out["per_call"] = per_call
    return out


def _profiled(fn) -> dict:
    """A warm-up call, then one call under cProfile: its seconds (with the profiler on) and the 30
    costliest functions by own time, by cumulative time, and of nnsight and nnvllm by cumulative time
    (``ours``), one line each; and the calls that can wait for the device, with their callers
    (``syncs``); and what the capture's per-step functions call (``step``)."""
    import cProfile
    import io
    import pstats

    fn()
    pr = cProfile.Profile()
    t = time.perf_counter()
    pr.enable()
    fn()
    pr.disable()
    out = {"median": time.perf_counter() - t}
    for key, only in (("tottime", ()), ("cumulative", ()), ("ours", ("nnsight|nnvllm",))):
        buf = io.StringIO()
        pstats.Stats(pr, stream=buf).sort_stats("cumulative" if key == "ours" else key).print_stats(*only, 30)
        out[key] = [ln.rstrip() for ln in buf.getvalue().splitlines() if ln.strip()][-31:]
    # The calls that can make the host wait for the device, each with its callers and their counts.
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).print_callers(r"synchronize|'item'|'tolist'|'cpu'|'numpy'|pin_memory")
    out["syncs"] = [ln.rstrip() for ln in buf.getvalue().splitlines() if ln.strip()][2:]
    # What a capture's step places on the host, call by call (nnvllm's per-step work: ``step_host``).
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).print_callees(r"arena.py:\d+\((_step|_place_step|_decode_step)\)")
    out["step"] = [ln.rstrip() for ln in buf.getvalue().splitlines() if ln.strip()][2:]
    return out


def _kernel_profile(fn) -> dict:
    """A warm-up call, then one call under torch.profiler: its wall seconds, the device's busy time
    (every kernel's and copy's own time, summed; what is left of the wall time the device waited on
    the host), how many device events ran, the 12 costliest, and the host's synchronizing and
    launching calls (count, seconds). Kernels run in the profiled process only: run the engine core
    in it (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    fn()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        t = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t
    avgs = prof.key_averages()
    own = [(a, getattr(a, "self_device_time_total", 0.0) or 0.0) for a in avgs]
    dev = sorted([(a, us) for a, us in own if us > 0], key=lambda x: -x[1])
    host = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
            "cudaMemcpyAsync", "cudaLaunchKernel", "cudaGraphLaunch", "cudaHostRegister", "cudaStreamWaitEvent")
    busy = sum(us for _, us in dev) / 1e6
    return {"wall": wall, "device_busy": busy, "device_idle": wall - busy, "device_events": sum(a.count for a, _ in dev),
            "top": [f"{a.key[:90]} | {a.count} | {us / 1e3:.2f} ms" for a, us in dev[:12]],
            "host": {a.key: [a.count, a.cpu_time_total / 1e6] for a in avgs if a.key in host}}


def _engine_config(llm) -> dict:
    """What vLLM settled on for ``llm`` (an ``LLM``) that decides its speed: whether the scheduler
    overlaps a step's host work with the previous step's forward, and how the forward runs."""
    c = llm.llm_engine.vllm_config
    cc = c.compilation_config
    # (a property of vLLM 0.33's config, read from the environment when asked: right for the engine
    # core only while the environment is what it was when the core started)
    runner = getattr(c, "use_v2_model_runner", None)
    return {"async_scheduling": c.scheduler_config.async_scheduling, "compile_mode": str(cc.mode),
            "cudagraph_mode": str(cc.cudagraph_mode), "executor": str(c.parallel_config.distributed_executor_backend),
            "model_runner": None if runner is None else ("V2" if runner else "V1")}


def _reported_config(model) -> dict:
    """:func:`_engine_config`'s facts as ``model``'s engine reports them (``info()``, either transport:
    an isolated engine's ``vllm.LLM`` is in its server's process)."""
    from nnvllm.engine.transport import engine_of

    info = engine_of(model).info()
    return {k: info.get(k) for k in ("async_scheduling", "compile_mode", "cudagraph_mode")}


def case(name: str, path: str, shape: str, n: int, T: int, repeats: int, extra: dict) -> dict:
    import torch

    ps = prompts(n)
    L = SHAPES[shape]["layers"]
    res: dict = {}
    gpu_util = 0.6
    if name in ("bare_graphs", "bare_eager", "bare_nocompile", "vllm_lens", "bare_kernels", "bare_profile",
                "bare_nocompile_kernels", "bare_nocompile_profile"):
        profiled = name.endswith(("_kernels", "_profile"))
        if profiled:  # under a profiler: the engine core in this process
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM, SamplingParams

        kw = {"enforce_eager": True} if name == "bare_eager" else {}
        if name.startswith("bare_nocompile"):  # the graphs nnvllm's engine records, without nnsight's runner
            kw = {"compilation_config": {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}}
        llm = LLM(path, dtype="float16", gpu_memory_utilization=gpu_util, **kw)
        extra_args = {"output_residual_stream": list(range(L))} if name == "vllm_lens" else None
        sp = SamplingParams(max_tokens=T, temperature=0.0, ignore_eos=True, extra_args=extra_args)
        if name.endswith("_kernels"):
            k = _kernel_profile(lambda: llm.generate(ps, sp, use_tqdm=False))
            res[name], res[name + "_kernels"] = k.pop("wall"), k
        elif name.endswith("_profile"):
            res[name] = _profiled(lambda: llm.generate(ps, sp, use_tqdm=False))
        else:
            res[name] = _timed(lambda: llm.generate(ps, sp, use_tqdm=False), repeats)
        res[name + "_config"] = _engine_config(llm)
        if name == "vllm_lens":
            out = llm.generate(ps[:1], sp, use_tqdm=False)
            res["vllm_lens_shape"] = list(out[0].activations["residual_stream"].shape)
        return res
    if name.startswith(("nv_graphs", "nv_eager", "nv_isolated", "nv_fp32", "nv_default")):
        mode = name.split("_handover_")[1] if "_handover_" in name else None
        if mode:
            os.environ["NNVLLM_HANDOVER"] = mode  # inherited by the engine's processes
        if name.endswith("_nopieces"):
            os.environ["NNVLLM_TRACE_PIECES"] = "0"  # whole graphs only (as before graph pieces)
        name_kw = name
        if name_kw.endswith("_residgraphs"):
            os.environ["NNVLLM_GRAPH_SITES"] = "resid"  # the graphs copy the residual stream only
            name_kw = name_kw.removesuffix("_residgraphs")
        if name_kw.endswith("_compiled"):
            os.environ["NNVLLM_COMPILE"] = "1"  # vLLM's torch.compile, the taps inside it as opaque ops
            name_kw = name_kw.removesuffix("_compiled")
        import nnvllm as nv
        from nnvllm import capture
        from vllm import SamplingParams

        kw = {} if name_kw == "nv_default" else {"cuda_graphs": "eager" not in name}
        dtype = "float16"
        if name.startswith("nv_fp32"):  # fp32 weights, with and without exact=True (full-precision attention)
            dtype, kw["exact"] = "float32", name == "nv_fp32_exact"
        t = time.perf_counter()
        if name_kw == "nv_default":
            model = nv.load(path, dtype=dtype, gpu_memory_utilization=gpu_util)
        else:
            model = nv.load(path, isolate=name.startswith("nv_isolated"), dtype=dtype,
                            gpu_memory_utilization=gpu_util, **kw)
        res[name + "_load"] = {"seconds": time.perf_counter() - t}  # engine start and graph recording (not a ratio)
        if not getattr(model, "_nnvllm_isolated", False) and not mode:
            sp = SamplingParams(max_tokens=T, temperature=0.0, ignore_eos=True)
            res[name + "_bare"] = _timed(lambda: model.llm.generate(ps, sp, use_tqdm=False), repeats)
            res[name + "_config"] = _engine_config(model.llm)
        res[name] = _timed(lambda: nv.generate(model, ps, max_tokens=T, ignore_eos=True), repeats,
                           snap=lambda: dict(capture._LAST_TIMINGS))
        res[name + "_worker_timings"] = dict(capture._LAST_TIMINGS)  # the last call's
        res[name + "_stats"] = dict(capture._LAST_STATS)  # its engine steps and batch changes (one batch: 1)
        # Tokens and samples only (no activations, no logits): the engine's and the transport's own
        # cost, without the recording and the hand-off (isolated vs in-process: where the gap is).
        res[name + "_tokens"] = _timed(
            lambda: nv.generate(model, ps, max_tokens=T, ignore_eos=True, layers=None, logits=False), repeats)
        run = nv.generate(model, ps[:4], max_tokens=T, ignore_eos=True)
        assert run.resid[0].shape == (L, PROMPT_LEN + T - 1, SHAPES[shape]["d"]), run.resid[0].shape
        if extra.get("save"):
            torch.save({"resid": [r.clone() for r in run.resid], "logits": [x.clone() for x in run.logits],
                        "tokens": run.tokens}, Path(extra["save"]) / f"{name}.pt")
        model.close()
        return res
    if name in ("nv_steer", "nv_steer_eager"):
        import nnvllm as nv
        from nnvllm import capture
        from vllm import SamplingParams

        model = nv.load(path, isolate=False, dtype="float16", gpu_memory_utilization=gpu_util,
                        cuda_graphs=name == "nv_steer")
        g = torch.Generator().manual_seed(0)
        steer = [nv.Edit.add(torch.randn(SHAPES[shape]["d"], generator=g), layers=[L // 2], scale=4.0)]
        sp = SamplingParams(max_tokens=T, temperature=0.0, ignore_eos=True)
        res[name + "_bare"] = _timed(lambda: model.llm.generate(ps, sp, use_tqdm=False), repeats)
        for label, kw in (("tokens", dict(layers=None, logits=False)), ("all", {})):
            res[f"{name}_{label}"] = _timed(
                lambda kw=kw: nv.generate(model, ps, max_tokens=T, ignore_eos=True, **kw), repeats)
            res[f"{name}_{label}_steered"] = _timed(
                lambda kw=kw: nv.generate(model, ps, max_tokens=T, ignore_eos=True, edits=steer, **kw), repeats)
            res[f"{name}_{label}_steered_eager_steps"] = bool(capture._LAST_STATS.get("eager"))
        clean = nv.generate(model, ps[:4], max_tokens=T, ignore_eos=True, layers=[L // 2 + 1], logits=False)
        run = nv.generate(model, ps[:4], max_tokens=T, ignore_eos=True, layers=[L // 2 + 1], logits=False, edits=steer)
        res[name + "_moved"] = float((run.resid[0].float() - clean.resid[0].float()).abs().max())
        model.close()
        return res
    if name in ("paired", "paired_split", "paired_mirror"):
        # Every engine started before any is timed, bare vLLM first (before nnvllm is imported, so
        # nothing of nnsight's is in its process when its engine core starts); then turns.
        from vllm import LLM, SamplingParams

        split = name == "paired_split"
        mirror = name == "paired_mirror"  # a fourth engine: nv.load(path) with the hand-off written as it goes
        share = 0.16 if split else 0.19 if mirror else 0.28
        # Each engine's config is read as it is built: vLLM's config tells the model runner from this
        # process's environment when asked, and the variable changes below and when nnsight is imported.
        bare = LLM(path, dtype="float16", gpu_memory_utilization=share)
        configs = {"bare": _engine_config(bare)}
        sp = SamplingParams(max_tokens=T, temperature=0.0, ignore_eos=True)
        if split:  # vLLM with nnvllm's engine settings (no torch.compile, full graphs for decode only)
            nnvllm_settings = {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}
            settings = LLM(path, dtype="float16", gpu_memory_utilization=share, compilation_config=nnvllm_settings)
            configs["settings"] = _engine_config(settings)
            # The same on vLLM's V1 model runner, the one nnsight instruments (nnvllm's engines set
            # VLLM_USE_V2_MODEL_RUNNER=0; bare vLLM 0.33 runs V2). The engine core takes the variable
            # from this process's environment when it starts.
            was = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
            try:
                v1 = LLM(path, dtype="float16", gpu_memory_utilization=share, compilation_config=nnvllm_settings)
                configs["v1"] = _engine_config(v1)
            finally:
                if was is None:
                    del os.environ["VLLM_USE_V2_MODEL_RUNNER"]
                else:
                    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = was
        import nnvllm as nv

        iso = nv.load(path, dtype="float16", gpu_memory_utilization=share)
        if mirror:  # (its server process reads NNVLLM_HANDOVER as it starts; this process's stays as it was)
            was = os.environ.get("NNVLLM_HANDOVER")
            os.environ["NNVLLM_HANDOVER"] = "mirror"
            try:
                iso_mirror = nv.load(path, dtype="float16", gpu_memory_utilization=share)
            finally:
                if was is None:
                    del os.environ["NNVLLM_HANDOVER"]
                else:
                    os.environ["NNVLLM_HANDOVER"] = was
        inproc = nv.load(path, isolate=False, dtype="float16", gpu_memory_utilization=share)
        res[f"{name}_config"] = {**configs, "in_process": _engine_config(inproc.llm),
                                 "isolated_is_isolated": bool(getattr(iso, "_nnvllm_isolated", False)),
                                 "isolated": _reported_config(iso)}
        forms = {"bare": lambda: bare.generate(ps, sp, use_tqdm=False)}
        if split:
            forms["settings"] = lambda: settings.generate(ps, sp, use_tqdm=False)
            forms["v1"] = lambda: v1.generate(ps, sp, use_tqdm=False)
            forms["own"] = lambda: inproc.llm.generate(ps, sp, use_tqdm=False)  # nnvllm's engine, nothing kept
        forms["default"] = lambda: nv.generate(iso, ps, max_tokens=T, ignore_eos=True)
        if mirror:
            forms["mirror"] = lambda: nv.generate(iso_mirror, ps, max_tokens=T, ignore_eos=True)
        forms["in_process"] = lambda: nv.generate(inproc, ps, max_tokens=T, ignore_eos=True)
        for fn in forms.values():
            fn()  # warm-up
        from nnvllm import capture

        labels = list(forms)
        times: dict[str, list[float]] = {label: [] for label in labels}
        per_call: dict[str, list[dict]] = {label: [] for label in ("default", "mirror", "in_process") if label in forms}  # nnvllm's timings
        from nnvllm.engine.heap import gc_delta, gc_pauses

        bare_gc: list[dict] = []  # this process's collection pauses in each bare call (its client's)
        for turn in range(repeats):
            k = turn % len(labels)
            for label in labels[k:] + labels[:k]:
                gc0 = gc_pauses()
                t = time.perf_counter()
                forms[label]()
                times[label].append(time.perf_counter() - t)
                if label in per_call:
                    per_call[label].append(dict(capture._LAST_TIMINGS))
                elif label == "bare":
                    bare_gc.append(gc_delta(gc0))
            # (on stderr as it goes: a case cut at its timeout still shows its turns)
            print(f"{name} turn {turn}: " + " ".join(f"{k} {v[-1]:.3f}" for k, v in times.items()),
                  file=sys.stderr, flush=True)
        summary = {}
        for label, ts in times.items():
            med = statistics.median(ts)
            res[f"{name}_{label}"] = {"median": med, "all": ts}
            if label in per_call:
                res[f"{name}_{label}"]["per_call"] = per_call[label]
            summary[f"spread {label}"] = max(abs(x / med - 1) for x in ts)
            if label != "bare":
                ratios = [x / b for x, b in zip(ts, times["bare"])]
                summary[f"x bare {label}"] = statistics.median(ratios)
                summary[f"interval x bare {label}"] = median_interval(ratios)
                # A shared host's noise only adds time, so the fastest calls come closest to each
                # engine's own cost: steadier from run to run than the per-turn median on such a host.
                summary[f"x bare fastest {label}"] = min(ts) / min(times["bare"])
        if split:  # each step of the gap, per turn: settings, V1, nnvllm's engine, the capture, the isolation
            for a, b in (("settings", "bare"), ("v1", "settings"), ("own", "v1"), ("own", "settings"),
                         ("in_process", "own"), ("default", "in_process")):
                summary[f"x {b} {a}"] = statistics.median(x / y for x, y in zip(times[a], times[b]))
                summary[f"fastest x {b} {a}"] = min(times[a]) / min(times[b])
        if mirror:
            summary["x default mirror"] = statistics.median(x / y for x, y in zip(times["mirror"], times["default"]))
            summary["fastest x default mirror"] = min(times["mirror"]) / min(times["default"])
            iso_mirror.close()
        res[f"{name}_summary"] = summary
        res[f"{name}_bare_gc"] = bare_gc
        iso.close()
        inproc.close()
        return res
    if name in ("nv_split", "nv_split_profile", "nv_split_kernels"):
        # Where nv.generate's cost over the engine's own generate goes, on one in-process graph engine:
        # the engine's generate with text prompts (``bare``) and with token ids (what nv.generate
        # sends, ``ids``), nv.generate keeping only tokens and samples (``tokens``), and keeping
        # every layer and the logits (``all``), in turns, so that a drift over the run (clocks, a
        # background thread after the start) falls on every form alike. ``nv_split_profile`` runs the
        # engine core in this process and profiles one call of each form (cProfile, worker included).
        from vllm import SamplingParams

        if name in ("nv_split_profile", "nv_split_kernels"):
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        import nnvllm as nv

        model = nv.load(path, isolate=False, dtype="float16", gpu_memory_utilization=gpu_util)
        res[name + "_config"] = _engine_config(model.llm)
        sp = SamplingParams(max_tokens=T, temperature=0.0, ignore_eos=True)
        ids = [{"prompt_token_ids": model.tokenizer(p)["input_ids"]} for p in ps]
        forms = {"bare": lambda: model.llm.generate(ps, sp, use_tqdm=False),
                 "ids": lambda: model.llm.generate(ids, sp, use_tqdm=False),
                 "tokens": lambda: nv.generate(model, ps, max_tokens=T, ignore_eos=True, layers=None, logits=False),
                 "layers": lambda: nv.generate(model, ps, max_tokens=T, ignore_eos=True, logits=False),
                 "logits": lambda: nv.generate(model, ps, max_tokens=T, ignore_eos=True, layers=None),
                 "all": lambda: nv.generate(model, ps, max_tokens=T, ignore_eos=True)}
        if name in ("nv_split_profile", "nv_split_kernels"):
            for label, fn in forms.items():
                if name == "nv_split_profile":
                    res[f"{name}_{label}"] = _profiled(fn)
                else:
                    k = _kernel_profile(fn)
                    res[f"{name}_{label}"], res[f"{name}_{label}_kernels"] = k.pop("wall"), k
            model.close()
            return res
        for fn in forms.values():
            fn()  # warm-up
        from nnvllm import capture

        times: dict[str, list[float]] = {label: [] for label in forms}
        calls: dict[str, list[dict]] = {label: [] for label in forms}  # nv.generate's timings of each call
        from nnvllm.engine.heap import gc_delta, gc_pauses

        for _ in range(repeats):
            for label, fn in forms.items():
                capture._LAST_TIMINGS.clear()
                gc0 = gc_pauses()
                t = time.perf_counter()
                fn()
                times[label].append(time.perf_counter() - t)
                calls[label].append(dict(capture._LAST_TIMINGS, **gc_delta(gc0, "process_")))
        for label, ts in times.items():
            res[f"{name}_{label}"] = {"median": statistics.median(ts), "all": ts,
                                      "per_call": calls[label]}
        model.close()
        return res
    if name in ("nv_trace", "nv_trace_nopieces", "nv_trace_profile", "nv_trace_isolated"):
        # An nnsight trace reading every block's output at every step, one invoke per prompt (as the
        # nnsight_taps case), on the in-process graph engine: with the graph pieces (the default) or
        # with them off (NNVLLM_TRACE_PIECES=0: every traced step eager); beside nv.generate keeping
        # the same (every block's output at every position, no logits) on the same engine.
        if name == "nv_trace_nopieces":
            os.environ["NNVLLM_TRACE_PIECES"] = "0"
        if name == "nv_trace_profile":  # the engine core in this process, so cProfile sees the worker too
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        import nnvllm as nv

        isolated = name == "nv_trace_isolated"  # (nv.load's default on a GPU: its saves reach the client packed)
        model = nv.load(path, isolate=isolated, dtype="float16", gpu_memory_utilization=gpu_util)
        blocks = model.model.layers if SHAPES[shape]["kind"] == "llama" else model.transformer.h
        from nnvllm.engine.heap import gc_delta, gc_pauses

        gc_last = [gc_pauses()]

        def modes():  # after each call: its step modes, and this process's collection pauses in it
            out = {} if isolated else (  # (an isolated engine's workers are the server's to ask)
                model.llm.collective_rpc("nnvllm_step_modes", kwargs={"reset": True})[0])
            out.update(gc_delta(gc_last[0], "client_"))
            gc_last[0] = gc_pauses()
            return out

        def trace_run(k):
            with model.trace(temperature=0.0, max_tokens=T, ignore_eos=True) as tracer:
                for p in ps[:k]:
                    with tracer.invoke(p):
                        steps = list().save()
                        for _ in tracer.iter[:T]:
                            outs = [blocks[i].output for i in range(L)]  # each block's output read once
                            steps.append(torch.stack([o[0] if isinstance(o, tuple) else o for o in outs]))
            return steps

        def logits_run(k):  # the same trace reading only the logits: nnsight's per-invoke cost, no block read
            with model.trace(temperature=0.0, max_tokens=T, ignore_eos=True) as tracer:
                for p in ps[:k]:
                    with tracer.invoke(p):
                        steps = list().save()
                        for _ in tracer.iter[:T]:
                            steps.append(model.logits.argmax(-1))
            return steps

        if name == "nv_trace_profile":  # 1 and 8 prompts: nv.generate, the trace, the logits-only trace
            for k in (1, 8):
                for label, fn in (("generate", lambda k=k: nv.generate(model, ps[:k], max_tokens=T,
                                                                        ignore_eos=True, logits=False)),
                                  ("trace", lambda k=k: trace_run(k)), ("logits_only", lambda k=k: logits_run(k))):
                    res[f"{name}_{k}_{label}"] = _profiled(fn)
            model.close()
            return res
        # nnsight runs one worker per invoke, in Python, at every location it reads: its cost grows with
        # the prompts, the forward's does not; so batches of 1 and 8 prompts (and --prompts, once).
        for k in dict.fromkeys((1, min(8, n))):
            res[f"{name}_{k}_generate"] = _timed(
                lambda k=k: nv.generate(model, ps[:k], max_tokens=T, ignore_eos=True, logits=False), repeats)
            modes()
            res[f"{name}_{k}"] = _timed(lambda k=k: trace_run(k), repeats, snap=modes)
            res[f"{name}_{k}_logits_only"] = _timed(lambda k=k: logits_run(k), repeats, snap=modes)
        if n > 8:  # (at most 8: measured above, repeated)
            res[f"{name}_{n}_generate"] = _timed(
                lambda: nv.generate(model, ps, max_tokens=T, ignore_eos=True, logits=False), 1)
            modes()
            res[f"{name}_{n}"] = _timed(lambda: trace_run(n), 0, snap=modes)
            res[f"{name}_{n}"]["median"] = res[f"{name}_{n}"]["first"]
        model.close()
        return res
    if name == "hf_nnsight":
        from nnsight import LanguageModel
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path)
        hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float16).cuda()
        lm = LanguageModel(hf, tokenizer=tok)
        blocks = lm.model.layers if SHAPES[shape]["kind"] == "llama" else lm.transformer.h

        def hf_run():
            with lm.generate(ps, max_new_tokens=T, do_sample=False, min_new_tokens=T,
                             pad_token_id=tok.eos_token_id) as tracer:
                steps = list().save()
                for _ in tracer.all():
                    outs = [blocks[i].output for i in range(L)]  # each block's output read once
                    steps.append(torch.stack([o[0] if isinstance(o, tuple) else o for o in outs]))
        res[name] = _timed(hf_run, repeats)
        return res
    if name == "nnsight_taps":
        from nnsight.modeling.vllm import VLLM

        tap = "model.layers.*.output" if SHAPES[shape]["kind"] == "llama" else "transformer.h.*.output"
        m = VLLM(path, dispatch=True, taps=[tap], dtype="float16", gpu_memory_utilization=gpu_util)
        blocks = m.model.layers if SHAPES[shape]["kind"] == "llama" else m.transformer.h

        def taps_run():
            with m.trace(temperature=0.0, max_tokens=T, ignore_eos=True) as tracer:
                for p in ps:
                    with tracer.invoke(p):
                        steps = list().save()
                        for _ in tracer.all():
                            outs = [blocks[i].output for i in range(L)]  # each block's output read once
                            steps.append(torch.stack([o[0] if isinstance(o, tuple) else o for o in outs]))
        res[name] = _timed(taps_run, 1)
        return res
    if name == "big":
        import resource

        import nnvllm as nv
        from vllm import SamplingParams

        model = nv.load(path, isolate=False, dtype="float16", gpu_memory_utilization=gpu_util, cuda_graphs=True)
        sp = SamplingParams(max_tokens=T, temperature=0.0, ignore_eos=True)
        bare = _timed(lambda: model.llm.generate(ps, sp, use_tqdm=False), 1)
        out = Path(extra["disk"]) / "collect"
        import shutil

        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        t = time.perf_counter()
        ds = nv.collect(model, ps, out, max_tokens=T, ignore_eos=True, memory_budget=extra["budget"], progress=False)
        dt = time.perf_counter() - t
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        size = sum(f.stat().st_size for f in out.iterdir())
        shards = [len(s["requests"]) for s in json.loads((out / "index.json").read_text())["shards"]]
        sched = model.llm.llm_engine.vllm_config
        res["big"] = {"bare": bare["median"], "collect": dt, "ratio": dt / bare["median"], "bytes_on_disk": size,
                      "requests": len(ds), "peak_rss_gib": peak, "rss_before_gib": rss0, "budget": extra["budget"],
                      "shard_requests": shards, "max_num_seqs": sched.scheduler_config.max_num_seqs,
                      "max_cudagraph_capture_size": sched.compilation_config.max_cudagraph_capture_size}
        shutil.rmtree(out, ignore_errors=True)
        # The same collect in chunks of a given size, beside bare generate in the same chunks (what
        # the chunking alone costs) and nv.generate in them with nothing written (capture without disk).
        for b in [int(x) for x in extra.get("big_batches", "").split(",") if x]:
            chunks = [ps[i:i + b] for i in range(0, len(ps), b)]
            t = time.perf_counter()
            for c in chunks:
                model.llm.generate(c, sp, use_tqdm=False)
            bare_b = time.perf_counter() - t
            t = time.perf_counter()
            for c in chunks:
                nv.generate(model, c, max_tokens=T, ignore_eos=True, logits=False)
            gen_b = time.perf_counter() - t
            t = time.perf_counter()
            nv.collect(model, ps, out, max_tokens=T, ignore_eos=True, batch_size=b, progress=False)
            dt = time.perf_counter() - t
            res[f"big_batch_{b}"] = {"collect": dt, "ratio": dt / bare["median"], "bare_chunked": bare_b,
                                     "generate_chunked": gen_b}
            shutil.rmtree(out, ignore_errors=True)
        res["big"]["bare_again"] = _timed(lambda: model.llm.generate(ps, sp, use_tqdm=False), 1)["median"]
        model.close()
        return res
    raise ValueError(name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama1b")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cases", default="bare_graphs,bare_eager,nv_graphs,nv_eager,nv_isolated,vllm_lens,hf_nnsight,nnsight_taps")
    ap.add_argument("--big", type=int, default=0)
    ap.add_argument("--budget", default="4GB")
    ap.add_argument("--big-batches", default="", help="with --big: also collect with these batch_size values "
                    "(comma-separated), each timed against the same bare run")
    ap.add_argument("--root", default="/tmp/nnvllm-bench")
    ap.add_argument("--timeout", type=float, default=240)
    ap.add_argument("--out", default=None, help="result file (default benchmarks/results/capture_gpu_<machine>.json)")
    ap.add_argument("--name", default=None, help="the run's name in that file (default: the shape, or 'big' with --big)")
    ap.add_argument("--all", action="store_true", help="Llama-1B 64x128 and GPT-2-small 64x32, every case, "
                    "then 1,024x128 streamed to disk")
    ap.add_argument("--table", default=None, metavar="RUN",
                    help="print recorded run RUN (of --out's file) as a markdown table, and run nothing")
    ap.add_argument("--case", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--path", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.table:
        runs = json.loads(result_path("capture_gpu", args.out).read_text())["runs"]
        print(table(runs[args.table]))
        return
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    if args.all:
        return run_all(args)
    extra = {"save": str(root), "disk": str(root), "budget": args.budget, "big_batches": args.big_batches}
    if args.case:  # child
        res = case(args.case, args.path, args.shape, args.prompts, args.tokens, args.repeats, extra)
        print("RESULT " + json.dumps(res), flush=True)
        return
    prov = provenance()
    name = args.name or ("big" if args.big else args.shape)
    path = build(args.shape, root)
    cases = ["big"] if args.big else [c for c in args.cases.split(",") if c]
    n = args.big or args.prompts
    out = {"shape": args.shape, "shape_args": SHAPES[args.shape], "prompts": n, "tokens": args.tokens,
           "prompt_len": PROMPT_LEN, "repeats": args.repeats, "cases": cases, "seconds": {}, "errors": {}}
    for c in cases:
        env = dict(os.environ)
        if c != "vllm_lens":
            env["VLLM_PLUGINS"] = ""  # vllm-lens loads into every vLLM process otherwise
        cmd = [sys.executable, __file__, "--case", c, "--path", path, "--shape", args.shape, "--prompts", str(n),
               "--tokens", str(args.tokens), "--repeats", str(args.repeats), "--root", args.root, "--budget", args.budget,
               "--big-batches", args.big_batches]
        t = time.perf_counter()
        try:
            p = _run_case(cmd, env, args.timeout)
            lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
            if lines:
                for k, v in json.loads(lines[-1][7:]).items():
                    out["seconds"][k] = v["median"] if isinstance(v, dict) and "median" in v else v
                    if isinstance(v, dict) and "all" in v:  # every timed call, and its timings
                        out.setdefault("all", {})[k] = v["all"]
                        if "per_call" in v:
                            out.setdefault("per_call", {})[k] = v["per_call"]
                    if isinstance(v, dict) and "tottime" in v:  # a profiled call (the *_profile cases)
                        out.setdefault("profiles", {})[k] = {key: v[key] for key in ("tottime", "cumulative", "ours", "syncs", "step") if key in v}
            else:
                out["errors"][c] = (p.stderr or p.stdout)[-3000:]
        except subprocess.TimeoutExpired as e:
            out["errors"][c] = f"timed out after {args.timeout} s: " + str((e.stderr or b"")[-2000:])
        except _Interrupted as e:  # cut by the command's limit: what the case printed so far is kept
            out["errors"][c] = f"interrupted after {time.perf_counter() - t:.0f} s: " + e.stderr[-3000:]
            print(f"recorded as run {name!r} in {record('capture_gpu', name, out, args.out, prov)}", flush=True)
            raise SystemExit(130) from None
        print(f"{c}: {time.perf_counter() - t:.1f} s wall; {out['seconds']}", flush=True)
        _ratios(out)
        record("capture_gpu", name, out, args.out, prov)
    # graphs vs eager capture: the same numbers? (only files this run wrote: --root outlives a run)
    a, b = root / "nv_graphs.pt", root / "nv_eager.pt"
    if {"nv_graphs", "nv_eager"} <= set(cases) and a.exists() and b.exists():
        import torch

        ga, gb = torch.load(a), torch.load(b)
        out["graphs_vs_eager"] = {
            "tokens_equal": ga["tokens"] == gb["tokens"],
            "resid_max_abs": max(float((x.float() - y.float()).abs().max()) for x, y in zip(ga["resid"], gb["resid"])),
            "logits_max_abs": max(float((x - y).abs().max()) for x, y in zip(ga["logits"], gb["logits"])),
        }
    _ratios(out)
    print(json.dumps({k: out[k] for k in ("seconds", "ratios") if k in out}, indent=1))
    print(f"recorded as run {name!r} in {record('capture_gpu', name, out, args.out, prov)}")


class _Interrupted(Exception):
    """A case stopped by an interrupt of this command (its ``stderr`` so far)."""

    def __init__(self, stderr: str) -> None:
        super().__init__("interrupted")
        self.stderr = stderr


def _run_case(cmd: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
    """One case in its own process group, killed whole at ``timeout``: a case's engine processes
    would otherwise outlive it and hold the GPU memory the next case needs."""
    import signal

    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except (subprocess.TimeoutExpired, KeyboardInterrupt) as e:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        if isinstance(e, KeyboardInterrupt):  # this command's own limit (gpu_lane.sh's STAGE_TIMEOUT)
            raise _Interrupted(err or "") from None
        raise subprocess.TimeoutExpired(cmd, timeout, output=out, stderr=(err or "").encode()) from None
    try:
        os.killpg(p.pid, signal.SIGKILL)  # whatever it left running
    except ProcessLookupError:
        pass
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def table(run: dict) -> str:
    """One recorded run as a markdown table: each timed case's seconds, and its ratio to bare vLLM's
    default run (``bare_graphs``) where the run has it; headed by the run's command, vLLM and date."""
    s = {k: v for k, v in run.get("seconds", {}).items() if isinstance(v, float)}
    bare = s.get("bare_graphs")
    lines = [f"`{run.get('command', '?')}` (vLLM {run.get('vllm', '?')}, {run.get('machine', '?')}, "
             f"{str(run.get('date', '?'))[:10]})", ""]
    for case in ("paired", "paired_split", "paired_mirror"):
        paired = run.get("seconds", {}).get(f"{case}_summary")
        if not paired:
            continue
        # the paired cases: each engine's median, its turns' median ratio to bare, its spread
        # and the 95% interval of that median ratio, from the turns' ratios (recorded runs keep every call)
        calls = run.get("all", {})
        lines += ["| engine | seconds | x bare, per turn | 95% interval | spread | x bare, fastest calls |",
                  "|---|---|---|---|---|---|"]
        for label in ("bare", "settings", "v1", "own", "default", "mirror", "in_process"):
            if f"spread {label}" in paired:
                ratio, span, fastest = paired.get(f"x bare {label}", 1.0), "", ""
                if f"{case}_{label}" in calls:
                    mine, bare_calls = calls[f"{case}_{label}"], calls[f"{case}_bare"]
                    fastest = f"{min(mine) / min(bare_calls):.2f}"
                    if label != "bare":
                        got = median_interval([x / b for x, b in zip(mine, bare_calls)])
                        span = f"{got[0]:.2f}–{got[1]:.2f}" if got else ""
                lines.append(f"| `{label}` | {s[f'{case}_{label}']:.3f} | {ratio:.2f} | {span} | "
                             f"±{100 * paired[f'spread {label}']:.0f}% | {fastest} |")
        return "\n".join(lines)
    lines += ["| case | seconds | x bare_graphs |", "|---|---|---|"] if bare else ["| case | seconds |", "|---|---|"]
    for k, v in s.items():
        lines.append(f"| `{k}` | {v:.3f} | {v / bare:.2f} |" if bare else f"| `{k}` | {v:.3f} |")
    return "\n".join(lines)


def run_all(args) -> None:
    """``--all``: the three workloads, each one run of this script (its cases in their own processes),
    each recorded in the same result file under its own name."""
    out = str(result_path("capture_gpu", args.out))
    plan = [("llama1b", ["--shape", "llama1b", "--prompts", "64", "--tokens", "128", "--cases", ALL_CASES["llama1b"]]),
            ("gpt2s", ["--shape", "gpt2s", "--prompts", "64", "--tokens", "32", "--cases", ALL_CASES["gpt2s"]]),
            ("big", ["--shape", "llama1b", "--big", "1024", "--tokens", "128"])]
    for name, argv in plan:
        cmd = [sys.executable, __file__, *argv, "--repeats", str(args.repeats), "--root", args.root,
               "--budget", args.budget, "--timeout", str(args.timeout), "--name", name, "--out", out]
        print("==", name, " ".join(cmd[1:]), flush=True)
        subprocess.run(cmd)
    print(f"recorded in {out}")


def _ratios(out: dict) -> None:
    s = out["seconds"]
    r = {}
    for base in ("bare_graphs", "bare_eager"):
        if isinstance(s.get(base), float):
            r[f"x {base}"] = {k: v / s[base] for k, v in s.items() if isinstance(v, float)}
    if isinstance(s.get("nv_isolated"), float) and isinstance(s.get("nv_graphs"), float):
        r["isolated / in-process"] = s["nv_isolated"] / s["nv_graphs"]
        a, b = out.get("all", {}).get("nv_isolated"), out.get("all", {}).get("nv_graphs")
        if a and b:
            r["isolated / in-process, fastest calls"] = min(a) / min(b)
    if isinstance(s.get("nv_isolated_tokens"), float) and isinstance(s.get("nv_graphs_tokens"), float):
        r["isolated / in-process, tokens only"] = s["nv_isolated_tokens"] / s["nv_graphs_tokens"]
    if isinstance(s.get("nv_isolated_eager"), float) and isinstance(s.get("nv_eager"), float):
        r["isolated / in-process, eager"] = s["nv_isolated_eager"] / s["nv_eager"]
    for k, v in s.items():
        if k.startswith("nv_trace") and not k.endswith("_generate") and isinstance(v, float):
            g = s.get(k + "_generate")
            if isinstance(g, float):
                r[f"trace / generate {k}"] = v / g
                a, b = out.get("all", {}).get(k), out.get("all", {}).get(k + "_generate")
                if a and b:
                    r[f"trace / generate, fastest calls {k}"] = min(a) / min(b)
    for c in ("nv_steer", "nv_steer_eager"):
        for label in ("tokens", "all"):
            a, b = s.get(f"{c}_{label}_steered"), s.get(f"{c}_{label}")
            if isinstance(a, float) and isinstance(b, float):
                r[f"steer {c} {label}"] = a / b
    out["ratios"] = r


if __name__ == "__main__":
    main()
