"""fp32 on the GPU: where vLLM's gap to transformers comes from, layer by layer.

    python benchmarks/fp32_gpu.py [--out FILE] [--variants a,b,...] [--jobs 4] [--timeout 150]
    python benchmarks/fp32_gpu.py --cpu-smoke          # here, no GPU: transformers CPU vs the CPU vLLM engine

For the embedded toy GPT-2 and a tiny random Llama (``nnvllm.testing.tiny_checkpoint``), 3 prompts,
4 greedy tokens (``ignore_eos``), it measures max|Δ| per layer of each block's output (the residual
stream), of each block's attention and MLP outputs, and of the logits at every step, between:

- ``hf_cpu``: transformers on the CPU, fp32 — the reference (a);
- ``hf_gpu``: transformers on the GPU, fp32, TF32 off (torch's default) (b);
- ``hf_gpu_tf32``: transformers on the GPU with TF32 matmuls/convolutions on (c);
- ``vllm_*``: nnvllm's vLLM engine at ``dtype="float32"`` (d) and variants of it. vLLM's settings are
  process-global, so each variant runs in its own process (its own process group, killed at
  ``--timeout``); a variant that fails records its error and the others go on.

vLLM variants (vLLM 0.26; where each knob lives in its source is noted):

- ``vllm_default``: ``nv.load(path, isolate=False, dtype="float32", gpu_memory_utilization=0.3)``
  (+ ``kv_cache_memory_bytes`` = 1 GiB, which skips vLLM's memory profiling so that variants can
  start side by side on one GPU; it does not change any kernel).
- ``vllm_tf32_override0``: env ``NVIDIA_TF32_OVERRIDE=0`` (cuBLAS/cuDNN never use TF32).
- ``vllm_triton_ieee``: env ``TRITON_F32_DEFAULT=ieee``: Triton's ``tl.dot`` on fp32 defaults to
  TF32 unless a kernel asks otherwise, and vLLM's unified Triton attention
  (``v1/attention/ops/triton_unified_attention.py``) calls ``tl.dot(Q, K)`` with no precision.
- ``vllm_attn_flex`` / ``vllm_attn_flash`` / ``vllm_attn_flashinfer``: engine argument
  ``attention_backend`` (= ``attention_config={"backend": ...}``). In 0.26 TRITON_ATTN and
  FLEX_ATTENTION list float32 in ``supported_dtypes``; FLASH_ATTN and FLASHINFER do not, so those two
  are expected to refuse at engine start (recorded as errors, which is the point).
- ``vllm_native_ops``: ``compilation_config={"custom_ops": ["none"]}`` (vLLM's CUDA custom ops —
  activation, rotary, ... — replaced by their torch ``forward_native``) and
  ``ir_op_priority={"rms_norm": ["native"], "fused_add_rms_norm": ["native"]}`` (0.26 dispatches
  RMSNorm through its IR ops, defaulting to the ``vllm_c`` kernel in eager mode).
- ``vllm_matmul_high``: env ``VLLM_FLOAT32_MATMUL_PRECISION=high``. vLLM's GPU worker calls
  ``torch.set_float32_matmul_precision`` with this variable, default ``"highest"``
  (``v1/worker/gpu_worker.py``), so the default run already is "highest"; "high" (TF32 in torch
  matmuls) shows how much cuBLAS TF32 alone would add.
- ``vllm_exact``: ``TRITON_F32_DEFAULT=ieee`` + native ops + ``NVIDIA_TF32_OVERRIDE=0`` together.
- ``vllm_eager``: ``cuda_graphs=False`` (nnvllm's GPU engine otherwise replays CUDA graphs for decode
  steps; the kernels are the same, so this should change nothing — a check, not a suspect).
  The last two are not in the default set; name them in ``--variants``.

vLLM generates freely (greedy); transformers replays hf_cpu's tokens. Positions are compared up to
the first generated token where a run differs from hf_cpu (recorded as ``tokens_agree``).
Records, per variant and model, per-layer max|Δ| vs hf_cpu and vs hf_gpu as one run of
``benchmarks/results/fp32_gpu_<machine>.json`` (or ``--out``; the run is named ``default`` for the
default variants, else by the variants' names, ``cpu smoke`` with ``--cpu-smoke``), with the command,
commit, vLLM version and date (``benchmarks/provenance.py``), and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from nnvllm.testing import TF32

sys.path.insert(0, str(Path(__file__).parent))
from provenance import provenance, record

PROMPTS = ["The capital of France is", "The Eiffel Tower is in the city of", "Paris is the capital of"]
MAX_TOKENS = 4
SITES = ("attn", "mlp")
ROOT = Path(__file__).resolve().parents[1]

_NATIVE = {
    "compilation_config": {"custom_ops": ["none"]},
    "ir_op_priority": {"rms_norm": ["native"], "fused_add_rms_norm": ["native"]},
}
# name -> (extra environment, extra engine arguments)
VARIANTS: dict[str, tuple[dict, dict]] = {
    "vllm_default": ({}, {}),
    "vllm_tf32_override0": ({"NVIDIA_TF32_OVERRIDE": "0"}, {}),
    "vllm_triton_ieee": ({"TRITON_F32_DEFAULT": "ieee"}, {}),
    "vllm_attn_flex": ({}, {"attention_backend": "FLEX_ATTENTION"}),
    "vllm_attn_flash": ({}, {"attention_backend": "FLASH_ATTN"}),
    "vllm_attn_flashinfer": ({}, {"attention_backend": "FLASHINFER"}),
    "vllm_native_ops": ({}, _NATIVE),
    "vllm_matmul_high": ({"VLLM_FLOAT32_MATMUL_PRECISION": "high"}, {}),
    "vllm_exact": ({"TRITON_F32_DEFAULT": "ieee", "NVIDIA_TF32_OVERRIDE": "0"}, _NATIVE),
    "vllm_eager": ({}, {"cuda_graphs": False}),
}
DEFAULT_VARIANTS = [v for v in VARIANTS if v not in ("vllm_exact", "vllm_eager")]  # 8 engines' worth


# ----------------------------------------------------------------------------- worker (one variant)

def _worker(spec_path: str) -> None:
    """Run one vLLM variant on every model; save each model's capture as soon as it exists."""
    import torch

    spec = json.loads(Path(spec_path).read_text())
    out = Path(spec["out_dir"])
    import nnvllm as nv

    diag = {k: os.environ.get(k) for k in ("NVIDIA_TF32_OVERRIDE", "TRITON_F32_DEFAULT", "VLLM_FLOAT32_MATMUL_PRECISION")}
    try:  # what this Triton makes of TRITON_F32_DEFAULT (knobs exist in Triton >= 3.3)
        import triton

        diag["triton"] = triton.__version__
        diag["triton_fp32_default"] = str(triton.knobs.language.fp32_default)
    except Exception as e:  # noqa: BLE001 - a diagnostic only
        diag["triton_fp32_default"] = f"unreadable ({type(e).__name__})"

    for name, path in spec["models"].items():
        t0 = time.perf_counter()
        try:
            model = nv.load(path, isolate=False, **spec["engine_args"])
            try:
                run = nv.generate(model, spec["prompts"], max_tokens=spec["max_tokens"], ignore_eos=True,
                                  sites=tuple(spec["sites"]))
            finally:
                model.close()
            torch.save({"tokens": run.tokens, "prompt_ids": run.prompt_ids, "resid": run.resid,
                        "logits": run.logits, "sites": run.sites, "seconds": time.perf_counter() - t0,
                        "meta": {k: str(v) for k, v in run.meta.items()}, "diag": diag},
                       out / f"{spec['variant']}.{name}.pt")
        except Exception as e:  # noqa: BLE001 - recorded, and the next model still runs
            (out / f"{spec['variant']}.{name}.err").write_text(f"{type(e).__name__}: {e}"[-3000:])
            print(f"[{spec['variant']}/{name}] failed: {type(e).__name__}: {e}", flush=True)


