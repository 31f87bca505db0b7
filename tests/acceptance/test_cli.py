"""The ``outbox`` command as a user runs it: a subprocess, its exit status, its output."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import redis

from outbox_relay.shared.settings import CommonSettings, ConsumerSettings, RelaySettings
from tests.conftest import REDIS_URL
from tests.helpers import OUTBOX, PARTITIONS, enqueue_events, outbox

pytestmark = pytest.mark.acceptance

def flags(model: type[CommonSettings]) -> list[str]:
    return ["--" + name.replace("_", "-") for name in model.model_fields]


@pytest.mark.parametrize(
    ("command", "model"),
    [
        ((), None),
        (("db",), None),
        (("db", "upgrade"), CommonSettings),
        (("db", "check"), CommonSettings),
        (("relay",), RelaySettings),
        (("consume",), ConsumerSettings),
        (("status",), CommonSettings),
        (("demo",), CommonSettings),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, tuple) else "",
)
def test_help_lists_every_settings_flag(
    command: tuple[str, ...], model: type[CommonSettings] | None
) -> None:
    result = outbox(*command, "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: outbox")
    for flag in flags(model) if model else []:
        assert flag in result.stdout, f"{flag} missing from `outbox {' '.join(command)} --help`"


def test_help_names_every_subcommand() -> None:
    top = outbox("--help").stdout
    for name in ("db", "relay", "consume", "status", "demo"):
        assert name in top
    assert "upgrade" in outbox("db", "--help").stdout


def test_db_upgrade_then_check(tmp_path: Path) -> None:
    env = {"OUTBOX_DATABASE_URL": f"sqlite:///{tmp_path}/x.db"}
    before = outbox("db", "check", env=env)
    assert before.returncode == 1
    assert before.stderr.startswith("error schema_not_ready: ")
    upgraded = outbox("db", "upgrade", env=env)
    assert upgraded.returncode == 0, upgraded.stderr
    assert "is at schema" in upgraded.stdout
    checked = outbox("db", "check", env=env)
    assert checked.returncode == 0, checked.stderr
    assert "schema is current" in checked.stdout


def test_flag_overrides_environment(tmp_path: Path) -> None:
    env = {"OUTBOX_DATABASE_URL": f"sqlite:///{tmp_path}/env.db"}
    result = outbox("db", "upgrade", "--database-url", f"sqlite:///{tmp_path}/flag.db", env=env)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "flag.db").exists() and not (tmp_path / "env.db").exists()


def test_relay_until_idle_then_status_json(
    tmp_path: Path, redis_client: redis.Redis, key_prefix: str
) -> None:
    from outbox_relay.shared import db

    url = f"sqlite:///{tmp_path}/x.db"
    env = {"OUTBOX_DATABASE_URL": url, "OUTBOX_REDIS_URL": REDIS_URL,
           "OUTBOX_KEY_PREFIX": key_prefix, "OUTBOX_PARTITIONS": str(PARTITIONS)}
    assert outbox("db", "upgrade", env=env).returncode == 0
    engine = db.make_engine(url)
    try:
        enqueue_events(engine, 12)
    finally:
        engine.dispose()
    relayed = outbox("relay", "--until-idle", env=env)
    assert relayed.returncode == 0, relayed.stderr

    result = outbox("status", "--json", env=env)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["outbox"]["undelivered"] == 0
    assert report["outbox"]["delivered"] == 12
    assert sum(s["length"] for s in report["streams"]) == 12
    assert {s["stream"] for s in report["streams"]} == {"runs"}
    table = outbox("status", env=env)
    assert table.returncode == 0 and "12 delivered" in table.stdout


def test_demo_consumes_every_run(tmp_path: Path) -> None:
    env = {"OUTBOX_DATABASE_URL": f"sqlite:///{tmp_path}/demo.db", "OUTBOX_REDIS_URL": REDIS_URL}
    result = outbox("demo", "--runs", "50", "--json", "--timeout", "120", env=env, cwd=tmp_path,
                    timeout=180)
    summary = json.loads(result.stdout) if result.stdout.strip() else {}
    try:
        assert result.returncode == 0, result.stderr
        assert summary["created"] == 50
        assert summary["dead"] == 0
        # Every run's events were consumed: one per run, or more where runs also advance
        # (then "completed" counts the runs that reached the end).
        assert summary["consumed"] >= 50
        assert summary.get("completed", summary["consumed"]) == 50
    finally:
        prefix = summary.get("key_prefix")
        if prefix:  # the demo leaves its streams for people to inspect; tests clean up
            client = redis.Redis.from_url(REDIS_URL)
            for key in client.scan_iter(match=f"{prefix}:*", count=1000):
                client.delete(key)
            client.close()


@pytest.mark.parametrize(
    "args",
    [("status",), ("db", "check"), ("dlq", "list"), ("prune", "--dry-run"),
     ("groups", "forget", "g"), ("reconcile",)],
    ids=lambda a: " ".join(a),
)
def test_no_command_but_upgrade_creates_a_database_file(
    tmp_path: Path, args: tuple[str, ...]
) -> None:
    result = outbox(*args, env={"OUTBOX_DATABASE_URL": "sqlite:///./outbox.db",
                                "OUTBOX_REDIS_URL": REDIS_URL}, cwd=tmp_path)
    assert list(tmp_path.iterdir()) == []
    if args == ("dlq", "list"):  # reads Redis only: an empty list, and still no file
        assert result.returncode == 0, result.stderr
        return
    assert result.returncode == 1
    assert result.stderr.startswith("error schema_not_ready: there is no database file "
                                    "./outbox.db; run `outbox db upgrade`"), result.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("args", "code", "status", "says"),
    [
        (("db", "check", "--database-url", "not a url"), "invalid_config", 2, ""),
        (("db", "check", "--database-url", "nosuchdb://u:hunter2@h/x"), "invalid_config", 2, ""),
        (("db", "check", "--database-url", "postgresql://u:hunter2@127.0.0.1:1/x",
          "--startup-timeout-s", "0"), "unavailable", 1,
         "cannot connect to PostgreSQL at 127.0.0.1:1/x (password hidden): Connection refused"),
        # Permanent: no retry (a minute of startup-timeout would pass first), exit 2.
        (("db", "check", "--database-url",
          "postgresql://postgres:hunter2@127.0.0.1:5432/no_such_db_here"), "unavailable", 2,
         'cannot connect to PostgreSQL at 127.0.0.1:5432/no_such_db_here (password hidden): '
         'database "no_such_db_here" does not exist'),
        (("relay", "--until-idle", "--database-url",
          "postgresql://nobody_here:hunter2@127.0.0.1:5432/test"), "unavailable", 2,
         'role "nobody_here" does not exist'),
        (("status", "--database-url", "postgresql://postgres@no-such-host.invalid/test"),
         "unavailable", 2, "cannot connect to PostgreSQL at no-such-host.invalid:5432/test: "),
        (("status", "--database-url", "sqlite:///{tmp}/x.db", "--redis-url", "bogus://x"),
         "invalid_config", 2, ""),
        (("status", "--database-url", "sqlite:///{tmp}/x.db", "--redis-url",
          "redis://:hunter2@no-such-host.invalid:6379/0"), "unavailable", 2,
         "cannot connect to Redis at no-such-host.invalid:6379/0: "),
        (("db", "upgrade", "--database-url", "sqlite:///{tmp}/missing/dir/x.db"), "unavailable",
         1, "cannot open the SQLite database"),
        (("relay", "--partitions", "0"), "invalid_config", 2, ""),
        (("relay", "--key-prefix", "a b"), "invalid_config", 2, ""),
        (("relay", "--log-level", "verbose"), "invalid_config", 2, "log_level"),
    ],
    ids=["unparsable-db-url", "unknown-dialect", "unreachable-db", "unknown-database",
         "unknown-role", "unknown-db-host", "bad-redis-url", "unknown-redis-host",
         "unwritable-sqlite", "bad-partitions", "bad-prefix", "bad-log-level"],
)
def test_errors_are_one_coded_line_without_traceback_or_secret(
    tmp_path: Path, args: tuple[str, ...], code: str, status: int, says: str
) -> None:
    if "status" in args and "sqlite:///{tmp}/x.db" in args:
        upgraded = outbox("db", "upgrade", "--database-url", f"sqlite:///{tmp_path}/x.db")
        assert upgraded.returncode == 0
    result = outbox(*(a.replace("{tmp}", str(tmp_path)) for a in args), timeout=60)
    assert result.returncode == status, result.stderr
    assert result.stderr.startswith(f"error {code}: "), result.stderr
    assert says in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert "hunter2" not in result.stderr + result.stdout


def test_log_level_debug_works_on_one_shot_commands(tmp_path: Path) -> None:
    result = outbox("db", "check", "--database-url", "postgresql://u:hunter2@127.0.0.1:1/x",
                    "--startup-timeout-s", "0", "--log-level", "DEBUG")
    assert result.returncode == 1
    # the driver's text, redacted
    assert "DEBUG outbox_relay.shared.db connect error: " in result.stderr
    assert "hunter2" not in result.stderr


def test_relay_until_idle_gives_up_on_a_redis_that_is_down(tmp_path: Path) -> None:
    from outbox_relay.shared import db

    url = f"sqlite:///{tmp_path}/x.db"
    engine = db.make_engine(url)
    db.upgrade(engine)
    enqueue_events(engine, 3)  # something to deliver (an empty outbox is idle at once)
    engine.dispose()
    result = outbox("relay", "--until-idle", "--database-url", url, "--redis-url",
                    "redis://127.0.0.1:1/0", "--startup-timeout-s", "2",
                    "--partitions", str(PARTITIONS), timeout=60)
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "error unavailable: Redis at 127.0.0.1:1/0 is unavailable or timed out")


def test_relay_waits_for_a_database_that_comes_up_after_it(
    tmp_path: Path, key_prefix: str, redis_client: redis.Redis
) -> None:
    from outbox_relay.shared import db
    from tests.helpers import stream_entries, wait_until

    url = f"sqlite:///{tmp_path}/later/outbox.db"  # its folder does not exist yet: unavailable
    log = tmp_path / "relay.log"
    base = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env = {**base, "OUTBOX_DATABASE_URL": url, "OUTBOX_REDIS_URL": REDIS_URL,
           "OUTBOX_KEY_PREFIX": key_prefix, "OUTBOX_PARTITIONS": str(PARTITIONS)}
    with log.open("w") as out:
        proc = subprocess.Popen([str(OUTBOX), "relay", "--until-idle", "--startup-timeout-s",
                                 "60"], env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until(lambda: "retrying" in log.read_text(), what="the relay to retry its start")
        # Build the database elsewhere, then move its folder into place in one step, so the
        # relay finds it migrated and holding events (and cannot exit idle in between).
        staging = tmp_path / "staging"
        staging.mkdir()
        engine = db.make_engine(f"sqlite:///{staging}/outbox.db")
        db.upgrade(engine)
        ids = enqueue_events(engine, 5)
        engine.dispose()
        staging.rename(tmp_path / "later")
        assert proc.wait(timeout=60) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert sorted(f["id"] for _p, _id, f in stream_entries(redis_client, key_prefix)) == sorted(ids)
