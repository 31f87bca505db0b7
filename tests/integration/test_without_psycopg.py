"""A SQLite-only install (``pip install outbox-relay``, no ``[postgres]`` extra) has no
psycopg: every module must still import, and ``outbox`` must run the whole pipeline on SQLite.

The processes here run with psycopg made unimportable (a ``sitecustomize`` on their path that
refuses the import, as a missing package would), through the CLI a user runs: ``db upgrade``,
the README's orders example placing two orders, ``relay --until-idle`` and ``consume
--until-idle``; the invoices it writes are checked.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.conftest import REDIS_URL
from tests.helpers import OUTBOX

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]

BLOCKER = '''
import sys

class _NoPsycopg:
    """psycopg as if it were not installed."""

    def find_spec(self, name, path=None, target=None):
        if name == "psycopg" or name.startswith("psycopg."):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return None

sys.meta_path.insert(0, _NoPsycopg())
'''

IMPORT_ALL = '''
import importlib, pkgutil, outbox_relay
for info in pkgutil.walk_packages(outbox_relay.__path__, "outbox_relay."):
    if info.name.endswith("__main__") or ".migrations" in info.name:
        continue  # a command's entry point; Alembic's env scripts run under Alembic only
    importlib.import_module(info.name)
try:
    import psycopg
except ImportError:
    print("imported without psycopg")
'''


@pytest.fixture
def no_psycopg_env(tmp_path: Path) -> dict[str, str]:
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(BLOCKER)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env |= {"PYTHONPATH": os.pathsep.join([str(blocker), str(REPO)]),
            "OUTBOX_DATABASE_URL": f"sqlite:///{tmp_path}/outbox.db",
            "OUTBOX_REDIS_URL": REDIS_URL,
            "OUTBOX_KEY_PREFIX": f"t-nopg-{uuid.uuid4().hex[:8]}"}
    return env


def run(env: dict[str, str], *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120, check=False)


def test_every_module_imports_without_psycopg(no_psycopg_env: dict[str, str]) -> None:
    done = run(no_psycopg_env, sys.executable, "-c", IMPORT_ALL)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "imported without psycopg"


def test_the_cli_runs_the_pipeline_on_sqlite_without_psycopg(
    no_psycopg_env: dict[str, str], tmp_path: Path
) -> None:
    env = no_psycopg_env
    assert run(env, str(OUTBOX), "db", "upgrade").returncode == 0
    for order, total in (("o-1", "42"), ("o-2", "7")):
        placed = run(env, sys.executable, "-m", "examples.orders", "place", order, total)
        assert placed.returncode == 0, placed.stderr[-3000:]
    relayed = run(env, str(OUTBOX), "relay", "--until-idle")
    assert relayed.returncode == 0, relayed.stderr[-3000:]
    consumed = run(env, str(OUTBOX), "consume", "--streams", "orders", "--group", "billing",
                   "--app", "examples.orders:handlers", "--until-idle")
    assert consumed.returncode == 0, consumed.stderr[-3000:]
    for done in (relayed, consumed):
        assert "Traceback" not in done.stderr and "psycopg" not in done.stderr
    with sqlite3.connect(tmp_path / "outbox.db") as db:
        invoices = sorted(db.execute("SELECT order_id, total FROM invoices").fetchall())
    assert invoices == [("o-1", 42), ("o-2", 7)]