# ----------------------------------------------------------------------------- transformers side

def _hf_capture(path: str, prompts, tokens, device: str):
    """nv.reference on ``device`` replaying ``tokens`` (None: generate greedily), as a plain dict."""
    import nnvllm as nv

    run = nv.reference(path, prompts, max_tokens=MAX_TOKENS, ignore_eos=True, sites=SITES, tokens=tokens,
                       device=device)
    return {"tokens": run.tokens, "prompt_ids": run.prompt_ids, "resid": run.resid, "logits": run.logits,
            "sites": run.sites}




# ----------------------------------------------------------------------------- comparison

def _compare(run: dict, ref: dict) -> dict:
    """Per-layer max|Δ| (resid and sites) over the positions both runs fed the same tokens, and logits."""
    n_layers = ref["resid"][0].shape[0]
    per = {k: [0.0] * n_layers for k in ("resid", *SITES)}
    ref_absmax = [0.0] * n_layers
    logits, agree, compared = 0.0, True, []
    for i in range(len(ref["tokens"])):
        assert run["prompt_ids"][i] == ref["prompt_ids"][i], "different tokenisation"
        a, b = run["tokens"][i], ref["tokens"][i]
        k = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        agree &= a == b
        n = len(ref["prompt_ids"][i]) + k  # positions whose whole input prefix is the same
        n = min(n, ref["resid"][i].shape[1], run["resid"][i].shape[1])
        compared.append(n)
        for key in list(per):
            x = run["resid"][i] if key == "resid" else run["sites"][key][i]
            y = ref["resid"][i] if key == "resid" else ref["sites"][key][i]
            d = (x[:, :n].float() - y[:, :n].float()).abs().amax(dim=(1, 2))
            per[key] = [max(p, float(v)) for p, v in zip(per[key], d)]
        ref_absmax = [max(p, float(v)) for p, v in zip(ref_absmax, ref["resid"][i][:, :n].abs().amax(dim=(1, 2)))]
        steps = min(k + 1, run["logits"][i].shape[0], ref["logits"][i].shape[0])  # step t sees tokens[:t]
        if steps:
            logits = max(logits, float((run["logits"][i][:steps] - ref["logits"][i][:steps]).abs().max()))
    return {"resid": per["resid"], **{k: per[k] for k in SITES}, "logits": logits, "tokens_agree": agree,
            "positions_compared": compared, "ref_resid_absmax": ref_absmax}


