"""The hand-off: a capture's bytes cross from the engine's worker to the client through shared memory.

Both halves live here. The worker copies the arena once into files in ``/dev/shm`` (page-locked and
registered with CUDA where there is a GPU, so the device copy lands by DMA); the RPC result is only
their names and the layout. The client maps the files (:func:`open_handover`): nothing is pickled and
no RPC size limit applies. Files the client is done with come back as spares (:class:`.spares._Spares`), so
the next call of the same size does not allocate and page-lock again. In a single-process engine the
tensors are handed over directly.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from typing import Any

import numpy as np
import torch

# Where the files live, and what removes them when an engine's processes end (leftovers).
from .leftovers import SHM_PREFIX, shm_dir, sweep_group, sweep_stale, watch_server  # noqa: F401
from . import spares
from .spares import _SPARES, _discard_when_ready


_MADE = [0, 0]  # files made in this process, and their bytes
_MADE_SEEN = [0, 0]  # the same at the last made_since_last_call()


def made_since_last_call() -> dict[str, int]:
    """Hand-off files made in this process (the call's own and spares made in the background, for it
    or after it) since the last call of this function (each capture's hand-off): ``files_made`` and
    ``files_made_bytes``. Calls in a row of the same shape make none (benchmarks read it per call)."""
    out = {"files_made": _MADE[0] - _MADE_SEEN[0], "files_made_bytes": _MADE[1] - _MADE_SEEN[1]}
    _MADE_SEEN[:] = _MADE
    return out


class _ShmFile:
    """One file in shared memory, mapped here: ``path``, its open ``fd``, the mapping, and whether the
    mapping is registered with CUDA (page-locked, so a device copy lands in it by DMA)."""

    def __init__(self, nbytes: int, pin: bool = False, device: Any = None) -> None:
        _MADE[0] += 1
        _MADE[1] += nbytes
        self.path = os.path.join(shm_dir(), f"{SHM_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}")
        self.size = nbytes
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self.mm = None
        self.ptr = 0
        self.registered = False
        self.spare = False  # made between captures (_Spares)
        self.prep: dict[str, float] = {}  # seconds per preparation stage (benchmarks)
        if nbytes:
            try:
                import mmap
                import time

                t0 = time.perf_counter()
                os.posix_fallocate(self.fd, 0, nbytes)
                t1 = time.perf_counter()
                self.mm = mmap.mmap(self.fd, nbytes, mmap.MAP_SHARED)
                _populate(self.mm, nbytes)
                t2 = time.perf_counter()
                if pin:
                    self.register(device)
                self.prep = {"fallocate": t1 - t0, "map": t2 - t1, "register": time.perf_counter() - t2}
            except BaseException:  # e.g. /dev/shm full: leave no file behind
                os.close(self.fd)
                os.unlink(self.path)
                raise

    def register(self, device: Any = None) -> bool:
        if self.registered or not self.size:
            return self.registered
        if device is not None and getattr(device, "type", None) == "cuda":
            torch.cuda.set_device(device)  # a pool thread starts on device 0
        self.ptr = torch.frombuffer(self.mm, dtype=torch.uint8).data_ptr()
        # cudaHostRegisterPortable (1): page-locked for every CUDA context of the process.
        self.registered = torch.cuda.cudart().cudaHostRegister(self.ptr, self.size, 1) == 0
        return self.registered

    def host(self, nbytes: int, dtype: torch.dtype, shape) -> torch.Tensor:
        return torch.frombuffer(self.mm, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)

    def release(self, keep: int) -> None:
        """Unmap here (the client maps the file by name) and cut the file to its first ``keep`` bytes."""
        if self.registered:
            torch.cuda.cudart().cudaHostUnregister(self.ptr)
            self.registered = False
        if self.mm is not None:
            try:
                self.mm.close()
            except BufferError:  # a tensor still views it; the mapping goes with that tensor
                pass
        try:
            if keep < self.size:
                os.ftruncate(self.fd, keep)
        finally:
            os.close(self.fd)

    def discard(self) -> None:
        self.release(self.size)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


_MADV_POPULATE_WRITE = 23  # Linux 5.14+


def _populate(mm, nbytes: int) -> None:
    """Fault every page of ``mm`` in now, with the GIL released.

    Files are made in background threads while the engine generates, and the engine's step loop
    is Python in the same process. ``mmap.mmap(..., MAP_POPULATE)`` holds the GIL for the whole
    population (0.2 s for 512 MiB, measured on CPython 3.11: the main thread stood still that long),
    so the pages are faulted in by a foreign call instead, which ctypes makes without the GIL:
    ``madvise(MADV_POPULATE_WRITE)``, or writing zeros where the kernel lacks it."""
    import ctypes

    view = ctypes.c_char.from_buffer(mm)
    try:
        addr = ctypes.addressof(view)
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        if libc.madvise(addr, nbytes, _MADV_POPULATE_WRITE) != 0:
            ctypes.memset(addr, 0, nbytes)  # the file is all zeros already: only the faults matter
    finally:
        del view  # the export would keep mm from closing


def _spare(nbytes: int, pin: bool, device: Any) -> "_ShmFile":
    f = _ShmFile(nbytes, pin, device)
    f.spare = True
    return f




class _ShmFiles:
    """The hand-off files of one capture, made ready in background threads while the engine generates.

    A fresh tmpfs page costs a fault and zeroing when first touched; done at hand-off time that is
    tens of ms per 100 MB. The sizes are known once the arena exists, so the files are allocated
    (``posix_fallocate``), mapped with every page faulted in (:func:`_populate`) and, in ``pin`` mode,
    page-locked for DMA during the generation instead, or taken from the files the last capture left ready
    (:class:`_Spares`). After the copy, unmapping (and unpinning) happens in the background too.
    """

    def __init__(self, device: Any = None) -> None:
        # page-locked for DMA only on a CUDA engine
        self.pin = _handover_mode() in ("pin", "mirror") and getattr(device, "type", None) == "cuda"
        self.device = device
        self.ready: list[tuple[int, Any, str | None]] = []  # (size, future of _ShmFile, the tensor it is for)
        self.handed: set[str] = set()  # paths the client maps (and then unlinks)
        self.sizes: list[int] = []  # bytes of each file handed over
        self.made: list[str] = []  # every path this capture created outside ``ready``
        self.writers: list = []  # what waits for writes into the files still in flight (.mirror)

    def _make(self, nbytes: int, pin: bool = False) -> _ShmFile:
        """A file made outside ``ready`` (removed at :meth:`discard` unless handed over)."""
        f = _ShmFile(nbytes, pin, self.device)
        self.made.append(f.path)
        return f

    def prepare(self, nbytes: int, name: str | None = None) -> None:
        """Make a file of ``nbytes`` ready in the background (or take a spare), for the tensor
        ``name`` (None: for any tensor)."""
        size, fut = _SPARES.take(nbytes) or (nbytes, _SPARES.submit(_ShmFile, nbytes, self.pin, self.device))
        self.ready.append((size, fut, name))

    def ready_file(self, name: str) -> _ShmFile | None:
        """The file prepared for tensor ``name`` if it is ready now (it stays here for :meth:`take`),
        else None; never waits."""
        for _, fut, owner in self.ready:
            if owner == name and fut.done() and fut.exception() is None:
                return fut.result()
        return None

    def take(self, nbytes: int, timings: dict | None = None, name: str | None = None) -> _ShmFile:
        """The smallest file prepared for tensor ``name`` (or for any tensor) of at least ``nbytes``
        (waiting for that one only), else a spare that fits, else a new one; it is handed over.
        ``timings`` gets how its preparation went (benchmarks).

        A file prepared for one tensor is never taken by another: the arena's files are sized for
        its capacity, so a small tensor handed over first (a sampling statistic, which is never
        prepared) would take the logits' file, and the logits would then wait for a new file made
        in the hand-off (measured on an H100, Llama-1B shape 64 x 128: 0.044 s of a 0.065 s hand-off,
        in two calls of three)."""
        fits = [(size, i) for i, (size, _, owner) in enumerate(self.ready)
                if size >= nbytes and owner in (None, name)]
        # else not prepared (the sampling statistics' tensors never are): a spare, else a new file
        fut = self.ready.pop(min(fits)[1])[1] if fits else (_SPARES.take(nbytes) or (0, None))[1]
        ready = fut is not None and fut.done()
        t0 = time.perf_counter()
        f = fut.result() if fut is not None else self._make(nbytes)
        if timings is not None and fut is not None:  # blocked on a file still being prepared
            timings["handover_wait"] = timings.get("handover_wait", 0.0) + time.perf_counter() - t0
        self.handed.add(f.path)
        self.sizes.append(nbytes)
        if timings is not None:
            for k, v in f.prep.items():
                timings[f"file_{k}"] = timings.get(f"file_{k}", 0.0) + v
            timings["files"] = timings.get("files", 0) + 1
            timings["files_ready"] = timings.get("files_ready", 0) + int(ready)
            timings["files_spare"] = timings.get("files_spare", 0) + int(f.spare)
        return f

    def release(self, f: _ShmFile, keep: int) -> bool:
        """After its copy: kept mapped for recycling (True: the client must not unlink it), else
        unmapped and cut to ``keep`` bytes in the background."""
        if _SPARES.keep(f):
            return True
        _SPARES.submit(f.release, keep)
        return False

    def discard(self) -> None:
        """Keep files like the ones handed over ready for the next capture (:class:`.spares._Spares`),
        release the rest, and remove every file of this capture the client will not unlink,
        whatever path led here (an error mid-hand-off included)."""
        for wait in self.writers:  # (a file is let go, or made a spare, only once nothing writes into it)
            wait()
        ready, self.ready = [(size, fut) for size, fut, _ in self.ready], []
        if spares.SPARE_BYTES > 0 and self.sizes:
            _SPARES.refill(self.sizes, ready, lambda n: _spare(n, self.pin, self.device))
        else:
            for _, fut in ready:
                _SPARES.submit(_discard_when_ready, fut)
        for path in self.made:
            if path not in self.handed:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass


def _handover_mode() -> str:
    mode = os.environ.get("NNVLLM_HANDOVER", "pin")
    if mode not in ("stage", "pin", "plain", "mirror"):
        raise ValueError(f"NNVLLM_HANDOVER={mode!r}; expected 'stage', 'pin', 'plain' or 'mirror'")
    return mode


_STAGING: list = []  # two pinned buffers, reused across hand-offs


def _d2h(host: torch.Tensor, v: torch.Tensor, mode: str, f: _ShmFile | None = None) -> None:
    """Copy device tensor ``v`` into the shared-memory tensor ``host`` (same shape)."""
    if not v.is_cuda:
        host.copy_(v)
        return
    if mode in ("pin", "mirror") and f is not None and (f.registered or f.register(v.device)):
        host.copy_(v, non_blocking=True)  # DMA straight into the page-locked file
        torch.cuda.current_stream().synchronize()
        return
    if mode in ("stage", "pin"):
        # Device -> pinned staging (DMA) -> shared memory (multi-threaded CPU copy), two buffers
        # so the next chunk's DMA overlaps this chunk's CPU copy.
        chunk = 64 << 20
        if not _STAGING:
            _STAGING.extend(torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(2))
        src = v.contiguous().view(-1).view(torch.uint8)
        dst = host.view(-1).view(torch.uint8)
        events = [torch.cuda.Event(), torch.cuda.Event()]
        threads = torch.get_num_threads()
        torch.set_num_threads(max(threads, min(8, os.cpu_count() or 1)))
        try:
            n = src.numel()
            starts = list(range(0, n, chunk))
            for i, a in enumerate(starts):
                b = min(a + chunk, n)
                k = i % 2
                _STAGING[k][: b - a].copy_(src[a:b], non_blocking=True)
                events[k].record()
                if i > 0:
                    pa = starts[i - 1]
                    pb = min(pa + chunk, n)
                    events[1 - k].synchronize()
                    dst[pa:pb].copy_(_STAGING[1 - k][: pb - pa])
            if starts:
                k = (len(starts) - 1) % 2
                a = starts[-1]
                events[k].synchronize()
                dst[a:].copy_(_STAGING[k][: n - a])
        finally:
            torch.set_num_threads(threads)
        return
    host.copy_(v)


def _handover(tensors: dict[str, torch.Tensor], same_process: bool, shm: "_ShmFiles | None" = None,
              timings: dict[str, float] | None = None, inline: bool = False, filled: dict | None = None) -> dict:
    """Move tensors to the client: directly in one process, else through files in shared memory.

    Each tensor becomes one file in ``/dev/shm``, prepared during the generation (:class:`_ShmFiles`).
    ``NNVLLM_HANDOVER`` picks how a GPU tensor gets there: ``pin`` (default: the file's pages are
    page-locked while it is prepared, and the copy is one DMA into them), ``stage`` (DMA into a
    pinned staging buffer, then a multi-threaded copy), ``plain`` (a pageable copy) or ``mirror`` (as
    ``pin``, except that the files in ``filled``, by tensor, already hold their tensor: :mod:`.mirror`). Measured on an
    H200 (Llama-1B shape, 64 x 128, ~0.7 GB): hand-off 0.12 s with ``pin``, 0.21 s with ``stage``
    (benchmarks/results/capture_gpu_h200.json, run ``llama1b_handover``).
    """
    if same_process:
        return {"tensors": {k: v.to("cpu") for k, v in tensors.items()}}
    if inline:  # the client is on another host: the bytes go in the reply (.crosshost)
        from .crosshost import pack_inline

        return pack_inline(tensors)
    import time

    mode = _handover_mode()
    files = {}
    timings = {} if timings is None else timings
    for name, v in tensors.items():
        nbytes = v.numel() * v.element_size()
        t0, c0 = time.perf_counter(), time.thread_time()
        f = shm.take(nbytes, timings, name) if shm is not None else _ShmFile(nbytes)
        t1 = time.perf_counter()
        # this thread's CPU time in it: far below handover_file means it waited (GIL, kernel locks)
        timings["handover_file_cpu"] = timings.get("handover_file_cpu", 0.0) + time.thread_time() - c0
        if filled is not None and filled.get(name) is f:  # written during the generation (.mirror)
            timings["handover_mirrored_bytes"] = timings.get("handover_mirrored_bytes", 0) + nbytes
        elif nbytes:
            _d2h(f.host(nbytes, v.dtype, v.shape), v, mode, f)
        # where the hand-off's time goes (benchmarks): waiting for a prepared file, then the copy
        timings["handover_file"] = timings.get("handover_file", 0.0) + t1 - t0
        timings["handover_copy"] = timings.get("handover_copy", 0.0) + time.perf_counter() - t1
        timings["handover_bytes"] = timings.get("handover_bytes", 0) + nbytes
        kept = shm.release(f, nbytes) if shm is not None else f.release(nbytes)
        files[name] = {"path": f.path, "dtype": str(v.dtype).removeprefix("torch."), "shape": list(v.shape)}
        if kept:
            files[name]["kept"] = True  # recycled (see _Spares): the client returns it, never unlinks it
    return {"files": files}


# Client side: recycled hand-off files (see _Spares) whose tensors are all gone, to name in the next call.
_RETURNED: set[str] = set()
# path -> how many times this process has mapped it: only the finalizer of its latest mapping returns it
_MAPPED: dict[str, int] = {}
# path -> the model whose engine handed it over (its ``id``): a file goes back to that engine's worker only
_OWNER: dict[str, int] = {}


def returned_files(owner: Any = None) -> list[str]:
    """The recycled hand-off files this process no longer uses (still present), for the next call's
    spec: those the engine of model ``owner`` handed over (every engine's with None)."""
    paths = _RETURNED.copy()  # (one C call: a finalizer adding a path cannot interleave)
    for p in [p for p in paths if not os.path.exists(p)]:  # its engine let it go, or ended
        _RETURNED.discard(p)
        _MAPPED.pop(p, None)
        _OWNER.pop(p, None)
        paths.discard(p)
    if owner is not None:
        paths = {p for p in paths if _OWNER.get(p) == id(owner)}
    return sorted(paths)


_TAKING = threading.Lock()


def take_returned(owner: Any = None) -> list[str]:
    """:func:`returned_files` of model ``owner``'s engine, for one call's spec: each file is named to one call only.

    Two calls that named the same file (two threads, or a stream and a call) let the engine take it
    back for the first, hand it over again with the first's values, and then take it back for the
    second and write the second's values into it. A file named to another engine than the one that
    handed it over is lost to both: that worker ignores it, and its own never hears of it (two engines
    in one notebook, called in turn, would each make their files anew in every call).
    """
    with _TAKING:
        paths = returned_files(owner)
        _RETURNED.difference_update(paths)
    return paths


def _return(path: str, mapping: int) -> None:
    """Finalizer of a kept file's mapping: the file goes back unless it was handed over (and mapped) again."""
    if _MAPPED.get(path) == mapping:
        _RETURNED.add(path)


def taken_back(paths) -> None:
    """The engine took these files back (the hand-off's ``taken_back``)."""
    _RETURNED.difference_update(paths or ())


def _map_kept(path: str, nbytes: int, owner: Any = None) -> torch.Tensor:
    """Map a recycled file; when the last tensor viewing it is freed, it is returned to the engine
    of model ``owner``, whose engine handed it over)."""
    import mmap
    import weakref

    with open(path, "r+b") as fh:
        mm = mmap.mmap(fh.fileno(), nbytes)
    arr = np.frombuffer(mm, dtype=np.uint8, count=nbytes)  # torch.from_numpy keeps arr while any view lives
    # The file is in use again. A call that ended without its hand-off (a stream left early, an
    # interrupt, an error) never heard which returned files the engine took back, so this path may
    # still be listed as returned: named in the next call, the engine would hand it over a second
    # time, over this mapping's values. And a finalizer of an older mapping of the same file, run
    # late (a cycle), must not return it either.
    mapping = _MAPPED[path] = _MAPPED.get(path, 0) + 1
    _OWNER[path] = id(owner)
    _RETURNED.discard(path)
    weakref.finalize(arr, _return, path, mapping)
    return torch.from_numpy(arr)


def _check_handed(f: dict) -> torch.dtype:
    """A hand-off entry names a file of nnvllm's in shared memory and a torch dtype, or is refused:
    the client maps and then removes the files a reply names, so a reply naming any other file (an
    engine attached by URL that is not nnvllm's) must not get that far. Returns the dtype."""
    from ..wire import UnsafeReply

    path = f.get("path") if isinstance(f, dict) else None
    ours = (isinstance(path, str) and os.path.basename(path).startswith(SHM_PREFIX)
            and os.path.dirname(os.path.realpath(path)) == os.path.realpath(shm_dir()))
    dtype = getattr(torch, f.get("dtype", ""), None) if isinstance(f, dict) and isinstance(f.get("dtype"), str) else None
    if not ours or not isinstance(dtype, torch.dtype):
        raise UnsafeReply(
            f"the engine's hand-off names {path!r} (dtype {f.get('dtype') if isinstance(f, dict) else f!r}); a "
            f"hand-off names nnvllm's files in {shm_dir()} ({SHM_PREFIX}*) and a torch dtype. Refused: "
            "nothing was read or removed.")
    return dtype


def open_handover(part: dict, owner: Any = None) -> dict[str, torch.Tensor]:
    """The client side of :func:`_handover`: map the files (then unlink them, unless the engine keeps
    them for recycling: they go back to the engine of model ``owner``) or take the tensors."""
    if "tensors" in part:
        return part["tensors"]
    if "inline" in part:  # from a worker on another host (.crosshost)
        from .crosshost import unpack_inline

        return unpack_inline(part)
    out = {}
    files = part["files"]
    dtypes = {name: _check_handed(f) for name, f in files.items()}  # all checked before any is touched
    for name, f in files.items():
        dtype = dtypes[name]
        numel = int(np.prod(f["shape"])) if f["shape"] else 1
        item = dtype.itemsize
        kept = bool(f.get("kept"))
        try:
            if numel and kept:
                out[name] = _map_kept(f["path"], numel * item, owner).view(dtype).view(f["shape"])
            elif numel:
                t = torch.from_file(f["path"], shared=True, size=numel * item, dtype=torch.uint8)
                out[name] = t.view(dtype).view(f["shape"])
            else:
                out[name] = torch.empty(f["shape"], dtype=dtype)
                if kept:
                    _OWNER[f["path"]] = id(owner)
                    _RETURNED.add(f["path"])
        finally:
            if not kept:
                try:
                    os.unlink(f["path"])  # the mapping keeps the memory until the tensor is freed
                except FileNotFoundError:
                    pass
    return out


def discard_handover(part: dict) -> None:
    for f in part.get("files", {}).values():
        _check_handed(f)
        if f.get("kept"):
            _RETURNED.add(f["path"])
            continue
        try:
            os.unlink(f["path"])
        except FileNotFoundError:
            pass


