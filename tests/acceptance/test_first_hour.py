"""A new user's first hour (issue 26): each trap found by following the README, as a test.

Every error reaches the terminal as one ``error <code>: <message>`` line that says where (Redis
host, port and database; the SQLite file), never a traceback or a password.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import time
import uuid
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from sqlalchemy import Engine, create_engine, text

from outbox_relay.shared import db
from tests.conftest import PG_ADMIN_URL, REDIS_URL, pg_schema_url
from tests.helpers import OUTBOX, PARTITIONS, enqueue_events, free_port, outbox
from tests.not_redis import not_redis_server

pytestmark = pytest.mark.acceptance

ROOT = Path(__file__).resolve().parents[2]
DEMO_APP = "outbox_relay.cli.demo_app:handlers"


def one_line_error(result: subprocess.CompletedProcess[str], code: str, status: int) -> str:
    """The one error line of a failed command (after any log lines), checked."""
    assert result.returncode == status, result.stderr
    assert "Traceback" not in result.stderr + result.stdout, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error {code}: "), result.stderr
    assert [line for line in result.stderr.splitlines() if line.startswith("error ")] == [last]
    return last


@pytest.fixture
def not_redis() -> Iterator[int]:
    """A host that answers but is not Redis (its port)."""
    with not_redis_server() as port:
        yield port


def migrated_sqlite(tmp_path: Path, events: int = 3) -> str:
    url = f"sqlite:///{tmp_path}/outbox.db"
    engine = db.make_engine(url)
    db.upgrade(engine)
    enqueue_events(engine, events)  # something to deliver: the relay must talk to Redis
    engine.dispose()
    return url


# -- 1 and 3: Redis errors are one line and say where --------------------------------------


def test_a_redis_database_number_that_does_not_exist_is_one_line_naming_it(
    tmp_path: Path,
) -> None:
    server = urlsplit(REDIS_URL).netloc.rpartition("@")[2]
    redis99 = f"redis://{server}/99"  # a server has 16 databases unless configured otherwise
    listed = one_line_error(outbox("dlq", "list", "--redis-url", redis99), "unavailable", 2)
    assert f"Redis at {server}/99: no such database number" in listed
    relayed = outbox("relay", "--until-idle", "--database-url", migrated_sqlite(tmp_path),
                     "--redis-url", redis99, "--partitions", str(PARTITIONS),
                     "--startup-timeout-s", "2")
    assert f"{server}/99" in one_line_error(relayed, "unavailable", 2)


def test_a_host_that_answers_but_is_not_redis_is_one_line(
    tmp_path: Path, not_redis: int
) -> None:
    url = f"redis://:hunter2@127.0.0.1:{not_redis}/0"
    listed = one_line_error(outbox("dlq", "list", "--redis-url", url), "unavailable", 2)
    assert f"the server at 127.0.0.1:{not_redis}/0 answered, but not in the Redis protocol" \
        in listed
    relayed = outbox("relay", "--until-idle", "--database-url", migrated_sqlite(tmp_path),
                     "--redis-url", url, "--partitions", str(PARTITIONS),
                     "--startup-timeout-s", "2")
    assert "not in the Redis protocol" in one_line_error(relayed, "unavailable", 2)
    assert "hunter2" not in relayed.stderr


def test_an_unreachable_redis_says_host_port_and_db_but_never_the_password() -> None:
    port = free_port()  # a port nobody listens on
    result = outbox("dlq", "list", "--redis-url", f"redis://u:hunter2@127.0.0.1:{port}/3")
    line = one_line_error(result, "unavailable", 1)
    assert line == f"error unavailable: Redis at 127.0.0.1:{port}/3 is unavailable or timed out"
    assert "hunter2" not in result.stderr + result.stdout


# -- 1: two upgrades at once on PostgreSQL serialize ---------------------------------------


@pytest.fixture
def pg_schema() -> Iterator[str]:
    schema = f"t_{uuid.uuid4().hex[:12]}"
    admin = create_engine(PG_ADMIN_URL)
    with admin.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    try:
        yield schema
    finally:
        with admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


def waiting_on_locks(engine: Engine, app: str) -> int:
    """Sessions named ``app`` waiting for a lock (asked on a connection of its own: within a
    transaction, ``pg_stat_activity`` is a snapshot taken at its first read)."""
    with engine.connect() as conn:
        return int(conn.execute(text(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = :app "
            "AND wait_event_type = 'Lock'"), {"app": app}).scalar_one())


def test_two_upgrades_at_once_on_postgresql_serialize_and_both_succeed(pg_schema: str) -> None:
    """Both upgrades are held at one point (the version table, locked by the test) and let go
    together: without a migration lock both then create the same tables, and one fails with
    a traceback that prints the ``CREATE TABLE``."""
    url = pg_schema_url(pg_schema)
    gate = create_engine(url)
    base = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    app = f"upgrade-{pg_schema}"  # names the upgrades' sessions in pg_stat_activity
    env = {**base, "OUTBOX_DATABASE_URL": f"{url}&application_name={app}"}
    with gate.connect() as conn:
        conn.execute(text("CREATE TABLE outbox_schema_version "
                          "(version_num VARCHAR(32) NOT NULL PRIMARY KEY)"))
        conn.commit()
        conn.execute(text("LOCK TABLE outbox_schema_version IN ACCESS EXCLUSIVE MODE"))
        procs = [subprocess.Popen([str(OUTBOX), "db", "upgrade", "--runs"], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for _ in range(2)]
        try:
            deadline = time.monotonic() + 60
            while waiting_on_locks(gate, app) < 2:
                assert time.monotonic() < deadline, "the upgrades never reached the gate"
                assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
                time.sleep(0.05)
        finally:
            conn.rollback()  # open the gate: both go on at once
        outputs = [p.communicate(timeout=120) for p in procs]
    gate.dispose()
    for proc, (out, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, err
        assert "CREATE TABLE" not in out + err and "Traceback" not in err, err
        assert "is at schema" in out and "has the runs tables" in out
    check = outbox("db", "check", "--runs", env={"OUTBOX_DATABASE_URL": url})
    assert check.returncode == 0, check.stderr


# -- 2: the commands the demo prints run as printed ----------------------------------------


def test_the_demo_prints_commands_that_run_without_activating_the_virtualenv(
    tmp_path: Path,
) -> None:
    """``make demo`` runs ``.venv/bin/outbox demo``: the venv is not on PATH, so a printed
    ``outbox status`` was "command not found"."""
    venv_bin = str(OUTBOX.parent)
    path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep)
                           if p and p != venv_bin)
    base = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env = {**base, "PATH": path or "/usr/bin:/bin", "OUTBOX_REDIS_URL": REDIS_URL,
           "OUTBOX_DATABASE_URL": "sqlite:///./demo.db"}
    demo = subprocess.run([str(OUTBOX), "demo", "--runs", "10", "--timeout", "120"], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=180, check=False)
    printed = [line.strip() for line in demo.stdout.splitlines()
               if line.strip().endswith((" status", " dlq list", " prune --dry-run"))
               and "OUTBOX_KEY_PREFIX=" in line]
    prefix = printed[0].split("OUTBOX_KEY_PREFIX=")[1].split()[0] if printed else None
    try:
        assert demo.returncode == 0, demo.stderr
        assert len(printed) == 3, demo.stdout
        for command in printed:
            ran = subprocess.run(command, shell=True, cwd=tmp_path,
                                 env={k: v for k, v in env.items()
                                      if not k.startswith("OUTBOX_")},
                                 capture_output=True, text=True, timeout=60, check=False)
            assert ran.returncode == 0, f"{command}\n{ran.stderr}"
            assert "command not found" not in ran.stderr
        assert "source " in demo.stdout and "activate" in demo.stdout  # how to get `outbox`
    finally:
        if prefix:
            import redis

            client = redis.Redis.from_url(REDIS_URL)
            for key in client.scan_iter(match=f"{prefix}:*", count=1000):
                client.delete(key)
            client.close()


# -- 5: make install says what it is doing -------------------------------------------------


def test_make_install_says_what_it_does_and_shows_pips_lines(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    # Run inside `make test` too: a nested make would print "Entering directory" first.
    plain = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    lines = subprocess.run(["make", "--no-print-directory", "-n", "-B", "install",
                            f"VENV={venv}"], cwd=ROOT, capture_output=True, text=True,
                           check=True, env={**plain, "CI": ""}).stdout.splitlines()
    install = next(i for i, line in enumerate(lines) if "pip install" in line and " -e " in line)
    assert lines[install - 1].startswith("echo ") and "installing" in lines[install - 1]
    assert not {"-q", "--quiet"} & set(shlex.split(lines[install])), lines[install]
    assert lines[0].startswith("echo "), "say what happens before the first (venv) step"
    ci = subprocess.run(["make", "--no-print-directory", "-n", "-B", "install", f"VENV={venv}",
                         "CI=true"], cwd=ROOT, capture_output=True, text=True, check=True,
                        env=plain).stdout
    assert "--progress-bar off" in ci  # one line per package in CI logs, no bars


# -- 6: the database a daemon is given -----------------------------------------------------


@pytest.mark.parametrize("command", [("relay", "--until-idle"), ("consume", "--app", DEMO_APP)],
                         ids=["relay", "consume"])
def test_a_daemon_refuses_a_sqlite_file_that_does_not_exist_and_creates_none(
    tmp_path: Path, command: tuple[str, ...]
) -> None:
    result = outbox(*command, env={"OUTBOX_DATABASE_URL": "sqlite:///./outbox.db",
                                   "OUTBOX_REDIS_URL": REDIS_URL}, cwd=tmp_path, timeout=60)
    line = one_line_error(result, "schema_not_ready", 1)
    assert line.startswith("error schema_not_ready: there is no database file ./outbox.db; run "
                           "`outbox db upgrade`"), line
    assert list(tmp_path.iterdir()) == []


def test_a_read_only_sqlite_database_is_reported_as_read_only(tmp_path: Path) -> None:
    url = migrated_sqlite(tmp_path)
    path = url.removeprefix("sqlite:///")
    # Read-only as SQLite sees it (the tests may run as root, whom file modes do not stop).
    result = outbox("relay", "--until-idle", "--database-url",
                    f"sqlite:///file:{path}?mode=ro&uri=true", "--redis-url", REDIS_URL,
                    "--partitions", str(PARTITIONS), "--startup-timeout-s", "2")
    line = one_line_error(result, "read_only", 2)
    assert f"the SQLite database file:{path} is read-only" in line
    assert "unavailable or timed out" not in result.stderr


def test_a_mysql_url_is_not_supported(tmp_path: Path) -> None:
    for command in (("db", "upgrade"), ("relay", "--until-idle"), ("status",)):
        result = outbox(*command, "--database-url", "mysql://u:hunter2@127.0.0.1/x")
        line = one_line_error(result, "invalid_config", 2)
        assert "mysql databases are not supported" in line
        assert "supported: sqlite, postgresql" in line
        assert "driver" not in line and "hunter2" not in line


# -- 8: --version; the image runs `outbox serve` and checks its health ---------------------


def test_version() -> None:
    result = outbox("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"outbox {metadata.version('outbox-relay')}"


def dockerfile_healthcheck() -> list[str]:
    text_ = (ROOT / "Dockerfile").read_text()
    match = re.search(r"^HEALTHCHECK .*?CMD (\[.*\])$", text_.replace("\\\n", " "), re.M)
    assert match, "the Dockerfile has no HEALTHCHECK ... CMD [...]"
    command: list[str] = json.loads(match.group(1))
    return command


def test_the_image_installs_the_http_extra_and_listens_beyond_loopback() -> None:
    text_ = (ROOT / "Dockerfile").read_text()
    install = next(line for line in text_.splitlines() if "pip install" in line)
    extras = re.search(r"'\.\[([a-z,-]+)\]'", install)
    assert extras and {"postgres", "http"} <= set(extras.group(1).split(",")), install
    env = {name: value for line in text_.splitlines() if line.startswith("ENV ")
           for name, value in re.findall(r"(OUTBOX_[A-Z_]+)=(\S+)", line)}
    assert env["OUTBOX_METRICS_HOST"] == "0.0.0.0" and env["OUTBOX_METRICS_PORT"] == "9100"
    assert re.search(r"^USER \d+$", text_, re.M), "a numeric USER: runAsNonRoot can check it"


def test_the_images_healthcheck_asks_the_daemons_healthz() -> None:
    """The HEALTHCHECK command, run here against a real metrics server (the daemons'), passes;
    against a port where nothing listens, it fails."""
    from prometheus_client import CollectorRegistry

    from outbox_relay.shared.metrics_server import MetricsServer

    command = dockerfile_healthcheck()
    assert command[0] == "python"
    server = MetricsServer("127.0.0.1", 0, CollectorRegistry())
    try:
        env = {**os.environ, "OUTBOX_METRICS_PORT": str(server.port)}
        ok = subprocess.run([str(OUTBOX.with_name("python")), *command[1:]], env=env,
                            capture_output=True, text=True, timeout=30, check=False)
        assert ok.returncode == 0, ok.stderr
    finally:
        server.stop()
    env = {**os.environ, "OUTBOX_METRICS_PORT": str(server.port)}  # closed now
    down = subprocess.run([str(OUTBOX.with_name("python")), *command[1:]], env=env,
                          capture_output=True, text=True, timeout=30, check=False)
    assert down.returncode != 0
