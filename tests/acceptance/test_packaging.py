"""The wheel a user installs: one top-level package, ``outbox_relay``, whose facade imports with
only the hard dependencies, and the PostgreSQL extra is all a PostgreSQL producer needs.

Builds the wheel from this checkout and installs it into a fresh virtualenv from the package
index (as a user would; dependencies are resolved by pip), so it needs the index.
"""

from __future__ import annotations

import subprocess
import sys
import venv
from pathlib import Path

import pytest

from tests.conftest import PG_ADMIN_URL, pg_schema_url

pytestmark = pytest.mark.acceptance

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str, cwd: Path | None = None, timeout: float = 600) -> str:
    result = subprocess.run(list(args), cwd=cwd, capture_output=True, text=True,
                            timeout=timeout, check=False)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return result.stdout


def test_the_wheel_installs_one_package_and_the_facade_imports(tmp_path: Path) -> None:
    _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path / "dist"),
         str(ROOT))
    [wheel] = (tmp_path / "dist").glob("outbox_relay-*.whl")
    env = tmp_path / "venv"
    venv.create(env, with_pip=True)
    python = str(env / "bin" / "python")
    _run(python, "-m", "pip", "install", "-q", f"{wheel}[postgres]")
    site = Path(_run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])")
                .strip())
    ours = {p.name for p in site.iterdir()} & {"shared", "cli", "producer", "relay", "consumer",
                                                "runs", "outbox_relay"}
    assert ours == {"outbox_relay"}  # nothing generic at the top of site-packages
    installed = _run(python, "-m", "pip", "list", "--format=freeze").lower()
    for extra_only in ("fastapi", "uvicorn", "aiosqlite", "opentelemetry-api"):
        assert f"{extra_only}==" not in installed  # extras stay extras

    # The facade, and a PostgreSQL producer with nothing but the [postgres] extra.
    schema = f"pkg_{tmp_path.name[-8:].lower().replace('-', '_')}"
    script = f"""
from sqlalchemy import text
from outbox_relay import Producer, Handlers, Event, OutboxError, make_engine, upgrade
import outbox_relay
assert {{"Producer", "Handlers", "Event", "OutboxError"}} <= set(outbox_relay.__all__)
admin = make_engine({PG_ADMIN_URL!r})
with admin.begin() as conn:
    conn.execute(text('CREATE SCHEMA "{schema}"'))
try:
    engine = make_engine({pg_schema_url(schema)!r})
    upgrade(engine)
    with engine.begin() as conn:
        print(Producer(source="pkg", partitions=4).enqueue(
            conn, type="thing.done", stream="things", aggregate_type="thing",
            aggregate_id="t-1", revision=1))
finally:
    with admin.begin() as conn:
        conn.execute(text('DROP SCHEMA "{schema}" CASCADE'))
"""
    assert _run(python, "-c", script, cwd=tmp_path).strip() == "t-1:thing.done:1"
    # The runs component's own migrations are in the wheel too (opt-in, on SQLite here).
    runs = f"""
from outbox_relay import make_engine
from outbox_relay.runs import Pipeline, Runs, upgrade
print(upgrade(make_engine("sqlite:///{tmp_path}/runs.db")))
"""
    assert _run(python, "-c", runs, cwd=tmp_path).strip() == "r0001"
    assert "usage: outbox" in _run(str(env / "bin" / "outbox"), "--help")
