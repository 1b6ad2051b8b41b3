"""What every explorer shares: the error area, guarded callbacks, the engine log, PNG output, and
the check that the model's engine is still open."""

from __future__ import annotations

import base64
from collections.abc import Callable
from typing import Any

import ipywidgets as W

from ..views import error_html, figure_png

__all__ = ["EngineClosed"]


class EngineClosed(RuntimeError):
    """The explorer's model was closed: its engine-running controls need the load cell run again."""


def _check_open(model) -> None:
    """Raise :class:`EngineClosed` if ``model``'s engine was closed (its state, as its repr shows it, says so)."""
    state = getattr(model, "_state", None)
    if callable(state) and "closed" in str(state()):
        raise EngineClosed("engine closed \u2014 re-run the load cell (nv.load), then this explorer's cell; "
                           "the controls that re-read the last result still work")


class _Explorer:
    """What every explorer shares: the error area, guarded callbacks and PNG output.

    ``drawn`` holds the control values the current picture was drawn for (a redraw reads the
    controls' values at the moment it runs), ``figure`` the matplotlib Figure behind ``png``.
    """

    widget: W.Box
    run_button: W.Button  # the button behind the explorer's engine call (:meth:`_slow_call`)

    def __init__(self) -> None:
        self.error = W.HTML(value="")
        self.error.add_class("nnvllm-error")
        self.last_error: BaseException | None = None
        self.png: bytes | None = None  # the last image drawn into .plot
        self.figure = None  # the Figure behind .png
        self.drawn: dict[str, Any] = {}
        self.draws = 0
        # The engine's own progress bars and warnings land here, folded away, not in the page.
        self.log = W.Output()
        self.log_box = W.Accordion(children=[self.log], titles=("engine log",), selected_index=None)

    def _quiet(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Call ``fn`` with its printed output captured in ``.log`` (in a kernel); return its result."""
        box: dict[str, Any] = {}
        with self.log:  # in IPython, Output.__exit__ swallows exceptions: carry them out by hand
            try:
                box["value"] = fn(*args, **kwargs)
            except Exception as e:  # noqa: BLE001
                box["error"] = e
        if "error" in box:
            raise box["error"]
        return box["value"]

    def _guard(self, fn: Callable[..., Any], *args: Any, clear: bool = False) -> bool:
        """Run a callback; show an exception in the error area instead of losing it."""
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - a widget callback must not lose errors
            self.last_error = e
            self.error.value = error_html(e, with_traceback=not isinstance(e, EngineClosed))
            return False
        if clear:
            self.last_error = None
            self.error.value = ""
        return True

    def _slow_call(self, fn: Callable[[], Any]) -> None:
        """The explorer's engine call behind its button: the button is disabled while it runs, an
        error goes to the error area, and a success clears the last one."""
        self.run_button.disabled = True
        try:
            self._guard(fn, clear=True)
        finally:
            self.run_button.disabled = False

    def _clear_error(self) -> None:
        self.last_error = None
        self.error.value = ""

    def _show(self, out: W.Output, fig, text: str, **drawn: Any) -> None:
        # Replacing the outputs in one assignment works with or without a kernel and any backend.
        png = figure_png(fig)
        out.outputs = (
            {
                "output_type": "display_data",
                "data": {"image/png": base64.b64encode(png).decode("ascii"), "text/plain": text},
                "metadata": {},
            },
        )
        self.png, self.figure, self.drawn = png, fig, drawn
        self.draws += 1

    def _repr_mimebundle_(self, **kwargs):
        """The live widget, plus a static ``text/html`` copy of what it shows now (its last figure
        and error), for places with no widget manager: an HTML export such as ``make demo``'s, or a
        notebook viewer. JupyterLab shows the widget (its mime type ranks first there)."""
        bundle = self.widget._repr_mimebundle_(**kwargs)
        if isinstance(bundle, tuple):  # (data, metadata)
            data, meta = bundle
        else:
            data, meta = bundle, None
        if self.png:
            img = base64.b64encode(self.png).decode("ascii")
            data = {**data, "text/html": (f"<div class='nnvllm-static'><img src='data:image/png;base64,{img}'/>"
                                          f"{self.error.value}</div>")}
        return data if meta is None else (data, meta)


def _side_by_side(plot: W.Output, other: W.Widget) -> W.HBox:
    # The plot keeps its natural size; a wide table wraps below it instead of squeezing it.
    plot.layout = W.Layout(flex="0 0 auto")
    return W.HBox([plot, other], layout=W.Layout(flex_flow="row wrap", align_items="flex-start"))


def _button(description: str, on_click: Callable[[], None]) -> W.Button:
    b = W.Button(description=description, button_style="primary")
    b.on_click(lambda _: on_click())
    return b
