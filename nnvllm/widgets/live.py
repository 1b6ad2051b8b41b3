"""A generation as it runs: :class:`LiveGeneration` (text, a live logit-lens panel, Stop and Replay)."""

from __future__ import annotations

from typing import Any

from ..chat import is_conversation
from ..results import Run
from ..views import error_html, live_lens_html, tok_html
from .base import EngineClosed, W, _check_open, _Explorer

__all__ = ["LiveGeneration"]


class LiveGeneration(_Explorer):
    """One prompt generating live: the text as tokens arrive, a layers x steps panel of the logit
    lens's top-1 token at each step (:func:`live_lens_html`), a Stop button that ends the
    generation and keeps what was produced (``.run``), and a Replay button that runs the same
    generation again once it has ended.

    The generation runs in a background thread (:func:`nnvllm.stream`), so the notebook, and the
    Stop button, stay responsive; call nothing else on the same engine until it is done
    (``.wait()``). ``pace`` (seconds) waits between steps, to watch a fast model. Replay on a closed
    engine says "engine closed" in the status and the error area, and changes nothing else. A
    replay's closing status names it ("done: 6 token(s), replay 2"), so a replay that produced the
    same tokens still reads differently from the run before it. State
    for tests: ``.steps`` (the :class:`~nnvllm.Step` s), ``.text.value``, ``.panel.value``,
    ``.status.value``, ``.run``, ``.stop_button``, ``.replay_button``, ``.replays``.

    Example::

        live = LiveGeneration(model, "The capital of France is", max_tokens=40)   # displays live
        live.wait(); live.run
        live.replay_button.click(); live.wait()                                  # the same again
    """

    def __init__(self, model, prompt: str | list[dict], max_tokens: int = 20, *, layers="all", pace: float = 0.0,
                 **generate_kwargs: Any) -> None:
        super().__init__()
        if not isinstance(prompt, str) and not is_conversation(prompt):
            raise TypeError(f"prompt={prompt!r}: LiveGeneration shows one prompt (a str, or a conversation: a list "
                            "of {'role', 'content'} messages)")
        if isinstance(pace, bool) or not isinstance(pace, (int, float)) or not 0 <= pace <= 10:
            raise ValueError(f"pace={pace!r}; expected seconds between steps, 0 to 10")
        self.model = model
        self.pace = float(pace)
        self.prompt = prompt
        self._kwargs = dict(max_tokens=max_tokens, layers=layers, **generate_kwargs)
        self.replays = 0
        self.text = W.HTML(value="")
        self.text.add_class("nnvllm-live-text")
        self.panel = W.HTML(value="")
        self.panel.add_class("nnvllm-live-panel")
        self.status = W.HTML(value="generating")
        self.status.add_class("nnvllm-live-status")
        self.stop_button = W.Button(description="Stop", button_style="danger")
        self.stop_button.on_click(lambda _: self.stop())
        self.replay_button = W.Button(description="Replay", icon="repeat", disabled=True,
                                      tooltip="generate the same again")
        self.replay_button.on_click(lambda _: self.replay())
        self.widget = W.VBox([W.HBox([self.stop_button, self.replay_button, self.status]), self.text,
                              self.panel, self.error])
        self.widget.add_class("nnvllm-live")
        self._thread = None
        self._start()  # a bad argument or a closed engine raises here, in the cell that made the widget

    def _start(self, replay: int = 0) -> None:
        import threading

        from ..streaming import stream

        self.stream = stream(self.model, [self.prompt], **self._kwargs)
        self.layers = list(self.stream._req.layer_ids)
        rendered = self.stream._req.rendered[0]  # a conversation shows as the model reads it
        self.prompt_text = self.prompt if rendered is None else rendered.text
        self.steps: list = []
        self._cells: list[list[tuple[str, float]]] = []
        self._generated: list[str] = []
        self.text.value, self.panel.value, self.status.value = tok_html(self.prompt_text), "", "generating"
        self.stop_button.disabled, self.replay_button.disabled = False, True
        self._thread = threading.Thread(target=self._drive, args=(replay,), name="nnvllm-live", daemon=True)
        self._thread.start()

    @property
    def run(self) -> Run | None:
        """The whole Run once the generation has ended (stopped or not), else None."""
        return self.stream.run

    def stop(self) -> None:
        """End the generation at the next step; ``.run`` keeps what was produced."""
        self.stop_button.disabled = True
        self.stream.stop()

    def replay(self) -> None:
        """Run the same generation again (after the last one ended); the widget shows it from the start.

        On a closed engine the status says so and the last generation stays on show."""
        if self._thread is not None and self._thread.is_alive():
            return  # the button is disabled while generating; a call from code waits its turn
        try:
            _check_open(self.model)
            self._start(replay=self.replays + 1)
        except Exception as e:  # noqa: BLE001 - shown in the widget, kept in .last_error
            self.last_error = e
            self.error.value = error_html(e, with_traceback=not isinstance(e, EngineClosed))
            self.status.value = "engine closed" if isinstance(e, EngineClosed) else "failed"
            return
        self.replays += 1
        self._clear_error()

    def wait(self, timeout: float | None = None) -> Run | None:
        """Wait until the generation has ended; return its Run."""
        self._thread.join(timeout)
        return self.run

    def _drive(self, replay: int) -> None:
        import time

        tok = getattr(self.model, "tokenizer", None)
        decode = (lambda i: tok.decode([i])) if tok is not None else str
        try:
            for step in self.stream:
                self.steps.append(step)
                self.text.value = tok_html(self.prompt_text) + f"<b>{tok_html(step.text[0])}</b>"
                if step.tokens[0]:
                    for text, cells in step_columns(step, decode, len(self.layers)):
                        self._generated.append(text)
                        if cells is not None:
                            self._cells.append(cells)
                    if step.lens_ids is not None:
                        self.panel.value = live_lens_html(self.layers, self._cells, self._generated)
                self.status.value = f"generating: {len(self._generated)} token(s)"
                if self.pace:
                    time.sleep(self.pace)
            n = len(self.run.tokens[0])
            ended = f"stopped after {n} token(s)" if self.stream.stopped else f"done: {n} token(s)"
            # the thread, not replay(), names the replay: it has its number before its first step
            self.status.value = ended + (f", replay {replay}" if replay else "")
        except Exception as e:  # noqa: BLE001 - shown in the widget, kept in .last_error
            self.last_error = e
            self.error.value = error_html(e)
            self.status.value = "failed"
        finally:
            self.stop_button.disabled = True
            self.replay_button.disabled = False


def step_columns(step, decode, n_layers: int) -> list[tuple[str, list[tuple[str, float]] | None]]:
    """The lens panel's columns for one stream step of the first prompt: each new token's text and its
    cells (top-1 token and probability per captured layer; None without layers).

    A step can bring more than one token (an isolated engine generates ahead of the frames the stream
    reads); the step's lens is that of the newest token's position, so the earlier tokens' columns are
    left empty rather than shifted onto the wrong token."""
    fresh = step.tokens[0]
    out = []
    for k, token in enumerate(fresh):
        cells = None
        if step.lens_ids is not None:
            if k == len(fresh) - 1:
                cells = [(decode(int(i)) if i >= 0 else "", float(p))
                         for i, p in zip(step.lens_ids[0].tolist(), step.lens_probs[0].tolist())]
            else:
                cells = [("", float("nan"))] * n_layers
        out.append((decode(token), cells))
    return out
