"""The README's orders example, run as a newcomer runs it: from the repository root, with
nothing but the ``outbox`` command and ``python -m examples.orders``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from sqlalchemy import text

from outbox_relay.shared import db
from tests.conftest import REDIS_URL
from tests.helpers import OUTBOX

pytestmark = pytest.mark.acceptance

REPO = Path(__file__).resolve().parents[2]


def _env(database_url: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items()
            if not k.startswith("OUTBOX_") and k != "PYTHONPATH"}
    return base | {"OUTBOX_DATABASE_URL": database_url, "OUTBOX_REDIS_URL": REDIS_URL,
                   "OUTBOX_KEY_PREFIX": f"t-orders-{uuid.uuid4().hex[:8]}"}


def _place(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "examples.orders", "place", *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=60, check=False)


def test_place_twice_relay_consume_and_status_from_the_repository(database_url: str) -> None:
    env = _env(database_url)  # the README's path, on SQLite and on PostgreSQL
    first = _place(env, "o-1", "42")
    assert first.returncode == 0, first.stderr
    assert "event o-1:order.placed:1 is in the outbox" in first.stdout
    again = _place(env, "o-1", "42")  # a retry of the same command is safe
    assert again.returncode == 0 and "placed before (total 42): nothing written" in again.stdout
    other = _place(env, "o-1", "43")
    assert other.returncode == 1
    assert other.stderr.startswith("error conflict: o-1 was placed before with total 42")
    bad = _place(env, "o-2", "abc")
    assert bad.returncode == 2 and bad.stderr.startswith("usage:")
    assert "Traceback" not in first.stderr + again.stderr + other.stderr + bad.stderr

    relay = subprocess.run([str(OUTBOX), "relay", "--until-idle"], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=60, check=False)
    assert relay.returncode == 0, relay.stderr

    engine = db.make_engine(database_url)
    # `examples` is not installed: --app finds it because the current directory is on the path.
    consumer = subprocess.Popen(
        [str(OUTBOX), "consume", "--streams", "orders", "--group", "billing",
         "--app", "examples.orders:handlers", "--block-ms", "100"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        invoices: list[tuple[str, int]] = []
        deadline = time.monotonic() + 60
        while not invoices and consumer.poll() is None and time.monotonic() < deadline:
            with engine.connect() as conn:
                invoices = [tuple(r) for r in conn.execute(
                    text("SELECT order_id, total FROM invoices"))]
            time.sleep(0.1)  # polling interval of the check, not a stand-in for it
    finally:
        consumer.send_signal(signal.SIGTERM)
        _out, err = consumer.communicate(timeout=30)
        engine.dispose()
    assert invoices == [("o-1", 42)], err
    assert consumer.returncode == 0, err

    status = subprocess.run([str(OUTBOX), "status"], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=60, check=False)
    assert status.returncode == 0, status.stderr
    assert "0 undelivered" in status.stdout and "billing (0/0)" in status.stdout
    letters = subprocess.run([str(OUTBOX), "dlq", "list"], cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=60, check=False)
    assert letters.returncode == 0 and "(no dead letters)" in letters.stdout
