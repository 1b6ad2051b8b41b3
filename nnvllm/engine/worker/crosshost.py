"""The hand-off when the worker is on another host than the client: the capture in the reply itself.

The hand-off's files live in ``/dev/shm`` (:mod:`.handoff`), which only processes of one machine
share. A worker can be elsewhere: vLLM's Ray executor (``distributed_executor_backend="ray"``) places
rank 0's worker on whichever node Ray picks, and an engine attached by URL may run on another
host. Such a worker cannot tell from a pid or a hostname whether the client sees its files (pids
repeat across hosts; containers on one host may share a hostname but not ``/dev/shm``), so it asks
the one question that matters: the client names a file of its own in its shared memory
(:func:`client_probe`, in the capture's spec), and a worker that cannot see that file
(:func:`sees_client`) hands the capture over inline (:func:`pack_inline`): each tensor's raw bytes,
dtype and shape in the RPC result, which travels to the client the way the RPC's answer does
(Ray's object store, vLLM's engine-core socket, the isolated server's HTTP reply). The client
rebuilds the tensors from the bytes (:func:`unpack_inline`): no pickle. It costs a copy of every
byte through those channels, and a reply stays under msgpack's 4 GiB per message: collect in
chunks (``nv.collect``) for more.
"""

from __future__ import annotations

import atexit
import os
import uuid

import torch

from .leftovers import shm_dir

PROBE_PREFIX = "nnvllm-host-"
_PROBE: list[str] = []  # this process's probe file, once made


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _sweep_probes(d: str) -> None:
    """Probe files of processes that are gone (killed before their exit handler ran)."""
    for name in os.listdir(d):
        if not name.startswith(PROBE_PREFIX):
            continue
        try:
            os.kill(int(name[len(PROBE_PREFIX):].split("-", 1)[0]), 0)
        except (ValueError, ProcessLookupError):
            _remove(os.path.join(d, name))
        except PermissionError:
            pass


def client_probe() -> str:
    """The path of an empty file of this process in shared memory (made on first use, removed at
    exit), named in every capture's spec: a worker that sees it shares this machine's memory."""
    if _PROBE and os.path.exists(_PROBE[0]):
        return _PROBE[0]
    d = shm_dir()
    _sweep_probes(d)
    path = os.path.join(d, f"{PROBE_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}")
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    if not _PROBE:
        atexit.register(lambda: _PROBE and _remove(_PROBE[0]))
    _PROBE[:] = [path]
    return path


def sees_client(spec: dict) -> bool:
    """Whether this worker sees the client's shared memory (the spec's ``client_shm``, see
    :func:`client_probe`). A spec without one (a client that does not say) counts as the same host:
    the hand-off through files is what such clients expect."""
    probe = spec.get("client_shm")
    if probe is None:
        return True
    return (isinstance(probe, str) and os.path.basename(probe).startswith(PROBE_PREFIX)
            and os.path.dirname(os.path.realpath(probe)) == os.path.realpath(shm_dir()) and os.path.exists(probe))


def pack_inline(tensors: dict[str, torch.Tensor]) -> dict:
    """The hand-off of ``tensors`` as plain data: ``{"inline": {name: {dtype, shape, data}}}``."""
    out = {}
    for name, v in tensors.items():
        v = v.detach().to("cpu").contiguous()
        data = v.reshape(-1).view(torch.uint8).numpy().tobytes() if v.numel() else b""
        out[name] = {"dtype": str(v.dtype).removeprefix("torch."), "shape": list(v.shape), "data": data}
    return {"inline": out}


def unpack_inline(part: dict) -> dict[str, torch.Tensor]:
    """The tensors of a :func:`pack_inline` hand-off; an entry that is not a torch dtype, a shape and
    exactly its bytes is refused (nothing else is built from a reply)."""
    out = {}
    for name, f in part["inline"].items():
        dtype = getattr(torch, f.get("dtype", ""), None) if isinstance(f, dict) and isinstance(f.get("dtype"), str) \
            else None
        shape = f.get("shape") if isinstance(f, dict) else None
        data = f.get("data") if isinstance(f, dict) else None
        ok = (isinstance(dtype, torch.dtype) and isinstance(shape, list)
              and all(isinstance(n, int) and n >= 0 for n in shape) and isinstance(data, (bytes, bytearray)))
        numel = 1
        for n in shape if ok else ():
            numel *= n
        if not ok or len(data) != numel * dtype.itemsize:
            raise ValueError(f"the engine's inline hand-off of {name!r} is malformed (dtype "
                             f"{f.get('dtype') if isinstance(f, dict) else f!r}, shape {shape!r}); nothing was built")
        flat = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        out[name] = flat.view(dtype).view(shape)
    return out
