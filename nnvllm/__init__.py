"""nnvllm: look inside language models while vLLM generates.

The public verbs, one hop from here:

- :func:`load` (``engine.py``) — a vLLM engine through nnsight, on GPU or CPU.
- :mod:`toy` (``toy.py``) — the embedded toy model, the default everywhere.
- :mod:`testing` (``testing.py``) — tiny random GPT-2/Llama checkpoints for tests.

Importing nnvllm imports neither vLLM nor nnsight and changes no global state.
"""

from . import toy
from .engine import load

__version__ = "0.1.0"
__all__ = ["load", "toy", "__version__"]
