"""The README's "In one screen" block runs as written, and the values its comments state are the real ones
(``run.logits[0].shape`` is ``[3, 622]``: a comment that states a shape must state the one that comes).
"""

from __future__ import annotations

import ast
import linecache
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

README = Path(__file__).resolve().parents[1] / "README.md"


def _screen() -> str:
    text = README.read_text()
    part = text.split("## In one screen", 1)[1]
    return re.search(r"```python\n(.*?)```", part, re.S).group(1)


def test_readme_block_runs_and_its_stated_values_are_true():
    code = _screen()
    line = next(ln for ln in code.splitlines() if ln.startswith("run.text, run.logits[0].shape"))
    stated = ast.literal_eval(line.split("#", 1)[1].split(":", 1)[0].strip())
    scope: dict = {}
    try:
        name = "<README.md: In one screen>"
        linecache.cache[name] = (len(code), None, code.splitlines(True), name)  # nnsight reads `with` bodies back
        exec(compile(code, name, "exec"), scope)  # noqa: S102 - our own README
        run = scope["run"]
        got = (run.text, list(run.logits[0].shape), list(run.resid[0].shape))
        assert got == tuple(stated), f"README states {stated}, the toy model gives {got}"
        line = next(ln for ln in code.splitlines() if ln.startswith("steered.text"))
        stated_steer = ast.literal_eval(line.split("#", 1)[1].split(":", 1)[0].strip())
        assert scope["steered"].text == stated_steer, (stated_steer, scope["steered"].text)
    finally:
        for name in ("other", "model"):
            m = scope.get(name)
            if m is not None:
                m.close()
