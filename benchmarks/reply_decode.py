"""Decoding an isolated capture's reply: ``torch.load(weights_only=True)`` against JSON, CPU only.

    python benchmarks/reply_decode.py

A reply of 64 requests (12 prompt ids, 32 generated, 192 characters of text each) and a hand-off of six
file names, encoded and decoded 20 times each way; prints milliseconds per call and records them as the
run ``64 requests`` of ``benchmarks/results/reply_decode_<machine>.json`` (or ``--out``), with the
command, commit, vLLM version and date (``benchmarks/provenance.py``). The isolated engine's client
decodes such a reply on every call, which is why ``nnvllm.engine.transport.pack`` sends plain replies
as JSON.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import time
import uuid
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from provenance import provenance, record


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="result file (default benchmarks/results/reply_decode_<machine>.json)")
    args = ap.parse_args()
    prov = provenance()
    outs = [{"request_id": uuid.uuid4().hex, "prompt_token_ids": list(range(12)), "token_ids": list(range(100, 132)),
             "text": "hello world " * 16, "finished": True} for _ in range(64)]
    reqs = {f"{i}-{uuid.uuid4().hex[:8]}": {"arena": 0, "off": i * 47, "rows": 47, "loff": i * 32, "plen": 12}
            for i in range(64)}
    files = [{"path": f"/dev/shm/x{i}", "name": "resid", "dtype": "float16", "shape": [12, 3008, 768], "offset": 0}
             for i in range(6)]
    reply = {"outputs": outs, "handoff": {"requests": reqs, "arenas": [{"files": files}], "stats": {"rows": 3008}},
             "timings": {"add": 0.02}}

    def torch_enc(o):
        b = io.BytesIO()
        torch.save(o, b)
        return b.getvalue()

    res = {}
    for name, enc, dec in [("torch weights_only", torch_enc, lambda b: torch.load(io.BytesIO(b), weights_only=True)),
                           ("json", lambda o: json.dumps(o).encode(), json.loads)]:
        t = time.perf_counter()
        for _ in range(20):
            b = enc(reply)
        te = (time.perf_counter() - t) / 20
        t = time.perf_counter()
        for _ in range(20):
            dec(b)
        td = (time.perf_counter() - t) / 20
        print(f"{name}: {len(b)} bytes, encode {te * 1e3:.2f} ms, decode {td * 1e3:.2f} ms")
        res[name] = {"bytes": len(b), "encode_ms": te * 1e3, "decode_ms": td * 1e3}
    print(f"recorded as run '64 requests' in {record('reply_decode', '64 requests', res, args.out, prov)}")


if __name__ == "__main__":
    main()
