"""The real-browser smoke test: a notebook's widget, run in JupyterLab, redraws when used.

Everything else about widgets is tested through their state; this checks the part only a browser
shows: the lab extension renders the widget, a key press on the slider reaches the kernel, and the
plot in the Output widget is redrawn. Needs /usr/bin/chromium and playwright
(``scripts/install_browser.sh``); skips without them.
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import browser  # tests/browser.py, the harness

REPO = Path(__file__).resolve().parents[1]
ARTIFACTS = REPO / "build" / "test-artifacts"
LENS_NOTEBOOK = "notebooks/01_logit_lens.ipynb"
# Notebooks this file runs whole with Run All (nbmake's run of them is left out in the same session:
# tests/conftest.py): the lens notebook, and those whose explorers must answer after Run All.
SEVERAL_NOTEBOOK = "notebooks/05_several_models.ipynb"
STEERING_NOTEBOOK = "notebooks/06_steering.ipynb"
HEADS_NOTEBOOK = "notebooks/07_heads.ipynb"
BROWSER_NOTEBOOKS = {"test_lens_notebook_in_browser": LENS_NOTEBOOK,
                     "test_explorers_answer_after_run_all": (SEVERAL_NOTEBOOK, STEERING_NOTEBOOK),
                     "test_head_explorer_answers_a_click_after_run_all": HEADS_NOTEBOOK}


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """One JupyterLab and one chromium for the file's tests (each test's notebook in the lab's root).

    Each start costs CPU the 2-core test machine shares with the engines (a lab ~8 s, chromium
    ~12-16 s of CPU, measured per test); a test shuts its kernels down when done
    (``opened``), so no engine outlives its test."""
    why = browser.missing_requirements()
    if why:
        print(f"skipping browser test: {why}")
        pytest.skip(why)
    root = tmp_path_factory.mktemp("lab")
    for nb in (LENS_NOTEBOOK, SEVERAL_NOTEBOOK, STEERING_NOTEBOOK, HEADS_NOTEBOOK):
        shutil.copy(REPO / nb, root / Path(nb).name)
    with browser.jupyterlab(root) as server, browser.chromium() as ctx:
        yield server, ctx


@contextlib.contextmanager
def opened(lab, name: str, cells: list[str] | None = None):
    """Open notebook ``name`` of the lab's root (written from ``cells`` first, if given); yield the page.
    On exit close the page and shut down every kernel of the lab."""
    server, ctx = lab
    if cells is not None:
        browser.write_notebook(server.root_dir / name, cells)
    page = browser.open_notebook(ctx, server, name)
    try:
        yield page
    finally:
        page.close()
        browser.shutdown_kernels(server)


def _drive(lab, notebook: str, shot: Path, prompt: str | None = None, cells: list[str] | None = None) -> dict:
    """Open ``notebook``, Run All, press ArrowRight on the layer slider; then, with ``prompt``, type it
    into the explorer and click its Run button (a call to the engine after Run All must answer).
    Return what was seen."""
    t0 = time.monotonic()
    with opened(lab, notebook, cells) as page:
        run_s = browser.run_all(page)
        loaded = browser.cell_output(page, "nv.load(")
        assert browser.widget(page, "nnvllm-lens").is_visible(), "explorer (.nnvllm-lens) not rendered"
        before_value = browser.slider_readout(page, "nnvllm-layer")
        before = browser.img_src(page, "nnvllm-plot")
        assert before.startswith("data:image/"), f"no plot image in .nnvllm-plot: {before[:80]!r}"
        browser.press_slider(page, "nnvllm-layer", "ArrowRight")
        after = browser.wait_img_src_change(page, "nnvllm-plot", before)
        after_value = browser.slider_readout(page, "nnvllm-layer")
        ran = None
        if prompt is not None:
            browser.fill_text(page, "nnvllm-lens", prompt)
            browser.click_button(page, "nnvllm-lens", "Run")
            ran = browser.wait_img_src_change(page, "nnvllm-plot", after) != after
            errors = browser.widget(page, "nnvllm-lens").locator(".nnvllm-error").first.inner_text().strip()
            assert not errors, f"the explorer showed an error after Run All and a click: {errors[:300]}"
        browser.screenshot(page, shot, css_class="nnvllm-lens")
    seen = {
        "run_s": run_s,
        "total_s": time.monotonic() - t0,
        "before_value": before_value,
        "after_value": after_value,
        "changed": after != before,
        "ran_after_run_all": ran,
        "load_cell": loaded,
    }
    print(f"{notebook}: {seen}")
    return seen


@pytest.mark.browser
def test_lens_notebook_in_browser(lab):
    seen = _drive(lab, Path(LENS_NOTEBOOK).name, ARTIFACTS / "lens_notebook.png", prompt="The capital of Italy is")
    assert seen["changed"], "plot did not redraw after ArrowRight on the layer slider"
    assert seen["after_value"] != seen["before_value"]
    assert seen["ran_after_run_all"], "the explorer's Run button did not redraw after Run All (engine closed?)"
    _assert_quiet_load(seen["load_cell"])


def _assert_quiet_load(shown: str | None) -> None:
    """A load cell shows nnvllm's one line (model, engine, memory) and nothing of vLLM's start-up."""
    assert shown is not None, "no cell calls nv.load("
    lines = [ln for ln in shown.splitlines() if ln.strip()]
    assert 1 <= len(lines) <= 3 and lines[0].startswith("nnvllm: "), f"the load cell shows {len(lines)} lines: {shown[:800]}"
    assert "WARNING" not in shown and "[rank" not in shown, shown[:800]


def _wait_status(page, pattern: str, timeout: float) -> None:
    """Wait until the LiveGeneration's status matches ``pattern`` (a JavaScript regex) with no error
    shown; on a timeout, fail with the status and error text the page shows then."""
    try:
        page.wait_for_function(
            "([sel, pat]) => { const e = document.querySelector(sel); return e && new RegExp(pat).test(e.innerText.trim())"
            " && !document.querySelector('.jp-Notebook .nnvllm-live .nnvllm-error')?.innerText.trim(); }",
            arg=[".jp-Notebook .nnvllm-live-status", pattern], timeout=timeout * 1000, polling=200)
    except Exception as e:  # noqa: BLE001 - re-raised with what the widget shows
        shown = browser.widget(page, "nnvllm-live-status").inner_text().strip()
        err = browser.widget(page, "nnvllm-live").locator(".nnvllm-error").first.inner_text().strip()
        raise AssertionError(f"status {shown!r} never matched {pattern!r} in {timeout} s; error shown: {err[:600]!r}") from e


@pytest.mark.browser
def test_explorers_answer_after_run_all(lab):
    """Notebooks 05 and 06, Run All, then their explorers are used: 05's LensExplorer runs a new prompt
    on the engine, 06's LiveGeneration replays (the engines stay open after Run All), and their load
    cells show one line each."""
    seen = _drive(lab, Path(SEVERAL_NOTEBOOK).name, ARTIFACTS / "several_models.png", prompt="The capital of Italy is")
    assert seen["ran_after_run_all"], "05's explorer did not answer after Run All (engine closed?)"
    _assert_quiet_load(seen["load_cell"])
    with opened(lab, Path(STEERING_NOTEBOOK).name) as page:
        browser.run_all(page)
        _assert_quiet_load(browser.cell_output(page, "nv.load("))
        status = browser.widget(page, "nnvllm-live-status")
        # The notebook replays once in code (replay 1); the click is replay 2. Waiting for the status
        # that names it needs no glimpse of the transient "generating", which a loaded machine may
        # hand the page in one batch together with the "done" after it.
        _wait_status(page, r"^done: \d+ token\(s\), replay 1$", 120)
        browser.click_button(page, "nnvllm-live", "Replay")
        _wait_status(page, r"^done: \d+ token\(s\), replay 2$", 120)
        final = status.inner_text().strip()
        browser.screenshot(page, ARTIFACTS / "steering_replay.png", css_class="nnvllm-live")
    assert final.startswith("done: "), final


@pytest.mark.browser
def test_head_explorer_answers_a_click_after_run_all(lab):
    """Notebook 07, Run All, then a click on a cell of the HeadExplorer's block x head map opens that
    head: the heat strip is redrawn and the status line names the head, with no error shown."""
    with opened(lab, Path(HEADS_NOTEBOOK).name) as page:
        browser.run_all(page)
        _assert_quiet_load(browser.cell_output(page, "nv.load("))
        assert browser.widget(page, "nnvllm-heads").is_visible(), "explorer (.nnvllm-heads) not rendered"
        before = browser.img_src(page, "nnvllm-plot")
        assert before.startswith("data:image/"), f"no plot image in .nnvllm-plot: {before[:80]!r}"
        status = browser.widget(page, "nnvllm-head-status")
        shown = status.inner_text().strip()
        cell = browser.widget(page, "nnvllm-head-map").locator(".nnvllm-head-cell").first  # head 0.0
        cell.scroll_into_view_if_needed()
        cell.click()
        after = browser.wait_img_src_change(page, "nnvllm-plot", before)
        page.wait_for_function(
            "sel => { const e = document.querySelector(sel); return e && /^head 0\\.0 at step 0 /.test(e.innerText.trim()); }",
            arg=".jp-Notebook .nnvllm-head-status", timeout=30_000, polling=100)
        errors = browser.widget(page, "nnvllm-heads").locator(".nnvllm-error").first.inner_text().strip()
        browser.screenshot(page, ARTIFACTS / "head_explorer.png", css_class="nnvllm-heads")
    assert not shown.startswith("head 0.0 "), f"the notebook left head 0.0 open; the click would change nothing: {shown}"
    assert after != before and not errors, errors[:300]


HARNESS_CELLS = [
    "%matplotlib inline\nimport ipywidgets as W\nimport matplotlib.pyplot as plt",
    """\
