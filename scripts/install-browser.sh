#!/bin/sh
# Installs Debian's chromium and chromium-driver where they are missing, for the operator
# console's browser test (tests/integration/test_console_browser.py); `make test` runs it first.
# It never fails the build: without apt-get, root (or password-less sudo) or a reachable package
# mirror it says why and exits 0, and the browser test then skips with that reason.
set -u
if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "==> no apt-get here: chromium is not installed, the console's browser test will skip"
    exit 0
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        SUDO="sudo -n"
    else
        echo "==> not root and no password-less sudo: chromium is not installed, the console's" \
             "browser test will skip (install chromium and chromium-driver to run it)"
        exit 0
    fi
fi
echo "==> installing chromium and chromium-driver (apt-get) for the console's browser test"
install() {
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
        chromium chromium-driver >/dev/null
}
if ! install; then
    echo "==> retrying after apt-get update"
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -q >/dev/null && install || \
        echo "==> could not install chromium: the console's browser test will skip"
fi
exit 0
