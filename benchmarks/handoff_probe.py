"""Whether a capture's hand-off copy can overlap the generation (GPU only).

nnvllm places each step's rows in a device arena laid out request by request and copies the whole
arena into page-locked shared-memory files after the last step (one DMA: 14 ms for the Llama-1B
shape's 738 MB on an H100, about 4% of bare vLLM's call). This probe measures, outside vLLM, a
decode-like loop that writes each step's rows into such an arena, with the copy made four ways:

- ``end``: the whole arena into the page-locked buffer after the loop (what nnvllm does now);
- ``side``: each step's rows written into the page-locked buffer by a kernel on a side stream,
  through a CUDA view of the host memory (unified addressing), overlapping the next steps;
- ``main``: the same kernel on the loop's own stream (what the writes cost when they do not overlap);
- ``none``: the loop alone.

The page-locked buffer is a shared-memory file registered with ``cudaHostRegister`` (portable), as
nnvllm's hand-off files are. Each form is timed ``--repeats`` times in turns; the medians and their
ratios to ``none`` are printed, and every form's buffer is checked against the arena.

    python benchmarks/handoff_probe.py --steps 128 --prompts 64 --layers 16 --d 2048 --vocab 8192
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import tempfile
import time

import torch


class _HostView:
    """A CUDA tensor's description of page-locked host memory (``__cuda_array_interface__``)."""

    def __init__(self, ptr: int, shape: tuple[int, ...]) -> None:
        self.__cuda_array_interface__ = {"data": (ptr, False), "shape": shape, "typestr": "<f2",
                                         "version": 2, "strides": None}


def registered_buffer(shape: tuple[int, ...]):
    """A shared-memory file's mapping, registered with CUDA: its CPU tensor, its CUDA view, and what keeps them."""
    n = 2
    for s in shape:
        n *= s
    fd, path = tempfile.mkstemp(dir="/dev/shm", prefix="nnvllm-probe-")
    os.unlink(path)
    os.ftruncate(fd, n)
    mm = mmap.mmap(fd, n)
    os.close(fd)
    cpu = torch.frombuffer(mm, dtype=torch.float16).view(shape)
    cpu.zero_()  # (pages faulted in before registering)
    assert torch.cuda.cudart().cudaHostRegister(cpu.data_ptr(), n, 1) == 0, "cudaHostRegister failed"
    dev = torch.as_tensor(_HostView(cpu.data_ptr(), shape), device="cuda")
    assert dev.data_ptr() == cpu.data_ptr() and dev.is_cuda
    return cpu, dev, mm


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--plen", type=int, default=16)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--d", type=int, default=2048)
    ap.add_argument("--work", type=int, default=6, help="matmuls per layer per step (the step's compute)")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    dev = torch.device("cuda")
    P, T, L, d = a.prompts, a.steps, a.layers, a.d
    span = a.plen + T
    rows = P * span
    arena = torch.zeros(L, rows, d, dtype=torch.float16, device=dev)
    cpu, host_dev, _mapping = registered_buffer((L, rows, d))
    w = torch.randn(d, d, dtype=torch.float16, device=dev) / d ** 0.5
    x0 = torch.randn(P, d, dtype=torch.float16, device=dev)
    offsets = torch.arange(P, device=dev) * span + a.plen
    side = torch.cuda.Stream()
    print(f"arena {arena.numel() * 2 / 1e6:.0f} MB, {P} prompts x {T} steps, {L} layers x {d}; "
          f"each step's rows {L * P * d * 2 / 1e6:.2f} MB", flush=True)

    def loop(form: str) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        x = x0
        for t in range(T):
            idx = offsets + t
            for layer in range(L):
                for _ in range(a.work):
                    x = torch.tanh(x @ w)
                arena[layer].index_copy_(0, idx, x)
            if form == "side":
                done = torch.cuda.Event()
                done.record()
                with torch.cuda.stream(side):
                    side.wait_event(done)
                    host_dev.index_copy_(1, idx, arena.index_select(1, idx))
                    idx.record_stream(side)
            elif form == "main":
                host_dev.index_copy_(1, idx, arena.index_select(1, idx))
        if form == "side":
            torch.cuda.current_stream().wait_stream(side)
        elif form == "end":
            cpu.copy_(arena, non_blocking=True)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    forms = ["none", "end", "side", "main"]
    for f in forms:
        loop(f)  # warm-up
    times = {f: [] for f in forms}
    for r in range(a.repeats):
        for f in forms[r % len(forms):] + forms[:r % len(forms)]:
            cpu.zero_()
            times[f].append(loop(f))
            if f != "none":  # the buffer holds the arena's decode rows
                idx = (offsets[:, None] + torch.arange(T, device=dev)).flatten()
                same = torch.equal(cpu[:, idx.cpu()], arena[:, idx].cpu())
                assert same, f"{f}: the page-locked buffer differs from the arena"
    base = statistics.median(times["none"])
    for f in forms:
        med = statistics.median(times[f])
        print(f"{f:5s} median {med:.4f} s  fastest {min(times[f]):.4f} s  x none {med / base:.3f}  "
              f"(+{1e3 * (med - base):.1f} ms)", flush=True)
    # the kernel's own rate into host memory, and the DMA's, for one whole arena
    for name, fn in (("dma", lambda: cpu.copy_(arena, non_blocking=True)), ("kernel", lambda: host_dev.copy_(arena))):
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        s = time.perf_counter() - t0
        print(f"{name}: whole arena in {1e3 * s:.1f} ms ({arena.numel() * 2 / s / 1e9:.0f} GB/s)", flush=True)
    torch.cuda.cudart().cudaHostUnregister(cpu.data_ptr())  # (the mapping goes with the process)


if __name__ == "__main__":
    main()
