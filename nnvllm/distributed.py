"""Past one engine: one dataset collected by several engines, and engines as Ray actors.

``nv.collect([m1, m2, ...], prompts, out)`` shards the prompts over the engines and writes ONE
dataset, in the format of :mod:`nnvllm.shards` (the same ``index.json`` and shards a one-engine
:func:`nnvllm.collect` writes). Each engine may be

- a model from :func:`nnvllm.load` (isolated engines, ``nv.load(path, isolate=True)``, run side by side;
  one in-process engine at most, since vLLM's in-process engine is one per process): it generates
  in its engine and its shards are written by this process;
- a :class:`RayEngine` from :func:`ray_engines`: an nnvllm engine inside a Ray actor, on any node of
  a Ray cluster; the actor generates and writes its own shards into ``out``, which must be the same
  path on every node (shared storage), and replies with the shard's index entry only.

How the work is dealt out (:func:`fan_out`): the prompts not yet collected are cut once into
chunks of one size (``batch_size``, or sized from ``memory_budget`` as :func:`nnvllm.collect` does,
and no more than ``1 / (2 x engines)`` of them, so every engine gets work), each engine has two
chunks in flight (it generates one while the shard of the other is written; the first two rounds
are dealt one chunk per engine at a time), and the next chunk goes to whichever engine finishes
one first. With local engines the memory budget is shared by all of their chunks in flight; a Ray
actor's chunks are in its own process, each under the whole budget. Same numbers as one engine
(below) whatever the chunks: a request's numbers do not depend on its chunk. The driver
(this process) is the only one that writes ``index.json``: a shard is listed once its file is
complete, under a name the driver gave it, so two engines never write the same file.

Same numbers as one engine: a request's tokens and activations depend only on its prompt, the
model and its seed. Each request draws with ``request_seed(seed, i)``, ``i`` its index in the whole
prompt list (:func:`nnvllm._validate.request_seed`), whichever engine and chunk it lands in; so a
fanned-out collect and a one-engine collect of the same prompts hold the same tokens, and (on the
same platform and dtype) the same activations. Engines must load the same checkpoint in the same
dtype; anything else is refused before anything runs.

An engine lost mid-collect (its process killed, its node gone, its engine core dead) is dropped
with a warning: the chunks it held are given to the engines still up, and the call finishes.
Nothing is listed twice: a chunk is listed when its shard's entry reaches the driver, and a shard
file a lost engine finished but never reported is removed at the end. When every engine is lost,
the call raises with the finished shards kept; calling ``nv.collect`` again with live engines (or
one) resumes, as after any interruption.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import socket
import types
import warnings
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["RayEngine", "fan_out", "ray_engines"]

# Chunks each engine has in flight: it generates one while the shard of the one before is written.
DEPTH = 2

# Exceptions that mean the engine is gone, not that the request was wrong: by class name, so that
# neither vLLM nor Ray is imported to tell (Ray wraps an actor's own error in a RayTaskError whose
# ``cause`` is the original).
_LOST = {"EngineDied", "EngineDeadError", "RayActorError", "ActorDiedError", "ActorUnavailableError",
         "WorkerCrashedError", "NodeDiedError", "OwnerDiedError", "ActorUnschedulableError"}


def lost_reason(exc: BaseException) -> str | None:
    """Why ``exc`` means its engine is gone (a one-line reason), or None when it is another error."""
    seen = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if type(e).__name__ in _LOST:
            return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".strip()
        e = getattr(e, "cause", None) or e.__cause__ or e.__context__
    return None


# ---------------------------------------------------------------- engines: what fan_out calls


def _label(model) -> str:
    """How a warning and the index name an engine: its kind, process and host."""
    if isinstance(model, RayEngine):
        return model.label
    pid = getattr(model, "pid", None) if getattr(model, "_nnvllm_isolated", False) else os.getpid()
    kind = "isolated" if getattr(model, "_nnvllm_isolated", False) else "in-process"
    return f"{kind} engine pid {pid} on {socket.gethostname()}"


def _collect_chunk(model, prompts: list, kwargs: dict, path: str, ids: list[int], policy: str,
                   fsync: bool) -> tuple[dict, dict]:
    """Generate ``prompts`` on ``model`` and write their shard at ``path``: (index entry, index facts).

    The one unit of work, the same wherever it runs (a thread of the driver for a local model, a
    Ray actor for a :class:`RayEngine`)."""
    from . import capture
    from .shards import _index_facts, write_shard

    run = capture.generate(model, prompts, **kwargs)
    facts = _index_facts(run)
    entry = write_shard(run, path, ids, policy, fsync)
    return entry, facts


class _Local:
    """A model this process drives (in-process or isolated): two threads, so one chunk's shard is
    written while the next generates (the engine takes one call at a time)."""

    remote = False

    def __init__(self, model) -> None:
        self.model = model
        self.label = _label(model)
        self.pool = concurrent.futures.ThreadPoolExecutor(DEPTH, thread_name_prefix="nnvllm-fan-out")

    def submit(self, *args) -> concurrent.futures.Future:
        return self.pool.submit(_collect_chunk, self.model, *args)

    def shutdown(self, wait: bool) -> None:
        self.pool.shutdown(wait=wait, cancel_futures=True)


class _Remote:
    """A :class:`RayEngine`: the chunk runs in its actor (which writes the shard); a Ray reference's
    future is what comes back."""

    remote = True

    def __init__(self, engine: RayEngine) -> None:
        self.engine = engine
        self.label = engine.label

    def submit(self, *args) -> concurrent.futures.Future:
        return self.engine.actor.collect_chunk.remote(*args).future()

    def shutdown(self, wait: bool) -> None:
        pass


def check_engines(models: list) -> None:
    """Refuse, before anything runs, engines that would not give the same numbers: another
    checkpoint, another dtype, a closed or dead engine (which says so), or the same engine twice."""
    from . import _validate
    from .shards import _engine

    if not models:
        raise ValueError("model=[]: expected a model from nv.load(...) or a list of them (one per engine)")
    if len({id(m) for m in models}) != len(models):
        raise ValueError("the same engine is listed twice in model=[...]; list each engine once")
    facts = []
    for k, m in enumerate(models):
        if getattr(m, "arch", None) is None or not hasattr(m, "n_layers"):
            raise TypeError(f"model[{k}]={_validate._show(m)}: expected a model from nv.load(...) or a "
                            "RayEngine from nnvllm.distributed.ray_engines(...)")
        engine = _engine(m)  # a closed or dead engine raises here
        info = engine.info() if engine is not None else {}
        facts.append((str(getattr(m, "checkpoint", None)), str(info.get("dtype")), _label(m)))
    ckpt, dtype, first = facts[0]
    for c, d, label in facts[1:]:
        if (c, d) != (ckpt, dtype):
            raise ValueError(f"the engines differ: {first} runs {ckpt!r} in {dtype}, {label} runs {c!r} in {d}. "
                             "One dataset is collected by engines of one checkpoint and dtype: load them alike.")


def fan_out(models: list, prompts: list, *, index: dict, todo: list[int], out: Path,
            chunk_size: Callable[[int, int], int], kwargs_for: Callable[[list[int]], dict], next_shard: int,
            policy: str, fsync: bool, progress: bool) -> None:
    """Collect the prompts ``todo`` (indices into ``prompts``) over ``models`` into the dataset at
    ``out`` whose parsed ``index`` is given (see the module docstring); :func:`nnvllm.collect` calls it.

    ``chunk_size(left, in_flight)``: prompts in a chunk, at most ``left``, ``in_flight`` chunks
    being held in this process at once (the memory budget's share). ``kwargs_for(ids)``: the generate
    arguments of a chunk (its seeds by global index). ``next_shard``: the first free shard number.
    """
    from tqdm.auto import tqdm

    from .shards import _write_index

    slots = [_Remote(m) if isinstance(m, RayEngine) else _Local(m) for m in models]
    for k, slot in enumerate(slots):  # names told apart (the warnings, the index's "engine")
        if any(o.label == slot.label for o in slots[:k]):
            slot.label = f"{slot.label} #{k}"
    local = sum(not s.remote for s in slots)
    # Chunks in this process's memory at once: DEPTH per local engine (a Ray actor's are in its own).
    in_flight = DEPTH * max(local, 1)
    alive = list(slots)
    # Chunks of one size, cut once: no larger than an even share of DEPTH chunks per engine (every
    # engine gets work, and writes overlap generation from the start), within the memory budget.
    size = max(1, chunk_size(-(-len(todo) // (len(slots) * DEPTH)), in_flight)) if todo else 1
    queue: deque[list[int]] = deque(todo[i:i + size] for i in range(0, len(todo), size))
    running: dict[concurrent.futures.Future, tuple[Any, list[int], str]] = {}
    lost: dict[str, list] = {}  # engine label -> [why, requests handed on]
    error: BaseException | None = None
    indexer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="nnvllm-index")
    index_writes: list[concurrent.futures.Future] = []
    bar = tqdm(total=index["n_requests"], initial=index["n_requests"] - len(todo), disable=not progress,
               unit="req", desc=f"collect x{len(slots)}")

    def start(slot, ids: list[int]) -> None:
        nonlocal next_shard
        name = f"shard-{next_shard:05d}.safetensors"  # each chunk (and each retry) its own file
        next_shard += 1
        # An absolute path: a Ray actor's working directory is not this process's.
        fut = slot.submit([prompts[i] for i in ids], kwargs_for(ids), str(out.absolute() / name), ids, policy,
                          fsync)
        running[fut] = (slot, ids, name)

    def assign() -> None:
        # Round by round (each engine's first chunk, then its second): with fewer chunks than
        # DEPTH x engines, every engine still gets one.
        for depth in range(DEPTH):
            for slot in list(alive):
                if error is None and queue and sum(1 for s, _, _ in running.values() if s is slot) <= depth:
                    start(slot, queue.popleft())

    def finish(fut: concurrent.futures.Future) -> None:
        nonlocal error
        slot, ids, _ = running.pop(fut)
        try:
            entry, facts = fut.result()
        except BaseException as e:  # noqa: BLE001  judged here: a lost engine or an error
            why = lost_reason(e)
            if why is None:
                error = error or e
                return
            if slot in alive:
                alive.remove(slot)
            lost.setdefault(slot.label, [why, 0])[1] += len(ids)
            queue.appendleft(ids)  # redone by an engine still up; nothing of it was listed
            if not alive and error is None:
                error = RuntimeError(
                    f"every engine was lost mid-collect ({'; '.join(f'{lb}: {w}' for lb, (w, _) in lost.items())}). "
                    f"The dataset at {str(out)!r} keeps the shards finished so far; call nv.collect again "
                    "with the same arguments and live engines to resume.")
            return
        if index["layers"] is None:
            index.update(facts)
        entry["engine"] = slot.label
        index["shards"].append(entry)
        index["shards"].sort(key=lambda e: min(e["requests"]))  # dataset order, whoever finished first
        index_writes.append(indexer.submit(_write_index, out, json.dumps(index, ensure_ascii=False), fsync))
        bar.update(len(ids))

    try:
        assign()
        while running:
            done, _ = concurrent.futures.wait(list(running), return_when=concurrent.futures.FIRST_COMPLETED)
            for fut in done:
                finish(fut)
            assign()
    finally:
        # On an error or an interrupt: what is still running is finished and listed (an
        # interrupted collect keeps it), no new chunk starts, then the error goes on.
        try:
            while running:
                done, _ = concurrent.futures.wait(list(running), return_when=concurrent.futures.FIRST_COMPLETED)
                for fut in done:
                    finish(fut)
        finally:
            for s in slots:
                s.shutdown(wait=False)
            indexer.shutdown(wait=True)
            bar.close()
    for f in index_writes:
        f.result()  # a failed index write is an error
    _remove_orphans(out, index)
    for label, (why, n) in lost.items():
        warnings.warn(f"{label} was lost mid-collect ({why}); its {n} unfinished request(s) were collected "
                      "by the engines still up", RuntimeWarning, stacklevel=3)
    if error is not None:
        raise error


def _remove_orphans(out: Path, index: dict) -> None:
    """Shard files no index entry lists (a lost engine finished them but never reported) and
    temporary files of killed writes: nothing writes into ``out`` any more."""
    listed = {e["file"] for e in index["shards"]}
    for p in out.iterdir():
        if (re.fullmatch(r"shard-\d+\.safetensors", p.name) and p.name not in listed) or \
                (p.name.startswith(".shard-") and p.suffix == ".tmp"):
            p.unlink(missing_ok=True)


# ---------------------------------------------------------------- engines in Ray actors


class _EngineActor:
    """What runs inside a Ray actor: one nnvllm engine (in the actor's process) and the unit of work."""

    def __init__(self, checkpoint, engine_args: dict) -> None:
        import nnvllm as nv

        self.model = nv.load(checkpoint, isolate=False, **engine_args)

    def about(self) -> dict:
        from .engine.transport import engine_of

        m = self.model
        info = dict(engine_of(m).info())
        info.setdefault("max_model_len", m.llm.llm_engine.model_config.max_model_len)
        cfg = m.config
        widths = {k: getattr(cfg, k) for k in ("hidden_size", "n_embd", "d_model", "intermediate_size", "n_inner",
                                               "vocab_size") if isinstance(getattr(cfg, k, None), int)}
        return {"checkpoint": str(m.checkpoint), "n_layers": m.n_layers, "architectures": list(cfg.architectures),
                "config": widths, "info": info, "host": socket.gethostname(), "pid": os.getpid()}

    def tokenize(self, prompts: list[str]) -> list[list[int]]:
        return self.model.tokenizer(prompts)["input_ids"]

    def collect_chunk(self, *args) -> tuple[dict, dict]:
        return _collect_chunk(self.model, *args)


class _Tokenizer:
    """A :class:`RayEngine`'s tokenizer where the checkpoint is not at hand here: the actor's, by call."""

    def __init__(self, actor) -> None:
        self.actor = actor

    def __call__(self, prompts):
        import ray

        return {"input_ids": ray.get(self.actor.tokenize.remote(list(prompts)))}


class _Info:
    def __init__(self, info: dict) -> None:
        self._info = info

    def info(self) -> dict:
        return dict(self._info)


class RayEngine:
    """An nnvllm engine inside a Ray actor, as :func:`nnvllm.collect` takes it in its list of engines.

    Made by :func:`ray_engines`. It carries what ``collect`` checks before anything runs (the
    checkpoint, layers, module layout, widths, the engine's dtype and limits); the work itself
    runs in the actor. ``close()`` ends the actor (and its engine).

    Attributes:
        actor: the Ray actor handle.
        host, pid: where the engine runs.
        label: how warnings and the dataset's index name it.
    """

    def __init__(self, actor, about: dict) -> None:
        from .arch import arch_for

        self.actor = actor
        self._about = about
        self.checkpoint = about["checkpoint"]
        self.n_layers = int(about["n_layers"])
        self.arch = arch_for(about["architectures"], where=repr(self.checkpoint))
        self.config = types.SimpleNamespace(architectures=list(about["architectures"]), **about["config"])
        self.host, self.pid = about["host"], about["pid"]
        self.label = f"Ray actor pid {self.pid} on {self.host}"
        self._tokenizer = None

    @property
    def tokenizer(self):
        """The checkpoint's tokenizer, read here when the checkpoint is a folder this machine sees
        (shared storage), else the actor's, called remotely (plain prompts only)."""
        if self._tokenizer is None:
            if os.path.isdir(self.checkpoint):
                from transformers import AutoTokenizer

                self._tokenizer = AutoTokenizer.from_pretrained(self.checkpoint)
            else:
                self._tokenizer = _Tokenizer(self.actor)
        return self._tokenizer

    def _engine_adapter(self) -> _Info:
        return _Info(self._about["info"])

    def close(self) -> None:
        """End the actor (its engine and memory go with it)."""
        import ray

        ray.kill(self.actor)

    def __repr__(self) -> str:
        return f"<nnvllm RayEngine {os.path.basename(self.checkpoint.rstrip('/'))!r}: {self.label}>"


def ray_engines(model: str | os.PathLike | None = None, n: int = 2, *, num_cpus: float = 1, num_gpus: float = 0,
                options: dict | None = None, **engine_args: Any) -> list[RayEngine]:
    """Start ``n`` Ray actors, each holding an nnvllm engine of ``model``, for :func:`nnvllm.collect`.

    Needs a running Ray cluster (``ray.init(address=...)`` in this process, or ``ray.init()`` for
    one on this machine) and ``ray`` (``pip install 'nnvllm[dist]'``). Each actor loads the engine
    in its own process (``nv.load(model, isolate=False, **engine_args)``): the checkpoint must be
    readable at the same path on every node, or be a hub id every node can fetch.

    Args:
        model: a checkpoint directory or hub id; None for the embedded toy model.
        n: how many actors (engines).
        num_cpus, num_gpus: what Ray reserves for each actor (one GPU per engine on a GPU cluster:
            ``num_gpus=1``; more with ``tensor_parallel_size``).
        options: further ``actor.options(...)`` (``scheduling_strategy``, ``resources``, ...).
        **engine_args: as for :func:`nnvllm.load`.

    Returns:
        The engines, started (each actor's engine is up before this returns); a failed start ends
        every actor started and raises.

    Example:
        >>> ray.init(address="auto")                                          # doctest: +SKIP
        >>> engines = nnvllm.distributed.ray_engines("/shared/ckpt", n=8, num_gpus=1)   # doctest: +SKIP
        >>> ds = nv.collect(engines, prompts, "/shared/acts", max_tokens=64)  # doctest: +SKIP
    """
    from . import _validate

    try:
        import ray
    except ImportError:
        raise ImportError("nnvllm.distributed.ray_engines needs Ray: pip install 'nnvllm[dist]' "
                          "(or pip install ray)") from None
    n = _validate.integer("n", n, lo=1, expected="expected an int >= 1 (how many engines)")
    if not ray.is_initialized():
        raise RuntimeError("no Ray cluster is connected in this process: call ray.init(address=...) (a "
                           "cluster) or ray.init() (this machine) first")
    if model is None:
        from . import toy

        model = toy.path()
    engine_args = _validate.engine_args(engine_args)
    cls = ray.remote(_EngineActor)
    opts = {"num_cpus": num_cpus, "num_gpus": num_gpus, "max_concurrency": DEPTH, **(options or {})}
    actors = [cls.options(**opts).remote(str(model), engine_args) for _ in range(n)]
    try:
        abouts = ray.get([a.about.remote() for a in actors])
    except BaseException:
        for a in actors:
            ray.kill(a)
        raise
    return [RayEngine(a, about) for a, about in zip(actors, abouts)]