slider = W.IntSlider(value=0, min=0, max=5, description="layer", continuous_update=False)
slider.add_class("nnvllm-layer")
out = W.Output()
out.add_class("nnvllm-plot")

def draw(layer):
    out.clear_output(wait=True)
    with out:
        fig, ax = plt.subplots(figsize=(4, 3))
        ax.plot(range(10), [layer * i for i in range(10)])
        ax.set_title(f"layer {layer}")
        plt.show()

slider.observe(lambda change: draw(change["new"]), names="value")
draw(slider.value)
box = W.VBox([slider, out])
box.add_class("nnvllm-lens")
box""",
]


@pytest.mark.browser
def test_harness_on_widget_notebook(lab):
    """Self-test of tests/browser.py on a tiny notebook with the same widget classes."""
    seen = _drive(lab, "harness.ipynb", ARTIFACTS / "harness_notebook.png", cells=HARNESS_CELLS)
    assert seen["changed"], "plot did not redraw after ArrowRight on the slider"
    assert (seen["before_value"], seen["after_value"]) == ("0", "1")


TWO_ENGINE_CELLS = [
    """\
import os
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
import ipywidgets as W
import nnvllm as nv
first = nv.load()  # in-process (the CPU default)""",
    "second = nv.load(isolate=True)  # in its own process",
    """\
P = "The capital of France is"
a = nv.generate(first, P, max_tokens=2).text[0]
b = nv.generate(second, P, max_tokens=2).text[0]
live = len(nv.engines())
first.close()
c = nv.generate(second, P, max_tokens=2).text[0]  # closing one engine leaves the other working
second.close()
w = W.HTML(f"{a}|{b}|{c}|{live}|{len(nv.engines())}")
w.add_class("nnvllm-two-engines")
w""",
]


