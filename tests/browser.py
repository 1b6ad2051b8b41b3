"""Drive a notebook in a real browser: JupyterLab + headless Debian chromium + Playwright.

The one real-browser smoke test sits on top of state-based widget tests (see DESIGN.md); this
module is its harness. Typical use::

    with jupyterlab(root) as lab, chromium() as browser:
        page = open_notebook(browser, lab, "notebooks/01_logit_lens.ipynb")
        run_all(page)
        before = img_src(page, "nnvllm-plot")
        press_slider(page, "nnvllm-layer", "ArrowRight")
        after = wait_img_src_change(page, "nnvllm-plot", before)
        screenshot(page, "build/test-artifacts/lens_notebook.png")

Facts this encodes (from shared/STACK.md): as root, JupyterLab needs ``allow_root``; the toolbar's
idle indicator lies before a kernel exists, so wait on the status bar's "Python 3 (ipykernel) | Idle";
a news popup covers the notebook unless ``fetchNews`` is off in a private settings dir; and
``windowingMode: "none"`` keeps every cell in the DOM. Never run ``playwright install`` (it
downloads a browser); Playwright drives ``/usr/bin/chromium`` instead.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
KERNEL_IDLE = "Python 3 (ipykernel) | Idle"


def missing_requirements() -> str | None:
    """Return why the browser test cannot run here, or None when it can."""
    if not Path(CHROMIUM).exists():
        return f"{CHROMIUM} not found (run scripts/install_browser.sh)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError as e:
        return f"playwright not importable ({e}); run scripts/install_browser.sh"
    return None


# --------------------------------------------------------------------------------------- server


@dataclass(frozen=True)
class Lab:
    """A running JupyterLab server."""

    url: str  # http://127.0.0.1:PORT
    token: str
    root_dir: Path
    proc: subprocess.Popen
    log: Path

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_settings(settings_dir: Path) -> None:
    # User settings JupyterLab reads from JUPYTERLAB_SETTINGS_DIR: no news popup, no virtual
    # scrolling (cells off screen would otherwise be missing from the DOM).
    files = {
        "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false"},
        "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    }
    for rel, value in files.items():
        p = settings_dir / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(value))


def _call(lab_url: str, token: str, path: str, method: str = "GET", timeout: float = 2.0):
    """One call to the lab's REST API: (status, body bytes)."""
    req = urllib.request.Request(
        lab_url + path,
        method=method,
        headers={"Authorization": f"token {token}"},
        data=b"" if method == "POST" else None,
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.status, r.read()


def _request(lab_url: str, token: str, path: str, method: str = "GET", timeout: float = 2.0) -> int:
    return _call(lab_url, token, path, method, timeout)[0]


def shutdown_kernels(lab: Lab) -> int:
    """Shut down every kernel of ``lab`` (its notebook sessions, then any kernel left); return how many.

    A test that shares one lab with others calls this when done: a closed page leaves its kernel
    running, and with it the kernel's engine and memory."""
    def api(path: str, method: str = "GET"):
        body = _call(lab.url, lab.token, path, method, timeout=30)[1]
        return json.loads(body) if body else None

    n = 0
    for s in api("/api/sessions") or []:
        api(f"/api/sessions/{s['id']}", "DELETE")  # ends its kernel too
        n += 1
    for k in api("/api/kernels") or []:
        api(f"/api/kernels/{k['id']}", "DELETE")
        n += 1
    return n


def _kill_group(proc: subprocess.Popen) -> None:
    # The server runs in its own session (start_new_session), so its group holds it and its kernels.
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        if proc.poll() is not None:
            break
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(wait)


@contextlib.contextmanager
def jupyterlab(root_dir: str | os.PathLike, *, startup_timeout: float = 90.0) -> Iterator[Lab]:
    """Start JupyterLab on 127.0.0.1 (free port, random token) serving ``root_dir``; stop it on exit.

    Uses this interpreter's environment (``sys.executable -m jupyterlab``), so the kernel is the
    venv's. Stops via ``POST /api/shutdown``; kills the process group if that does not work.
    """
    root = Path(root_dir).resolve()
    token = secrets.token_hex(16)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="nnvllm-lab-") as tmp:
        tmp = Path(tmp)
        _write_settings(tmp / "settings")
        (tmp / "workspaces").mkdir()
        env = dict(os.environ)
        env["JUPYTERLAB_SETTINGS_DIR"] = str(tmp / "settings")
        env["JUPYTERLAB_WORKSPACES_DIR"] = str(tmp / "workspaces")
        env["JUPYTER_RUNTIME_DIR"] = str(tmp / "runtime")
        cmd = [
            sys.executable,
            "-m",
            "jupyterlab",
            "--no-browser",
            "--ServerApp.ip=127.0.0.1",
            f"--ServerApp.port={port}",
            "--ServerApp.port_retries=0",
            f"--IdentityProvider.token={token}",
            "--ServerApp.allow_root=True",
            f"--ServerApp.root_dir={root}",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
            "--LabApp.extension_manager=readonly",
        ]
        log = tmp / "lab.log"
        with open(log, "wb") as logf:
            proc = subprocess.Popen(
                cmd,
                cwd=root,
                env=env,
                stdout=logf,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        lab = Lab(url=url, token=token, root_dir=root, proc=proc, log=log)
        try:
            deadline = time.monotonic() + startup_timeout
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"jupyter lab exited with {proc.returncode}:\n{lab.log_tail()}")
                with contextlib.suppress(OSError):
                    if _request(url, token, "/api/status") == 200:
                        break
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"jupyter lab did not answer on {url} within "
                        f"{startup_timeout:.0f}s:\n{lab.log_tail()}"
                    )
                time.sleep(0.25)
            yield lab
        finally:
            if proc.poll() is None:
                with contextlib.suppress(OSError):
                    _request(url, token, "/api/shutdown", method="POST", timeout=5)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(15)
            _kill_group(proc)  # no-op when the clean shutdown worked; also reaps stray kernels