# ----------------------------------------------------------------------------- driver

def _versions() -> dict:
    import importlib

    out = {}
    for m in ("torch", "vllm", "nnsight", "transformers", "triton"):
        try:
            out[m] = getattr(importlib.import_module(m), "__version__", "?")
        except Exception as e:  # noqa: BLE001 - a version we cannot read is reported, not fatal
            out[m] = f"missing ({type(e).__name__})"
    import torch

    out["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return out


def _start(variant: str, env_extra: dict, engine_args: dict, models: dict, work: Path, cpu: bool):
    spec = {"variant": variant, "models": models, "prompts": PROMPTS, "max_tokens": MAX_TOKENS,
            "sites": list(SITES), "out_dir": str(work), "engine_args": {"dtype": "float32", **engine_args}}
    if not cpu:
        spec["engine_args"] = {"gpu_memory_utilization": 0.3, "kv_cache_memory_bytes": 2**30, **spec["engine_args"]}
    (work / f"{variant}.json").write_text(json.dumps(spec))
    env = {**os.environ, "VLLM_PLUGINS": "", "TOKENIZERS_PARALLELISM": "false", **env_extra}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    log = open(work / f"{variant}.log", "w")  # noqa: SIM115 - closed when the variant ends
    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker", str(work / f"{variant}.json")],
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)
    return proc, log, time.monotonic()


def _kill(proc) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _backend_from_log(text: str) -> str | None:
    import re

    m = re.findall(r"Using (?:AttentionBackendEnum\.)?([A-Z_]+) (?:attention )?backend", text)
    return m[-1] if m else None


def _log_errors(text: str) -> list[str]:
    """The last few lines of a variant's log that say why an engine refused (the root cause of
    "Engine core initialization failed" is printed by the engine process, not raised)."""
    keys = ("Error", "not valid", "Reason", "not supported", "Unsupported")
    return [ln.strip()[:400] for ln in text.splitlines() if any(k in ln for k in keys)][-6:]


