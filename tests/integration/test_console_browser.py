"""The operator console in a real headless browser (issue 26): ``outbox serve --console`` runs as
a user starts it, Chromium loads ``/console/``, shows a dead letter the real consumer wrote,
and after the operator gives a token and clicks Replay, the letter's event is applied (the
handler's row is in the database), the letter is gone and the action log names the caller.

Chromium and its driver are Debian's (``scripts/install-browser.sh``, run by ``make test``);
Selenium is pointed at ``/usr/bin/chromedriver`` and never downloads anything. The test skips,
saying why, only where they are not installed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
from sqlalchemy import Engine

from outbox_relay.consumer import dead_letters
from outbox_relay.runs import schema as runs_schema
from tests import console_kit
from tests.conftest import REDIS_URL
from tests.helpers import GROUP, PARTITIONS, ROOT, effect_counts, free_port, wait_until

pytestmark = pytest.mark.integration

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
TOKEN = "ops-0123456789abcdef0123"


def _browser_or_skip() -> None:
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not os.access(p, os.X_OK)]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed (scripts/install-browser.sh installs "
                    "Debian's chromium and chromium-driver; it could not here)")


@pytest.fixture
def serve(engine: Engine, database_url: str, key_prefix: str,
          tmp_path: Path) -> Iterator[str]:
    """``outbox serve --console`` on a free port, with one token and g1's replay handlers."""
    _browser_or_skip()
    runs_schema.MIGRATIONS.upgrade(engine)  # outbox serve checks the runs tables too
    port = free_port()
    env = {**os.environ, "OUTBOX_DATABASE_URL": database_url, "OUTBOX_REDIS_URL": REDIS_URL,
           "OUTBOX_KEY_PREFIX": key_prefix, "OUTBOX_PARTITIONS": str(PARTITIONS),
           "OUTBOX_API_TOKENS": f"ops:{TOKEN}",
           "OUTBOX_CONSOLE_APPS": f"{GROUP}=tests.console_kit:handlers"}
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "outbox_relay", "serve", "--console",
                                 "--port", str(port)], cwd=ROOT, env=env, stdout=out,
                                stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        def up() -> bool:
            assert proc.poll() is None, log.read_text()
            try:
                return httpx.get(f"{url}/healthz", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(up, timeout=30, what="outbox serve to listen")
        yield url
    finally:
        proc.terminate()
        assert proc.wait(timeout=15) == 0, log.read_text()
    text = log.read_text()
    assert "Traceback" not in text and "operator console on" in text, text


@pytest.fixture
def browser(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    """Headless Chromium through Debian's chromedriver; Selenium Manager may not run."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.selenium_manager import SeleniumManager

    def no_downloads(*_args: object) -> dict[str, str]:
        raise AssertionError("Selenium Manager must not run (it would fetch a driver)")

    monkeypatch.setattr(SeleniumManager, "binary_paths", no_downloads)
    monkeypatch.setenv("SE_OFFLINE", "true")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--no-first-run", "--disable-background-networking", "--disable-sync",
                "--disable-component-update", f"--user-data-dir={tmp_path / 'chromium'}"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)),
                              options=options)
    try:
        yield driver
    finally:
        driver.quit()


def test_see_a_dead_letter_replay_it_and_see_it_applied(
        engine: Engine, redis_client: redis.Redis, key_prefix: str, serve: str,
        browser: object) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.remote.webdriver import WebDriver
    from selenium.webdriver.support.ui import WebDriverWait

    assert isinstance(browser, WebDriver)
    (event_id,) = console_kit.make_letters(engine, redis_client, key_prefix, aggregates=("w1",))
    (letter,) = [x for x in dead_letters.list_letters(redis_client, key_prefix)
                 if x.fields.get(b"id") == event_id.encode()]
    wait = WebDriverWait(browser, 20)

    browser.get(f"{serve}/console/")
    # Tokens are configured: nothing is shown before the operator gives one.
    wait.until(lambda d: "unauthorized" in d.find_element(By.ID, "message").text)
    browser.find_element(By.ID, "token").send_keys(TOKEN)
    browser.find_element(By.ID, "save-token").click()
    row = f'tr[data-letter="{letter.letter_id}"]'
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, row))
    shown = browser.find_element(By.CSS_SELECTOR, row).text
    assert "unknown_type" in shown and console_kit.LATE in shown and GROUP in shown
    assert "signed in as ops" in browser.find_element(By.ID, "who").text
    assert effect_counts(engine)[event_id] == 0

    browser.find_element(By.CSS_SELECTOR, f'button[data-replay="{letter.letter_id}"]').click()
    wait.until(lambda d: "applied" in d.find_element(By.ID, "message").text)
    assert effect_counts(engine)[event_id] == 1  # the handler ran, once, in the database
    wait.until(lambda d: not d.find_elements(By.CSS_SELECTOR, row))
    assert dead_letters.list_letters(redis_client, key_prefix, count=10)[0].reason == (
        "missing_field")  # only the letter that cannot be replayed is left
    wait.until(lambda d: "ops" in d.find_element(By.CSS_SELECTOR, "#actions tbody").text)
    log = browser.find_element(By.CSS_SELECTOR, "#actions tbody").text
    assert "replay" in log and letter.letter_id in log
    # The backlog and the group are on the page too.
    assert GROUP in browser.find_element(By.CSS_SELECTOR, "#groups tbody").text
    assert "undelivered" in browser.find_element(By.ID, "backlog-summary").text
    errors = [e for e in browser.get_log("browser") if e.get("level") == "SEVERE"
              and "401" not in e.get("message", "")]
    assert errors == []
