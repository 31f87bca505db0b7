"""A failing handler is logged at WARNING with its traceback, the event's id and type as fields,
and no credential: on the optimistic path (a batch under one savepoint), on the per-handler
path, and for an after-commit callback."""

from __future__ import annotations

import json
import logging

import pytest
import redis
from sqlalchemy import Connection, Engine

from outbox_relay.consumer import inbox
from outbox_relay.consumer.daemon import Consumer
from outbox_relay.consumer.handlers import Handlers
from outbox_relay.shared.envelope import Event
from outbox_relay.shared.logs import JsonFormatter
from tests.helpers import consumer_settings, event, wait_until, xadd_event

pytestmark = pytest.mark.integration

SECRET = "s3cret"
URL = f"redis://app:{SECRET}@cache.internal:6379/0"


def failure_records(caplog: pytest.LogCaptureFixture, event_id: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "event_id", None) == event_id]


def assert_logged_with_traceback(record: logging.LogRecord, ev: Event) -> None:
    assert record.levelno == logging.WARNING
    assert record.exc_info is not None and record.exc_info[0] is RuntimeError
    assert getattr(record, "event_type", None) == ev.type
    line = JsonFormatter().format(record)  # what OUTBOX_LOG_FORMAT=json writes
    assert SECRET not in line
    assert json.loads(line)["event_id"] == ev.id
    assert "Traceback (most recent call last)" in line
    assert "in failing_handler" in line  # the handler's own frame is in the traceback
    assert "RuntimeError: cannot reach redis://app:***@cache.internal" in line


def failing_handler(conn: Connection, ev: Event) -> None:
    if ev.aggregateid in ("bad", "bad2"):
        raise RuntimeError(f"cannot reach {URL}")


@pytest.mark.parametrize("size", [1, 3], ids=["savepoint-per-handler", "optimistic-batch"])
def test_a_handler_failure_logs_its_traceback_at_warning(
    engine: Engine, caplog: pytest.LogCaptureFixture, size: int
) -> None:
    handlers = Handlers()
    handlers.register("*", failing_handler)
    events = [event("bad", 1)] + [event(f"ok{i}", 1) for i in range(size - 1)]
    batch = [inbox.Delivery("k:0", f"1-{i}", ev, 2) for i, ev in enumerate(events)]
    with caplog.at_level(logging.WARNING, logger="outbox_relay.consumer"):
        outcomes = inbox.claim(engine, "g", batch, handlers)
    assert [o.outcome for o in outcomes] == [inbox.FAILED] + [inbox.APPLIED] * (size - 1)
    (record,) = failure_records(caplog, events[0].id)  # logged once, not once per pass
    assert_logged_with_traceback(record, events[0])
    assert getattr(record, "group", None) == "g"
    assert getattr(record, "stream_key", None) == "k:0"


def test_an_after_commit_failure_logs_its_traceback_with_the_event_id(
    engine: Engine, redis_client: redis.Redis, key_prefix: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    handlers = Handlers()
    ran: list[str] = []

    def handler(_conn: Connection, ev: Event) -> None:
        def later() -> None:
            ran.append(ev.id)
            raise RuntimeError(f"cannot reach {URL}")

        handlers.after_commit(ev.id, later)

    handlers.register("*", handler)
    ev = event("after", 1)
    xadd_event(redis_client, key_prefix, ev)
    consumer = Consumer(consumer_settings(key_prefix), engine, redis_client, handlers)
    with caplog.at_level(logging.WARNING, logger="outbox_relay.consumer"):
        wait_until(lambda: consumer.run_once() >= 0 and ran, what="the after-commit callback")
    (record,) = failure_records(caplog, ev.id)
    assert record.levelno == logging.WARNING
    assert record.exc_info is not None and record.exc_info[0] is RuntimeError
    line = JsonFormatter().format(record)
    assert SECRET not in line and "Traceback" in line and '"group": "g1"' in line


def test_a_database_error_in_a_handler_keeps_the_statement_and_its_data_out_of_warning(
    engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    """A handler whose statement the database refuses: the WARNING shows the handler's frames
    and the error class, never the SQL text or its parameters (event data); DEBUG has them."""
    from sqlalchemy import text

    statement = text("INSERT INTO no_such_table (x) VALUES (:x)")
    card = "-".join(("card", "4242"))  # the traceback shows source lines: keep it out of them

    def handler(conn: Connection, ev: Event) -> None:
        conn.execute(statement, {"x": card})

    handlers = Handlers()
    handlers.register("*", handler)
    ev = event("sql", 1)
    with caplog.at_level(logging.DEBUG, logger="outbox_relay.consumer"):
        (outcome,) = inbox.claim(engine, "g", [inbox.Delivery("k:0", "1-1", ev, 1)], handlers)
    assert outcome.outcome == inbox.FAILED
    records = failure_records(caplog, ev.id)
    (warning,) = [r for r in records if r.levelno == logging.WARNING]
    line = JsonFormatter().format(warning)
    assert "card-4242" not in line and "no_such_table" not in line
    assert "in handler" in line and "the database refused a statement" in line
    debug = [r for r in caplog.records if r.levelno == logging.DEBUG and r.exc_info]
    assert any("card-4242" in logging.Formatter().format(r) for r in debug)


def test_two_failing_handlers_in_one_batch_are_logged_each_on_its_own(
    engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    """The redo after the optimistic path ran inside the ``except`` of the first failure, so
    the second handler's traceback was chained to it ("During handling of the above
    exception ... _HandlerFailed"); the claim done again after ``RedoClaim`` must not chain
    it either."""
    handlers = Handlers()
    handlers.register("*", failing_handler)
    events = [event("bad", 1), event("ok", 1), event("bad", 2, type="other.thing")]
    batch = [inbox.Delivery("k:0", f"1-{i}", ev, 1) for i, ev in enumerate(events)]
    with caplog.at_level(logging.WARNING, logger="outbox_relay.consumer"):
        outcomes = inbox.claim(engine, "g", batch, handlers)
    assert [o.outcome for o in outcomes] == [inbox.FAILED, inbox.APPLIED, inbox.WAITING]
    events[2] = event("bad2", 1)  # another aggregate: it runs (and fails) in the redo
    batch = [inbox.Delivery("k:0", f"2-{i}", ev, 1) for i, ev in enumerate(events)]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="outbox_relay.consumer"):
        inbox.claim(engine, "g2", batch, handlers)
    failing_handler_bad2 = [r for r in caplog.records if getattr(r, "event_id", "") in (
        events[0].id, events[2].id)]
    assert len(failing_handler_bad2) == 2
    for record in failing_handler_bad2:
        line = JsonFormatter().format(record)
        assert "HandlerFail" not in line and "RedoClaim" not in line, line
        assert "During handling" not in line, line
        assert line.count("Traceback (most recent call last)") == 1