def _run_variants(names, models, work: Path, jobs: int, timeout: float, budget: float, cpu: bool,
                  while_waiting=None) -> dict:
    """Run the vLLM variants, ``jobs`` at a time; call ``while_waiting()`` once after the first starts."""
    t_start = time.monotonic()
    pending, running, results = list(names), {}, {}
    waited = while_waiting is None
    while pending or running:
        while pending and len(running) < jobs:
            name = pending.pop(0)
            if time.monotonic() - t_start > budget:
                results[name] = {"status": "skipped", "error": f"not started: --budget {budget:.0f}s spent"}
                continue
            env_extra, args = VARIANTS[name]
            running[name] = _start(name, env_extra, args, models, work, cpu)
            print(f"started {name}", flush=True)
        if not waited:
            waited = True
            while_waiting()
            continue
        time.sleep(1.0)
        for name, (proc, log, t0) in list(running.items()):
            late = time.monotonic() - t0 > timeout
            if proc.poll() is None and not late:
                continue
            if late and proc.poll() is None:
                _kill(proc)
            log.close()
            text = (work / f"{name}.log").read_text(errors="replace")
            res = {"env": VARIANTS[name][0], "engine_args": VARIANTS[name][1], "seconds": round(time.monotonic() - t0, 1),
                   "attention_backend": _backend_from_log(text), "exit": proc.returncode, "models": {}}
            for m in models:
                pt, err = work / f"{name}.{m}.pt", work / f"{name}.{m}.err"
                if pt.exists():
                    res["models"][m] = {"status": "ok"}
                elif err.exists():
                    res["models"][m] = {"status": "error", "error": err.read_text(), "log_errors": _log_errors(text)}
                else:
                    res["models"][m] = {"status": "timeout" if late else "error",
                                        "error": (f"killed after --timeout {timeout:.0f}s; " if late else "")
                                        + "log tail: " + text[-1500:]}
            res["status"] = "ok" if all(v["status"] == "ok" for v in res["models"].values()) else (
                "timeout" if late else "error")
            results[name] = res
            del running[name]
            print(f"finished {name}: {res['status']} in {res['seconds']}s (backend {res['attention_backend']})",
                  flush=True)
    return results


