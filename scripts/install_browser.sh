#!/usr/bin/env bash
# Install what the real-browser notebook test (tests/test_browser.py) needs:
# Debian chromium at /usr/bin/chromium and the playwright pip package in the venv.
# Never `playwright install`: it downloads its own browser, which fails offline and is not needed.
# Idempotent; exits 0 with a message where it cannot install (the test then skips).
set -u
VENV="${VENV:-.venv}"

if [ -x /usr/bin/chromium ]; then
    echo "install_browser: /usr/bin/chromium present"
elif ! command -v apt-get >/dev/null 2>&1; then
    echo "install_browser: no apt-get here; install chromium at /usr/bin/chromium yourself (browser test will skip)"
else
    SUDO=""
    if [ "$(id -u)" != 0 ]; then
        if command -v sudo >/dev/null 2>&1; then SUDO="sudo"; else
            echo "install_browser: not root and no sudo; cannot apt-get install chromium (browser test will skip)"
        fi
    fi
    if [ "$(id -u)" = 0 ] || [ -n "$SUDO" ]; then
        export DEBIAN_FRONTEND=noninteractive
        $SUDO apt-get update -q && $SUDO apt-get install -y -q --no-install-recommends chromium \
            || echo "install_browser: apt-get install chromium failed (browser test will skip)"
    fi
fi

if [ ! -x "$VENV/bin/python" ]; then
    echo "install_browser: no venv at $VENV; run 'make setup' first"
elif "$VENV/bin/python" -c "import playwright" >/dev/null 2>&1; then
    echo "install_browser: playwright present in $VENV"
else
    "$VENV/bin/pip" install -q playwright \
        || echo "install_browser: pip install playwright failed (browser test will skip)"
fi
exit 0