# -------------------------------------------------------------------------------------- browser


@contextlib.contextmanager
def chromium(*, viewport: tuple[int, int] = (1400, 1000)):
    """Yield a Playwright browser context on headless Debian chromium; close it on exit."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(viewport={"width": viewport[0], "height": viewport[1]})
            yield context
        finally:
            browser.close()


def write_notebook(path: str | os.PathLike, cells: list[str]) -> Path:
    """A notebook of these code cells (Python 3 kernel) at ``path``, for a test to open in the lab."""
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(src) for src in cells]
    nbformat.write(nb, path)
    return Path(path)


def open_notebook(context, lab: Lab, path: str, *, kernel_timeout: float = 90.0):
    """Open ``path`` (relative to the lab's root) in a new page; return it once the kernel is idle.

    Waits on the status bar text "Python 3 (ipykernel) | Idle": the notebook toolbar says idle
    before any kernel exists, and Run All then silently does nothing.
    """
    page = context.new_page()
    page.goto(f"{lab.url}/lab/tree/{path}?token={lab.token}&reset")
    try:
        page.locator("#jp-main-statusbar", has_text=KERNEL_IDLE).wait_for(timeout=kernel_timeout * 1000)
    except Exception as e:
        raise TimeoutError(
            f"kernel not idle after {kernel_timeout:.0f}s opening {path}; status bar: "
            f"{_statusbar(page)!r}\nserver log:\n{lab.log_tail()}"
        ) from e
    return page


def _statusbar(page) -> str:
    with contextlib.suppress(Exception):
        return page.locator("#jp-main-statusbar").inner_text(timeout=1000)
    return ""


# Code cells with a source and their prompts; empty code cells keep "[ ]" after Run All.
_PROMPTS_JS = """() => Array.from(document.querySelectorAll('.jp-Notebook .jp-CodeCell'))
  .filter(c => (c.querySelector('.cm-content')?.textContent ?? '').trim() !== '')
  .map(c => (c.querySelector('.jp-InputPrompt')?.textContent ?? '').trim())"""

# Text of every error / stderr output, to say why a run stopped.
_ERRORS_JS = """() => Array.from(document.querySelectorAll(
    '.jp-Notebook .jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]'))
  .map(e => e.textContent)"""


def run_all(page, *, timeout: float = 300.0) -> float:
    """Run every cell (menu Run → Run All Cells); wait until each has a number and the kernel is idle.

    Returns the seconds it took. Raises with the notebook's stderr/error text if the run stops
    early (a cell raised) or does not finish within ``timeout``.
    """
    t0 = time.monotonic()
    page.locator(".lm-MenuBar-item", has_text=re.compile(r"^\s*Run\s*$")).click()
    page.locator(".lm-Menu-item[data-command='runmenu:run-all']").click()
    started = stopped_since = None
    while True:
        prompts = page.evaluate(_PROMPTS_JS)
        idle = KERNEL_IDLE in _statusbar(page)
        numbered = [bool(re.fullmatch(r"\[\d+\]:?", p)) for p in prompts]
        running = any(p.startswith("[*]") for p in prompts)
        if started is None and (running or any(numbered) or not prompts):
            started = time.monotonic()
        if started is not None:
            if all(numbered) and idle and not running:
                return time.monotonic() - t0
            # Run All stops at a failing cell; the rest stay "[ ]" while the kernel sits idle.
            if idle and not running:
                stopped_since = stopped_since or time.monotonic()
                if time.monotonic() - stopped_since > 3:
                    raise RuntimeError(
                        f"Run All stopped early; prompts {prompts}\n"
                        + "\n".join(page.evaluate(_ERRORS_JS))[-4000:]
                    )
            else:
                stopped_since = None
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(
                f"Run All not done after {timeout:.0f}s; prompts {prompts}, status bar "
                f"{_statusbar(page)!r}\n" + "\n".join(page.evaluate(_ERRORS_JS))[-4000:]
            )
        time.sleep(0.25)


# -------------------------------------------------------------------------------------- widgets


def cell_output(page, contains: str) -> str:
    """The text shown under the (first) code cell whose source contains ``contains``."""
    return page.evaluate(
        """needle => {
            for (const cell of document.querySelectorAll('.jp-Notebook .jp-CodeCell')) {
                const src = cell.querySelector('.jp-InputArea-editor');
                if (src && src.innerText.includes(needle)) {
                    const out = cell.querySelector('.jp-OutputArea');
                    return out ? out.innerText : '';
                }
            }
            return null;
        }""", contains)


def widget(page, css_class: str):
    """The (first) widget element carrying ``css_class`` (set in Python with ``w.add_class(...)``)."""
    return page.locator(f".jp-Notebook .{css_class}").first


def press_slider(page, css_class: str, key: str = "ArrowRight", times: int = 1) -> None:
    """Focus the ``.noUi-handle`` of the slider with ``css_class`` and press ``key`` ``times`` times."""
    handle = widget(page, css_class).locator(".noUi-handle").first
    handle.scroll_into_view_if_needed()
    handle.focus()
    for _ in range(times):
        handle.press(key)


def fill_text(page, css_class: str, value: str) -> None:
    """Type ``value`` into the first text box of the widget with ``css_class`` and press Enter
    (nnvllm's text boxes update on Enter: ``continuous_update=False``)."""
    box = widget(page, css_class).locator("input[type=text]").first
    box.scroll_into_view_if_needed()
    box.fill(value)
    box.press("Enter")


def click_button(page, css_class: str, text: str) -> None:
    """Click the button labelled ``text`` inside the widget with ``css_class``."""
    button = widget(page, css_class).locator("button", has_text=text).first
    button.scroll_into_view_if_needed()
    button.click()


def slider_readout(page, css_class: str) -> str:
    """The text of the slider's ``.widget-readout`` (its displayed value)."""
    return widget(page, css_class).locator(".widget-readout").first.inner_text().strip()


def img_src(page, css_class: str, *, timeout: float = 30.0) -> str:
    """The ``src`` of the first ``img`` inside the widget with ``css_class`` (an Output's plot)."""
    img = widget(page, css_class).locator("img").first
    img.wait_for(state="attached", timeout=timeout * 1000)
    return img.get_attribute("src") or ""


def wait_img_src_change(page, css_class: str, old: str, *, timeout: float = 60.0) -> str:
    """Wait until the widget's ``img`` has a ``src`` other than ``old``; return the new one."""
    page.wait_for_function(
        """([sel, old]) => { const i = document.querySelector(sel + ' img');
                             return i && i.getAttribute('src') && i.getAttribute('src') !== old; }""",
        arg=[f".jp-Notebook .{css_class}", old],
        timeout=timeout * 1000,
        polling=200,
    )
    return img_src(page, css_class)


def screenshot(page, path: str | os.PathLike, *, css_class: str | None = None) -> Path:
    """Save a PNG of the page (scrolled to the widget with ``css_class`` if given); return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if css_class is not None:
        widget(page, css_class).scroll_into_view_if_needed()
    page.screenshot(path=str(path))
    return path
