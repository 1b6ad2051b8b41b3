"""Thin ipywidgets controllers over nnvllm's analyses, for exploring in a notebook.

Each explorer owns its controls and its state; slow calls (anything that runs the engine) sit
behind a button, views that only re-read a result (choosing a layer, a step, a cell) redraw at
once without the engine. An exception from a callback is shown in the widget's error area
(``.error``, CSS class ``nnvllm-error``) and kept in ``.last_error``; the widget keeps working.
What the engine prints while it runs (vLLM's progress bars) goes to a folded "engine log" (``.log``).

Everything a test needs is state: set a control's ``.value``, call ``.run_button.click()``, read
the result attributes (``lens``, ``result``, ``run``, ``discrepancy``), the table HTML
(``.table.value``) and the last drawn image (``.png``, PNG bytes).

This package is the only part of nnvllm that imports ipywidgets (``base``: what every explorer
shares; ``explorers``: lens, samples, patching, compare; ``live``: a generation as it runs;
``features``: SAE features over a generation; ``heads``: attention heads, where they look and what
they add to a logit). What the widgets show (tables, HTML, figures) is computed by the pure
functions of :mod:`nnvllm.views` (and ``views_features``, ``views_heads``), tested without a
notebook; the analyses they run are nnvllm's verbs (``nv.logit_lens``, ``nv.patch``, ``nv.compare``,
``nv.stream``, ``nv.attribute``).

Example::

    from nnvllm.widgets import LensExplorer
    LensExplorer(model, "The capital of France is")      # displays as its widget
"""

from .base import EngineClosed
from .explorers import LENS_TOP_K, CompareView, LensExplorer, PatchExplorer, SamplesExplorer
from .features import FeatureExplorer
from .heads import HeadExplorer
from .live import LiveGeneration

__all__ = ["LENS_TOP_K", "CompareView", "EngineClosed", "FeatureExplorer", "HeadExplorer", "LensExplorer",
           "LiveGeneration", "PatchExplorer", "SamplesExplorer"]
