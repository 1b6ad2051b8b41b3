"""Watch a generation while the engine runs it: ``nv.stream(model, prompts, ...)``.

A :class:`Stream` is an iterator of :class:`Step` s, one per engine step that produced tokens: the new
token of each prompt, its sampling probability, and the logit lens's top-1 token at every captured
layer for the position that produced it. When the generation ends (or :meth:`Stream.stop` ends it)
``stream.run`` is the same :class:`~nnvllm.Run` :func:`nnvllm.generate` returns for the tokens that
were produced, so a stream loses nothing against a plain call. In-process and isolated engines
stream alike (the isolated one over a streamed HTTP response).

The worker records the generation as :func:`nnvllm.generate` does; after each step the client asks it
for the rows computed since the last step (``CaptureWorker.nnvllm_peek``: a few positions per prompt,
the residual stream of the captured layers, each SAE's features and the step's logits row) and
projects them through the engine's own final norm and unembedding on the client. That costs a round trip per step: a stream is
for watching, :func:`nnvllm.generate` for speed.

Example::

    s = nv.stream(model, ["The capital of France is"], max_tokens=8)
    for step in s:
        print(step.text[0], step.lens_ids[0].tolist())
    run = s.run
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import Tensor

from .results import Run

__all__ = ["stream", "Stream", "Step"]


@dataclass
class Step:
    """What one engine step produced, per prompt (lists and tensor rows in prompt order).

    Attributes:
        index: 0, 1, ...: this stream's steps.
        tokens: the token ids that arrived at this step: one, or several where the engine ran ahead of
            the stream (an isolated engine), or none for a prompt that has finished.
        text: everything generated so far.
        probs: the sampling probability of each new token (as :attr:`nnvllm.Samples.probs`).
        lens_ids: ``[prompt, layer]`` the logit lens's top-1 token at the position that produced the
            newest token, for each captured layer (-1 where a prompt has no token yet); None without layers.
        lens_probs: ``[prompt, layer]`` its probability under the lens (NaN where none).
        finished: whether each prompt's generation has ended.
        features: per SAE of the call (``saes=``), per prompt: the features of the position that
            produced the newest token, as ``run.features`` holds them per position (``(ids [k],
            values [k])``, or the dense ``[d_sae]`` code with ``sae_dense=True``), or None where a
            prompt has no token yet; empty without SAEs.
    """

    index: int
    tokens: list[list[int]]
    text: list[str]
    probs: list[list[float]]
    lens_ids: Tensor | None
    lens_probs: Tensor | None
    finished: list[bool]
    features: list[list] = field(default_factory=list)


class Stream:
    """Iterate for :class:`Step` s; then :attr:`run` holds the whole :class:`~nnvllm.Run`.

    :meth:`stop` (from any thread, e.g. a widget's button) ends the generation at the next step at
    which every prompt has begun (called before iterating: at the first step); :attr:`run` then holds
    what was produced. Leaving the loop early (``break``) aborts the generation and leaves no run.
    """

    def __init__(self, model, req, events) -> None:
        self.model = model
        self._req = req
        self._events = events
        self._stop = req.stop
        self.run: Run | None = None
        self.steps: list[Step] = []
        self.stopped = False
        self._rows: dict[str, list[Tensor]] = {}  # request -> residual rows [layer, d] by position
        self._logits: dict[str, list[Tensor]] = {}  # request -> logits rows by step
        self._final: dict[str, Tensor] = {}  # request -> the Run's sampling probabilities (at the end)
        # request -> per SAE, its rows by position: (ids, values) or the dense code
        self._features: dict[str, list[list]] = {}
        self._unembed = None

    def stop(self) -> None:
        """End the generation at the next step; :attr:`run` keeps what was produced."""
        self._stop.set()

    def __iter__(self):
        seen: list[int] = [0] * len(self._req.prompts)
        try:
            yield from self._iterate(seen)
        finally:
            if self.run is None:  # left early (break, an error): abort the generation, disarm the worker
                self._events.close()

    def _iterate(self, seen: list[int]):
        from .capture import _assemble

        for kind, outputs, extra in self._events:
            if kind == "done":
                self._events.close()  # the transport's generator ends here: the engine is free for the next call
                self.stopped = self._stop.is_set()
                self.run = run = _assemble(self.model, self._req, outputs, extra)
                # Tokens that arrived with the end (an isolated engine runs ahead of its frames):
                # one last step, from the Run itself.
                for i, o in enumerate(outputs):
                    if run.resid is not None:
                        self._rows[o["request_id"]] = list(run.resid[i].unbind(1))
                    self._features[o["request_id"]] = [_by_position(f[i]) for f in run.features]
                    self._final[o["request_id"]] = run.samples[i].probs
                step = self._step(outputs, seen)
                if step is not None:
                    self.steps.append(step)
                    yield step
                return
            self._take(extra)
            step = self._step(outputs, seen)
            if step is not None:
                self.steps.append(step)
                yield step

    def __repr__(self) -> str:
        state = "done" if self.run is not None else "running"
        return f"Stream({len(self._req.prompts)} prompt(s), {len(self.steps)} step(s), {state})"

    # ---- internals
    def _take(self, peek: bytes | None) -> None:
        if not peek:
            return
        import io

        peek = torch.load(io.BytesIO(peek), map_location="cpu", weights_only=True)  # plain data and tensors
        if peek.get("error"):
            raise RuntimeError(f"the capture failed inside the engine: {peek['error']}")
        for rid, ent in peek.items():
            key = rid.rsplit("-", 1)[0]  # vLLM's internal id: the external one (no "-") + "-<suffix>"
            rows = self._rows.setdefault(key, [])
            if "resid" in ent:
                rows.extend(ent["resid"].unbind(1))  # [layer, d] per position
            if "logits" in ent:
                self._logits.setdefault(key, []).extend(ent["logits"].unbind(0))
            for j, f in enumerate(ent.get("features", ())):
                per = self._features.setdefault(key, [[] for _ in ent["features"]])
                per[j].extend(_by_position(f["dense"] if "dense" in f else (f["ids"], f["values"])))

    def _step(self, outputs: list[dict | None], seen: list[int]) -> Step | None:
        from .sampling import sampling_probs

        req = self._req
        new, probs, rows, text, finished = [], [], [], [], []
        feats = [[] for _ in req.sae_specs]
        for i, o in enumerate(outputs):
            toks = [] if o is None else o["token_ids"]
            fresh = toks[seen[i]:]
            new.append(list(fresh))
            text.append("" if o is None else o["text"])
            finished.append(bool(o and o.get("finished")))
            rid = None if o is None else o["request_id"]
            ps = []
            lg = self._logits.get(rid, [])
            for k in range(seen[i], len(toks)):
                if rid in self._final:
                    ps.append(float(self._final[rid][k]))
                elif k < len(lg):
                    p = sampling_probs(lg[k][None].float(), req.sampling["temperature"], req.sampling["top_p"])
                    ps.append(float(p[0, toks[k]]))
                else:
                    ps.append(float("nan"))
            probs.append(ps)
            pos = (len(o["prompt_token_ids"]) + len(toks) - 2) if o is not None and toks else -1
            r = self._rows.get(rid, [])
            rows.append(r[pos] if 0 <= pos < len(r) else None)
            for j, per in enumerate(self._features.get(rid) or [[] for _ in feats]):
                feats[j].append(per[pos] if 0 <= pos < len(per) else None)
            seen[i] = len(toks)
        if not any(new):
            return None
        lens_ids = lens_probs = None
        if req.layer_ids:
            lens_ids = torch.full((len(rows), len(req.layer_ids)), -1, dtype=torch.long)
            lens_probs = torch.full((len(rows), len(req.layer_ids)), float("nan"))
            have = [i for i, r in enumerate(rows) if r is not None]
            if have:
                from .analyses import unembedding
                from .lens import lens_topk

                if self._unembed is None:
                    self._unembed = unembedding(self.model)
                ids, ps = lens_topk(torch.stack([rows[i] for i in have], dim=1), self._unembed, k=1)
                lens_ids[have] = ids[:, :, 0].T
                lens_probs[have] = ps[:, :, 0].T
        return Step(index=len(self.steps), tokens=new, text=text, probs=probs, lens_ids=lens_ids,
                    lens_probs=lens_probs, finished=finished, features=feats)


def _by_position(f) -> list:
    """One request's features of one SAE, as a list by position: ``(ids, values)`` pairs, or dense rows."""
    if isinstance(f, tuple):
        return list(zip(f[0].unbind(0), f[1].unbind(0)))
    return list(f.unbind(0))


def stream(
    model,
    prompts: str | Sequence[str],
    max_tokens: int = 10,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int | None = None,
    layers="all",
    logits: bool = True,
    top_k: int = 5,
    sites: Sequence[str] = (),
    ignore_eos: bool = False,
    edits=None,
    saes=None,
    sae_k: int = 32,
    sae_dense: bool = False,
    chat_template: str | None = None,
    chat_template_kwargs: dict | None = None,
) -> Stream:
    """Like :func:`nnvllm.generate`, step by step: iterate the returned :class:`Stream` for
    :class:`Step` s while the engine generates; ``stream.run`` is then the whole Run.

    The arguments are :func:`nnvllm.generate`'s (checked before the engine runs; a prompt may be a
    conversation). ``layers`` are the blocks whose logit-lens top-1 each step reports (and the Run keeps);
    with ``saes`` each step also carries each SAE's features of the newest position (:attr:`Step.features`)
    and ``stream.run.features`` is what :func:`nnvllm.generate` returns.
    """
    from .capture import _request

    req = _request(model, prompts, max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed,
                   layers=layers, logits=logits, top_k=top_k, sites=sites, ignore_eos=ignore_eos, edits=edits,
                   stream=True, saes=saes, sae_k=sae_k, sae_dense=sae_dense, chat_template=chat_template,
                   chat_template_kwargs=chat_template_kwargs)
    req.stop = threading.Event()
    events = req.engine.stream(req.prompts, req.params, req.spec, req.stop)
    return Stream(model, req, events)

