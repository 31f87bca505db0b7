"""The test kit's pytest plugin as a user enables it: the ``outbox`` fixture on its defaults
(a temporary SQLite file and fakeredis), configured by overriding two fixtures."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
from sqlalchemy import Connection, text

from outbox_relay.consumer.handlers import Handlers
from outbox_relay.shared.envelope import Event
from outbox_relay.shared.errors import ConfigError
from outbox_relay.testing import Options, Outbox
from tests.conftest import PG_ADMIN_URL, REDIS_URL

# imported above already: the plugin is a module of its own, so this still works
pytest_plugins = ["outbox_relay.testing.plugin"]

seen: list[str] = []


@pytest.fixture
def outbox_handlers() -> Handlers:
    seen.clear()
    handlers = Handlers()

    @handlers.on("note.added")
    def note(conn: Connection, event: Event) -> None:
        conn.execute(text("INSERT INTO notes (id) VALUES (:id)"), {"id": event.id})
        handlers.after_commit(event.id, lambda: seen.append(event.id))

    return handlers


@pytest.fixture
def outbox_options() -> Options:
    return Options(group="notes", partitions=2)


@pytest.fixture
def defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    """No URLs in the environment (requested before ``outbox``, which reads them)."""
    monkeypatch.delenv("OUTBOX_TEST_DATABASE_URL", raising=False)
    monkeypatch.delenv("OUTBOX_TEST_REDIS_URL", raising=False)


@pytest.fixture
def servers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real PostgreSQL and Redis named in the environment, as a user's CI would."""
    monkeypatch.setenv("OUTBOX_TEST_DATABASE_URL", PG_ADMIN_URL)
    monkeypatch.setenv("OUTBOX_TEST_REDIS_URL", REDIS_URL)


def test_the_fixture_gives_a_kit_on_sqlite_and_fakeredis(defaults: None, outbox: Outbox) -> None:
    assert outbox.engine.dialect.name == "sqlite" and (outbox.group, outbox.partitions) == (
        "notes", 2)
    assert_notes_are_applied(outbox)


@pytest.mark.integration
def test_with_urls_in_the_environment_it_runs_on_those_servers(
    servers: None, outbox: Outbox
) -> None:
    assert outbox.engine.dialect.name == "postgresql"
    assert outbox.client.ping() and "fakeredis" not in type(outbox.client).__module__
    assert_notes_are_applied(outbox)


def assert_notes_are_applied(outbox: Outbox) -> None:
    with outbox.engine.begin() as conn:
        conn.execute(text("CREATE TABLE notes (id VARCHAR(64) PRIMARY KEY)"))
        outbox.enqueue(conn, type="note.added", stream="notes", aggregate_id="n", revision=1)
    outbox.enqueue(type="note.added", stream="notes", aggregate_id="n", revision=2)
    outbox.enqueue(type="note.removed", stream="notes", aggregate_id="n", revision=3)

    report = outbox.drain()

    with outbox.engine.connect() as conn:
        assert list(conn.execute(text("SELECT id FROM notes ORDER BY id")).scalars()) == [
            "n:note.added:1", "n:note.added:2"]
    assert seen == ["n:note.added:1", "n:note.added:2"]  # after-commit work ran, in order
    assert (report.delivered, report.applied, report.dead) == (3, 2, 1)
    assert [(r.event_id, r.outcome, r.reason) for r in outbox.receipts()] == [
        ("n:note.added:1", "applied", None), ("n:note.added:2", "applied", None),
        ("n:note.removed:3", "dead", "unknown_type")]
    assert [d.reason for d in outbox.dead_letters()] == ["unknown_type"]


def test_without_lupa_the_default_redis_is_refused_with_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = importlib.util.find_spec

    def find_spec(name: str, *args: Any) -> Any:
        return None if name == "lupa" else real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(ConfigError, match=r"outbox-relay\[testing\]"):
        Outbox(Handlers())


def test_an_empty_outbox_drains_at_once(defaults: None, outbox: Outbox) -> None:
    report = outbox.drain()
    assert (report.rounds, report.delivered, report.applied) == (1, 0, 0)
    assert outbox.receipts() == [] and outbox.dead_letters() == [] and outbox.backlog().settled
