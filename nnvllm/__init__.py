"""nnvllm: look inside language models while vLLM generates.

The public verbs, one hop from here:

- :func:`load` (``engine/__init__.py``) — a vLLM engine through nnsight, on GPU or CPU, in-process or
  isolated in its own process (``engine/isolated.py``, ``engine/server.py``); :func:`engines` lists
  the live ones. Every verb reaches the engine through one contract with two transports
  (``engine/transport.py``); :class:`EngineDied` (``engine/isolated.py``) says an isolated engine is gone.
- :func:`generate` (``capture.py``) — one generation: logits, samples, every layer's activations, the
  per-head sites q/k/v/z, SAE features (``saes=[...]``: ``run.features``).
- :class:`Edit` (``edits.py``) — change the model while it generates (``generate(..., edits=[...])``:
  steering, ablation, scaling, patching, ``Edit.feature`` steering by an SAE feature), the same in
  :func:`reference`; :func:`steering_vector` (``analyses.py``) builds a direction from contrastive prompts.
- :func:`stream` (``streaming.py``) — the same, step by step while the engine generates (:class:`Stream`
  of :class:`Step` s: new tokens, their probabilities, the lens top-1 per layer); ``LiveGeneration``
  (``widgets/live.py``) shows it live with Stop and Replay.
- ``widgets/`` — the notebook explorers (``explorers.py``: lens, samples, patching, compare;
  ``live.py``: a generation as it runs; ``features.py``: SAE features over a generation; ``base.py``:
  what they share); what they show is computed by the pure functions of ``views.py`` and
  ``views_features.py``.
- :func:`attribute` (``analyses.py``; math in ``heads.py``) — direct logit attribution to every head,
  MLP and the embedding; ``Run.attention`` rebuilds attention patterns from captured q and k.
- :class:`SAE` (``sae.py``) — a sparse autoencoder in sae-lens's saved layout (``SAE.load``); pass
  ``saes=[...]`` to :func:`generate` to encode inside the engine (``run.features``).
- :mod:`chat` (``chat.py``) — a conversation (a list of ``{"role", "content"}`` messages) wherever a
  prompt goes, rendered as vLLM's ``LLM.chat`` renders it; ``run.roles`` labels every position, the
  plots hatch the template's (``lens.plot(positions="content")`` hides them);
  ``nv.chat.render(model.tokenizer, messages)`` shows the text, token ids and roles before a run.
- :func:`collect` (``store.py``) — many prompts, chunked to disk under a memory budget, read lazily
  (:class:`Dataset`); the on-disk format in ``shards.py``, SAE features in it in ``sae_data.py``,
  sae-lens's activation cache (``format="sae_lens"``) in ``sae_cache.py``; several engines (a list of
  models, or Ray actors) in ``distributed.py``.
- :func:`reference` (``reference.py``) — the same capture on plain transformers (ground truth).
- :func:`logit_lens`, :func:`patch`, :func:`steering_vector` (``analyses.py``; math in ``lens.py``, ``patching.py``).
- :func:`compare` (``compare.py``) — discrepancies between two runs (vLLM vs HF, TP1 vs TP2).
- :class:`Run`, :class:`Samples` (``results.py``) — what those return; :class:`Lens` (``lens.py``),
  :class:`PatchResult` (``patching.py``), :class:`Discrepancy` (``compare.py``), :class:`Dataset`
  (``store.py``) and :class:`EngineInfo` (``engine/__init__.py``) are the other results.
- :class:`Arch`, :data:`ARCHS`, :func:`register_arch` (``arch.py``) — the model families nnvllm knows
  (one table: where blocks, norms, unembedding, sites and heads live) and how to add one.
- :mod:`toy` (``toy.py``) — the embedded toy model, the default everywhere.
- :mod:`testing` (``testing.py``) — tiny random checkpoints of each tested family, for tests.

Importing nnvllm imports neither vLLM nor nnsight and changes no global state.
"""

from . import chat, sampling
from .analyses import attribute, logit_lens, patch, steering_vector
from .arch import ARCHS, Arch, register_arch
from .capture import generate
from .compare import Discrepancy, compare
from .edits import Edit
from .engine import EngineInfo, engines, load
from .engine.isolated import EngineDied
from .lens import Lens
from .patching import PatchResult
from .reference import reference
from .results import Run, Samples
from .sae import SAE
from .store import Dataset, collect
from .streaming import Step, Stream, stream

__version__ = "0.1.0"


def __getattr__(name: str):
    # nnvllm.toy loads on first use: imported eagerly here, it would already be in sys.modules when
    # `python -m nnvllm.toy` runs it as __main__, and runpy warns about exactly that.
    if name == "toy":
        import importlib

        return importlib.import_module(f"{__name__}.toy")
    raise AttributeError(f"module 'nnvllm' has no attribute {name!r}")

__all__ = ["load", "engines", "EngineDied", "generate", "stream", "Stream", "Step", "Edit", "steering_vector", "collect", "reference", "logit_lens", "patch", "compare", "attribute",
           "Run", "Samples", "Lens", "PatchResult", "Discrepancy", "Dataset", "EngineInfo", "Arch", "ARCHS",
           "register_arch", "SAE", "chat", "sampling", "toy",
           "__version__"]