LIVE_CELLS = [
    """\
from nnvllm.widgets import LiveGeneration
model = nv.load()  # in-process again, after both engines above were closed""",
    """\
live = LiveGeneration(model, "The capital of France is", max_tokens=50, ignore_eos=True, pace=0.4)
live""",
]


@pytest.mark.browser
def test_two_engines_then_live_generation_in_one_kernel_in_browser(lab):
    """One notebook, one kernel, run from JupyterLab (one kernel start instead of two: ~20 s of the 2-core
    box's CPU):

    - two engines in one kernel (in-process, then isolated): both answer, closing the first leaves the
      second working, none is left;
    - then an in-process engine again, and the LiveGeneration widget shows tokens and the
      lens panel growing while the engine generates (in a background thread); its Stop button, clicked
      in the page, ends the generation early with what was produced.
    """
    import re

    with opened(lab, "two_engines_then_live.ipynb", TWO_ENGINE_CELLS + LIVE_CELLS) as page:
        browser.run_all(page, timeout=420)
        text = browser.widget(page, "nnvllm-two-engines").inner_text(timeout=60_000)
        browser.screenshot(page, ARTIFACTS / "two_engines.png", css_class="nnvllm-two-engines")
        assert [x.strip() for x in text.split("|")] == ["Paris.", "Paris.", "Paris.", "2", "0"], text

        status = browser.widget(page, "nnvllm-live-status")
        deadline = time.monotonic() + 120
        seen = []
        while time.monotonic() < deadline:
            text = status.inner_text(timeout=30_000).strip()
            seen.append(text)
            m = re.match(r"generating: (\d+) token", text)
            if m and int(m.group(1)) >= 3:
                break
            time.sleep(0.2)
        assert any(re.match(r"generating: [1-9]", t) for t in seen), f"no live progress shown: {seen[-5:]}"
        rows_live = browser.widget(page, "nnvllm-live-panel").locator("tr").count()
        browser.click_button(page, "nnvllm-live", "Stop")
        page.wait_for_function(
            "sel => { const e = document.querySelector(sel); return e && /stopped after/.test(e.innerText); }",
            arg=".jp-Notebook .nnvllm-live-status", timeout=60_000, polling=200)
        final = status.inner_text().strip()
        cells = browser.widget(page, "nnvllm-live-panel").locator("td").count()
        browser.screenshot(page, ARTIFACTS / "live_generation.png", css_class="nnvllm-live")
    n = int(re.match(r"stopped after (\d+) token", final).group(1))
    assert 3 <= n < 50, final
    assert rows_live >= 2 and cells >= 3, (rows_live, cells)
