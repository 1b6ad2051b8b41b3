"""Decoding an isolated capture's reply: ``torch.load(weights_only=True)`` against JSON, CPU only.

    python benchmarks/reply_decode.py

A reply of 64 requests (12 prompt ids, 32 generated, 192 characters of text each) and a hand-off of six
file names, encoded and decoded 20 times each way; prints milliseconds per call. Lane L (H200) saw the
client spend ~9 ms a GPT-2-small call on this decode; ``nnvllm.transport.pack`` now sends plain replies
as JSON.
"""

from __future__ import annotations

import io
import json
import time
import uuid

import torch


def main() -> None:
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


if __name__ == "__main__":
    main()
