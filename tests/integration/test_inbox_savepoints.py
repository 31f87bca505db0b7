"""The claim runs a batch's handlers under one savepoint and falls back to one savepoint per
handler after a failure, without changing any outcome."""

from __future__ import annotations

import pytest
from sqlalchemy import Connection, Engine

from outbox_relay.consumer import inbox
from outbox_relay.consumer.handlers import Handlers
from outbox_relay.shared.envelope import Event
from tests.helpers import create_effects, effect_counts, event, receipt_outcomes, record_effect

pytestmark = pytest.mark.integration


def deliveries(events: list[Event]) -> list[inbox.Delivery]:
    return [inbox.Delivery("k", f"1-{i}", ev, 1) for i, ev in enumerate(events)]


def test_handlers_apply_a_batch_in_one_pass(engine: Engine) -> None:
    create_effects(engine)
    calls: list[str] = []

    def handler(conn: Connection, ev: Event) -> None:
        calls.append(ev.id)
        record_effect(conn, ev)

    handlers = Handlers()
    handlers.register("*", handler)
    events = [event(f"a{i}", 1) for i in range(5)]
    outcomes = inbox.claim(engine, "g", deliveries(events), handlers)
    assert [o.outcome for o in outcomes] == [inbox.APPLIED] * 5
    assert calls == [ev.id for ev in events]  # no retry: each ran once
    assert effect_counts(engine) == {ev.id: 1 for ev in events}


def test_a_failing_handler_fails_alone_and_drops_scheduled_work(
    engine: Engine,
) -> None:
    create_effects(engine)
    events = [event(f"b{i}", 1) for i in range(3)]
    bad = events[1].id
    handlers = Handlers()

    def handler(conn: Connection, ev: Event) -> None:
        record_effect(conn, ev)
        handlers.after_commit(ev.id, lambda: None)
        if ev.id == bad:
            raise RuntimeError("boom")

    handlers.register("*", handler)
    outcomes = inbox.claim(engine, "g", deliveries(events), handlers)
    assert [o.outcome for o in outcomes] == [inbox.APPLIED, inbox.FAILED, inbox.APPLIED]
    # Same end state as with a savepoint per handler: the failure's writes rolled back alone.
    assert effect_counts(engine) == {events[0].id: 1, events[2].id: 1}
    assert receipt_outcomes(engine) == {events[0].id: inbox.APPLIED, events[2].id: inbox.APPLIED}
    # Callbacks of the rolled-back first pass are gone: one per applied event is left.
    assert len(handlers.take_after_commit({events[0].id, events[2].id})) == 2


def test_handlers_before_a_failure_run_again_but_commit_once(engine: Engine) -> None:
    create_effects(engine)
    calls: list[str] = []

    def plain(conn: Connection, ev: Event) -> None:
        calls.append(ev.id)
        record_effect(conn, ev)
        if ev.aggregateid == "c1":
            raise RuntimeError("boom")

    def other(conn: Connection, ev: Event) -> None:
        record_effect(conn, ev)

    handlers = Handlers()
    handlers.register("thing.happened", plain)
    handlers.register("other.thing", other)
    events = [event("c0", 1), event("c1", 1), event("c2", 1, type="other.thing")]
    outcomes = inbox.claim(engine, "g", deliveries(events), handlers)
    assert [o.outcome for o in outcomes] == [inbox.APPLIED, inbox.FAILED, inbox.APPLIED]
    # Optimistic by default: the first pass under one savepoint rolled back at c1; the second
    # pass ran c0 again in its own savepoint and marked c1 failed without running it again.
    assert calls == [events[0].id, events[1].id, events[0].id]
    assert effect_counts(engine) == {events[0].id: 1, events[2].id: 1}


@pytest.mark.parametrize("pipeline", [True, False])
@pytest.mark.parametrize("size", [1, 3])
def test_a_handler_that_swallows_its_own_database_error_fails_alone(
    engine: Engine, pipeline: bool, size: int
) -> None:
    """On PostgreSQL a refused statement fails the whole transaction, caught or not: the
    handler that swallowed it cannot be applied, and the claim must say so (``failed``, its
    neighbours applied) instead of failing whole and being retried forever. SQLite keeps the
    transaction usable: the handler is applied."""
    from contextlib import suppress

    from sqlalchemy import exc, text

    create_effects(engine)

    def careless(conn: Connection, ev: Event) -> None:
        record_effect(conn, ev)
        if ev.aggregateid == "careless":  # its last statement: nothing after it fails in it
            with suppress(exc.DBAPIError):  # "already done", it thinks
                conn.execute(text("INSERT INTO no_such_table (x) VALUES (1)"))

    handlers = Handlers(pipeline=pipeline)
    handlers.register("*", careless)
    events = [event(f"fine{i}", 1) for i in range(size - 1)] + [event("careless", 1)]
    outcomes = inbox.claim(engine, "swallow", deliveries(events), handlers)
    postgres = engine.dialect.name == "postgresql"
    assert [o.outcome for o in outcomes] == [inbox.APPLIED] * (size - 1) + [
        inbox.FAILED if postgres else inbox.APPLIED]
    assert effect_counts(engine) == {ev.id: 1 for ev in events[: size - 1 if postgres else size]}
