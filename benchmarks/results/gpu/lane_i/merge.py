"""Join the Llama-shape halves of lane I (llama1b_a.json, llama1b_b.json: the same workload, run by
benchmarks/capture_gpu.py in two commands back to back on the same warm H200) into llama1b.json, with
the ratios of every case over both halves (capture_gpu._ratios).   python merge.py [folder]"""
import json
import sys
from pathlib import Path

here = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent)
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # benchmarks/
from capture_gpu import _ratios  # noqa: E402

a, b = (json.loads((here / f"llama1b_{p}.json").read_text()) for p in "ab")
for k in ("shape", "prompts", "tokens", "prompt_len", "repeats"):
    assert a[k] == b[k], (k, a[k], b[k])
out = {"commands": [a["command"], b["command"]], "dates": [a["date"], b["date"]],
       **{k: a[k] for k in ("shape", "shape_args", "prompts", "tokens", "prompt_len", "repeats", "device", "versions")},
       "seconds": {**a["seconds"], **b["seconds"]}, "errors": {**a["errors"], **b["errors"]},
       "all": {**a.get("all", {}), **b.get("all", {})}, "per_call": {**a.get("per_call", {}), **b.get("per_call", {})}}
for k in ("graphs_vs_eager",):
    if k in a:
        out[k] = a[k]
_ratios(out)
(here / "llama1b.json").write_text(json.dumps(out, indent=2))
print(json.dumps({k: out[k] for k in ("seconds", "ratios")}, indent=1))