def _table(report: dict) -> str:
    lines = []
    for m, info in report["models"].items():
        lines.append(f"\n{m} ({info['layers']} layers), vs hf_cpu: max|Δ| of each block's output | logits | "
                     "block 0's attention and MLP outputs | (vs hf_gpu: max over blocks, logits)")
        for name, v in report["variants"].items():
            r = v.get("models", {}).get(m, {})
            if r.get("status") != "ok":
                status = r.get("status") or v.get("status") or "?"
                if status == "timeout":
                    why = f"killed after {v.get('seconds')}s (--timeout)"
                else:
                    err = (r.get("error") or v.get("error") or "").strip()
                    why = (r.get("log_errors") or [None])[-1] or (err.splitlines()[0] if err else "")
                lines.append(f"  {name:22s} {status}: {str(why)[:140]}")
                continue
            c, g = r["vs_hf_cpu"], r.get("vs_hf_gpu")
            row = " ".join(f"{x:8.1e}" for x in c["resid"])
            gl = f" | vs gpu max {max(g['resid']):.1e} logits {g['logits']:.1e}" if g else ""
            tok = "" if c["tokens_agree"] else " (tokens differ)"
            first = f" | block 0 attn {c['attn'][0]:.1e} mlp {c['mlp'][0]:.1e}"
            lines.append(f"  {name:22s} {row} | {c['logits']:8.1e}{first}{gl}{tok}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="result file (default benchmarks/results/fp32_gpu_<machine>.json)")
    ap.add_argument("--variants", default=None,
                    help=f"comma-separated, from {', '.join(VARIANTS)} (default: all but vllm_exact; "
                         "with --cpu-smoke: vllm_default)")
    ap.add_argument("--jobs", type=int, default=4, help="variants running at once on the GPU (default 4)")
    ap.add_argument("--timeout", type=float, default=150.0, help="seconds per variant (default 150)")
    ap.add_argument("--budget", type=float, default=240.0,
                    help="start no variant after this many seconds (default 240)")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="no GPU: hf_cpu vs the CPU vLLM engine (vllm_default) only, to check the plumbing")
    ap.add_argument("--workdir", default=None, help="keep per-variant logs and captures here")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        _worker(args.worker)
        return

    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not args.cpu_smoke:
        sys.exit("fp32_gpu.py: no CUDA device here; run it on a GPU, or pass --cpu-smoke to check the "
                 "transformers and CPU-engine parts")
    if args.variants is None:
        names = ["vllm_default"] if args.cpu_smoke else DEFAULT_VARIANTS
    else:
        names = [v.strip() for v in args.variants.split(",") if v.strip()]
    jobs = 1 if args.cpu_smoke else args.jobs  # CPU engines share the cores: one at a time
    bad = [v for v in names if v not in VARIANTS]
    if bad:
        sys.exit(f"fp32_gpu.py: unknown variants {bad}; choose from {list(VARIANTS)}")
    prov = provenance()
    run_name = "cpu smoke" if args.cpu_smoke else "default" if args.variants is None else ",".join(names)
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="fp32_gpu_"))
    work.mkdir(parents=True, exist_ok=True)

    import nnvllm as nv
    from nnvllm.testing import tiny_checkpoint

    t_all = time.monotonic()
    models = {"toy": nv.toy.check(), "llama": tiny_checkpoint("llama", work / "tiny-llama")}
    refs: dict[str, dict] = {}

    def transformers_side():
        for m, path in models.items():
            refs.setdefault(m, {})["hf_cpu"] = _hf_capture(path, PROMPTS, None, "cpu")
            if cuda:
                toks = refs[m]["hf_cpu"]["tokens"]
                with TF32(False):
                    refs[m]["hf_gpu"] = _hf_capture(path, PROMPTS, toks, "cuda")
                with TF32(True):
                    refs[m]["hf_gpu_tf32"] = _hf_capture(path, PROMPTS, toks, "cuda")
        print(f"transformers side done at {time.monotonic() - t_all:.0f}s", flush=True)

    results = _run_variants(names, models, work, jobs, args.timeout, args.budget,
                            not cuda, while_waiting=transformers_side)

    report = {
        "what": "max|Δ| per layer (block output = residual stream; attn and mlp outputs) and of logits, fp32, "
                "vs transformers on CPU (hf_cpu) and on the GPU with TF32 off (hf_gpu)",
        "meta": {**_versions(), "prompts": PROMPTS,
                 "max_tokens": MAX_TOKENS, "cpu_smoke": args.cpu_smoke, "timeout_s": args.timeout,
                 "jobs": jobs, "wall_s": None},
        "models": {m: {"path": p, "layers": int(refs[m]["hf_cpu"]["resid"][0].shape[0])} for m, p in models.items()},
        "variants": {},
    }
    import torch as _t

    for m in models:
        for hf in ("hf_gpu", "hf_gpu_tf32"):
            if hf in refs[m]:
                entry = report["variants"].setdefault(hf, {"status": "ok", "models": {}, "kind": "transformers",
                                                           "tf32": hf.endswith("tf32")})
                entry["models"][m] = {"status": "ok", "vs_hf_cpu": _compare(refs[m][hf], refs[m]["hf_cpu"]),
                                      "vs_hf_gpu": _compare(refs[m][hf], refs[m]["hf_gpu"])}
    for name in names:
        res = results[name]
        for m, r in res.get("models", {}).items():
            if r["status"] == "ok":
                run = _t.load(work / f"{name}.{m}.pt", weights_only=False)
                r["vs_hf_cpu"] = _compare(run, refs[m]["hf_cpu"])
                if "hf_gpu" in refs[m]:
                    r["vs_hf_gpu"] = _compare(run, refs[m]["hf_gpu"])
                r["seconds"] = round(run["seconds"], 1)
                r["diag"] = run.get("diag")
        report["variants"][name] = {"kind": "vllm", **res}
    report["meta"]["wall_s"] = round(time.monotonic() - t_all, 1)
    out = record("fp32_gpu", run_name, report, args.out, prov)
    print(_table(report))
    print(f"\nrecorded as run {run_name!r} in {out} ({report['meta']['wall_s']}s; logs in {work})")


if __name__ == "__main__":
    main()
