"""Handlers' one-row inserts in flight on PostgreSQL (consumer/pipelining.py): what a handler
reads is what it reads without pipelining, and a failing insert still fails only its own event.
Every case runs on both databases (SQLite never pipelines: the same outcomes are expected)."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
from sqlalchemy import (
    Column,
    Connection,
    Engine,
    ForeignKey,
    Integer,
    MetaData,
    String,
    Table,
    func,
    insert,
    select,
    text,
    update,
)
from sqlalchemy import exc as sa_exc
from sqlalchemy.ext.asyncio import AsyncConnection

from outbox_relay.consumer import async_handlers, inbox
from outbox_relay.consumer.handlers import Handlers
from outbox_relay.consumer.pipelining import _ACTIVE
from outbox_relay.shared.db import is_postgres
from outbox_relay.shared.envelope import Event
from tests.helpers import create_effects, effect_counts, effects, event, receipt_outcomes

pytestmark = pytest.mark.integration


def deliveries(events: list[Event]) -> list[inbox.Delivery]:
    return [inbox.Delivery("k", f"1-{i}", ev, 1) for i, ev in enumerate(events)]


def in_flight(conn: Connection) -> bool:
    """Whether the claim's connection is in pipeline mode right now."""
    return id(conn) in _ACTIVE and _ACTIVE[id(conn)].pipeline is not None


def test_inserts_are_pipelined_on_postgresql_and_read_back_inside_the_batch(
    engine: Engine,
) -> None:
    create_effects(engine)
    seen: dict[str, Any] = {}

    def handler(conn: Connection, ev: Event) -> None:
        seen.setdefault("pipelined", []).append(in_flight(conn))
        n = 30_000 + 100 * int(ev.aggregateid[1:])  # type: ignore[index]
        result = conn.execute(effects.insert().values(n=n, event_id=ev.id, note="x"))
        seen.setdefault("rowcount", []).append(result.rowcount)  # 1, as without pipelining
        # The same insert as text SQL (also left in flight).
        conn.execute(text("INSERT INTO test_effects (n, event_id, note) VALUES (:n, :e, :note)"),
                     {"n": n + 1, "e": ev.id, "note": "text"})
        # A read after pipelined inserts sees all of them (the batch's so far).
        count = conn.execute(select(func.count()).select_from(effects)).scalar_one()
        seen.setdefault("counts", []).append(count)
        # An insert returning its generated key waits for its result.
        key = conn.execute(effects.insert().values(event_id=ev.id, note="key")
                           ).inserted_primary_key
        seen.setdefault("keys", []).append(key is not None and key[0] is not None)
        # An UPDATE's row count is its own.
        changed = conn.execute(update(effects).where(effects.c.event_id == ev.id)
                               .values(note="y")).rowcount
        seen.setdefault("updated", []).append(changed)

    handlers = Handlers()
    handlers.register("*", handler)
    events = [event(f"p{i}", 1) for i in range(4)]
    outcomes = inbox.claim(engine, "g", deliveries(events), handlers)
    assert [o.outcome for o in outcomes] == [inbox.APPLIED] * 4
    assert seen["pipelined"] == [is_postgres(engine)] * 4
    assert seen["rowcount"] == [1] * 4
    assert seen["counts"] == [2, 5, 8, 11]
    assert seen["keys"] == [True] * 4
    assert seen["updated"] == [3] * 4
    assert effect_counts(engine) == {ev.id: 3 for ev in events}


def test_a_failing_insert_in_flight_fails_only_its_own_event(engine: Engine) -> None:
    """The duplicate key of event 2 is raised later (by event 4's read, or at the end):
    the batch is redone one savepoint per handler, and only event 2 fails."""
    create_effects(engine)
    with engine.begin() as conn:
        conn.execute(insert(effects).values(n=10_002, event_id="taken", note="x"))
    calls: list[str] = []

    def handler(conn: Connection, ev: Event) -> None:
        calls.append(ev.id)
        n = 10_000 + int(ev.aggregateid[1:])  # type: ignore[index]
        conn.execute(insert(effects).values(n=n, event_id=ev.id, note="x"))
        if ev.aggregateid == "q4":
            conn.execute(select(func.count()).select_from(effects)).scalar_one()

    handlers = Handlers()
    handlers.register("*", handler)
    events = [event(f"q{i}", 1) for i in range(6)]
    outcomes = inbox.claim(engine, "g", deliveries(events), handlers)
    assert [o.outcome for o in outcomes] == [
        inbox.APPLIED, inbox.APPLIED, inbox.FAILED, inbox.APPLIED, inbox.APPLIED, inbox.APPLIED]
    assert outcomes[2].error == "IntegrityError"
    assert effect_counts(engine) == {"taken": 1, **{ev.id: 1 for i, ev in enumerate(events)
                                                    if i != 2}}
    assert receipt_outcomes(engine) == {ev.id: inbox.APPLIED for i, ev in enumerate(events)
                                        if i != 2}
    # In flight, which handler failed is unknown: the redo runs every handler again. Not
    # pipelined (SQLite), the failing one is named and the redo skips it.
    redo = [ev.id for i, ev in enumerate(events) if is_postgres(engine) or i != 2]
    assert calls[-len(redo):] == redo


def test_a_handler_catching_its_own_insert_error_gets_it_in_the_redo(engine: Engine) -> None:
    """A handler that handles its duplicate key itself (in its own savepoint) is applied:
    in flight, the error reaches it only when the batch is redone without pipelining."""
    create_effects(engine)
    with engine.begin() as conn:
        conn.execute(insert(effects).values(n=20_001, event_id="taken", note="x"))

    def handler(conn: Connection, ev: Event) -> None:
        n = 20_000 + int(ev.aggregateid[1:])  # type: ignore[index]
        try:
            with conn.begin_nested():
                conn.execute(insert(effects).values(n=n, event_id=ev.id, note="x"))
        except sa_exc.IntegrityError:
            conn.execute(text("UPDATE test_effects SET note = 'kept' WHERE n = :n"), {"n": n})

    handlers = Handlers()
    handlers.register("*", handler)
    events = [event(f"r{i}", 1) for i in range(3)]
    outcomes = inbox.claim(engine, "g", deliveries(events), handlers)
    assert [o.outcome for o in outcomes] == [inbox.APPLIED] * 3
    with engine.connect() as conn:
        notes = dict(conn.execute(select(effects.c.n, effects.c.note)).all())
    assert notes == {20_000: "x", 20_001: "kept", 20_002: "x"}


def test_pipeline_false_sends_each_statement_and_waits(engine: Engine) -> None:
    create_effects(engine)
    states: list[bool] = []

    def handler(conn: Connection, ev: Event) -> None:
        states.append(in_flight(conn))
        conn.execute(effects.insert().values(event_id=ev.id, note="x"))

    handlers = Handlers(pipeline=False)
    handlers.register("*", handler)
    events = [event(f"s{i}", 1) for i in range(3)]
    outcomes = inbox.claim(engine, "g", deliveries(events), handlers)
    assert [o.outcome for o in outcomes] == [inbox.APPLIED] * 3
    assert states == [False] * 3
    assert effect_counts(engine) == {ev.id: 1 for ev in events}


def test_a_python_error_after_inserts_in_flight_still_names_its_event(engine: Engine) -> None:
    """A handler's own (non-database) error is its event's, pipelined or not: the redo does
    not run it again, and the inserts in flight before it commit with their events."""
    create_effects(engine)
    calls: list[str] = []

    def handler(conn: Connection, ev: Event) -> None:
        calls.append(ev.id)
        conn.execute(effects.insert().values(event_id=ev.id, note="x"))
        if ev.aggregateid == "t1":
            raise ValueError("bad data")

    handlers = Handlers()
    handlers.register("*", handler)
    events = [event(f"t{i}", 1) for i in range(3)]
    outcomes = inbox.claim(engine, "g", deliveries(events), handlers)
    assert [o.outcome for o in outcomes] == [inbox.APPLIED, inbox.FAILED, inbox.APPLIED]
    assert calls == [events[0].id, events[1].id, events[0].id, events[2].id]
    assert effect_counts(engine) == {events[0].id: 1, events[2].id: 1}


def kept(conn: Connection) -> int:
    """How many one-row inserts the claim's connection keeps unsent right now."""
    state = _ACTIVE.get(id(conn))
    return len(state.rows) if state is not None else 0


def test_consecutive_one_row_inserts_are_kept_and_sent_together(engine: Engine) -> None:
    """Each handler's insert of the same text is kept (PostgreSQL) and sent with the others at
    the batch's end; a handler that runs ``exec_driver_sql`` with one dict it changes each
    time still writes its own values (the kept parameters are copies)."""
    create_effects(engine)
    before: list[int] = []
    params: dict[str, Any] = {}
    sql = ("INSERT INTO test_effects (n, event_id, note) VALUES (%(n)s, %(e)s, %(note)s)"
           if is_postgres(engine) else
           "INSERT INTO test_effects (n, event_id, note) VALUES (:n, :e, :note)")

    def handler(conn: Connection, ev: Event) -> None:
        before.append(kept(conn))
        params.update(n=40_000 + int(ev.aggregateid[1:]), e=ev.id, note="raw")  # type: ignore[index]
        conn.exec_driver_sql(sql, params)

    handlers = Handlers()
    handlers.register("*", handler)
    events = [event(f"u{i}", 1) for i in range(5)]
    outcomes = inbox.claim(engine, "g", deliveries(events), handlers)
    assert [o.outcome for o in outcomes] == [inbox.APPLIED] * 5
    assert before == ([0, 1, 2, 3, 4] if is_postgres(engine) else [0] * 5)
    with engine.connect() as conn:
        rows = set(conn.execute(select(effects.c.n, effects.c.event_id)).all())
    assert rows == {(40_000 + i, ev.id) for i, ev in enumerate(events)}


_pipe_meta = MetaData()
_parents = Table("test_pipe_parents", _pipe_meta, Column("id", String(64), primary_key=True))
_children = Table("test_pipe_children", _pipe_meta,
                  Column("id", Integer, primary_key=True, autoincrement=False),
                  Column("parent", String(64), ForeignKey("test_pipe_parents.id"),
                         nullable=False))


@pytest.mark.parametrize("style", ["sync", "async"])
def test_kept_inserts_go_before_any_other_statement_in_the_order_they_ran(
    engine: Engine, style: str,
) -> None:
    """A handler writing a parent row then two child rows that reference it (a foreign key
    checked at once): each statement of another text sends what is kept first, so the
    database sees them in the handlers' order and every event applies on the optimistic path
    (no redo: each handler ran once). Sync handlers (PostgreSQL: in the pipeline) and async
    ones (kept on both databases)."""
    _pipe_meta.create_all(engine)
    if not is_postgres(engine):
        with engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
    calls: list[str] = []

    def rows(ev: Event) -> list[Any]:
        calls.append(ev.id)
        i = int(ev.aggregateid[1:])  # type: ignore[index]
        return [insert(_parents).values(id=ev.id),
                insert(_children).values(id=2 * i, parent=ev.id),
                insert(_children).values(id=2 * i + 1, parent=ev.id)]

    def handler(conn: Connection, ev: Event) -> None:
        for statement in rows(ev):
            conn.execute(statement)

    async def async_handler(conn: AsyncConnection, ev: Event) -> None:
        for statement in rows(ev):
            await conn.execute(statement)

    handlers = Handlers()
    handlers.register("*", handler if style == "sync" else async_handler)
    events = [event(f"v{i}", 1) for i in range(4)]
    try:
        outcomes = inbox.claim(engine, "g", deliveries(events), handlers)
        assert [o.outcome for o in outcomes] == [inbox.APPLIED] * 4
        assert calls == [ev.id for ev in events]
        with engine.connect() as conn:
            assert conn.execute(select(func.count()).select_from(_children)).scalar_one() == 8
    finally:
        async_handlers.close()
        _pipe_meta.drop_all(engine)


def test_a_kept_insert_the_driver_cannot_send_fails_only_its_own_event(engine: Engine) -> None:
    """A value the driver cannot adapt is found only when the kept inserts are sent (at the
    batch's end): the batch is redone one savepoint per handler, and only that event fails,
    with the driver's error as SQLAlchemy's (never the raw driver exception)."""
    create_effects(engine)

    def handler(conn: Connection, ev: Event) -> None:
        bad = ev.aggregateid == "w1"
        conn.execute(text("INSERT INTO test_effects (n, event_id, note) VALUES (:n, :e, :note)"),
                     {"n": 50_000 + int(ev.aggregateid[1:]),  # type: ignore[index]
                      "e": ev.id, "note": object() if bad else "x"})

    handlers = Handlers()
    handlers.register("*", handler)
    events = [event(f"w{i}", 1) for i in range(3)]
    outcomes = inbox.claim(engine, "g", deliveries(events), handlers)
    assert [o.outcome for o in outcomes] == [inbox.APPLIED, inbox.FAILED, inbox.APPLIED]
    assert outcomes[1].error in ("ProgrammingError", "InterfaceError")
    assert effect_counts(engine) == {events[0].id: 1, events[2].id: 1}


def test_a_kept_inserts_failure_met_by_a_later_handler_fails_only_its_own_event(
    engine: Engine,
) -> None:
    """Sync handlers: event h0's kept duplicate is sent by h1's read, which h1 wraps in
    ``except IntegrityError`` (an idempotent handler's habit). On PostgreSQL the failure is
    read at that read's sync (the pipeline's first error, which may be h1's own), so h1 may
    catch it there; the transaction is failed then, so the batch is redone whatever h1 does,
    and only h0 fails."""
    create_effects(engine)
    with engine.begin() as conn:
        conn.execute(insert(effects).values(n=90_000, event_id="taken", note="x"))

    def handler(conn: Connection, ev: Event) -> None:
        if ev.aggregateid == "h0":
            conn.execute(insert(effects).values(n=90_000, event_id=ev.id, note="dup"))
            return
        with contextlib.suppress(sa_exc.IntegrityError):
            conn.execute(select(func.count()).select_from(effects))
        conn.execute(insert(effects).values(n=90_001, event_id=ev.id, note="x"))

    handlers = Handlers()
    handlers.register("*", handler)
    events = [event("h0", 1), event("h1", 1)]
    outcomes = inbox.claim(engine, "g", deliveries(events), handlers)
    assert [(o.outcome, o.error) for o in outcomes] == [
        (inbox.FAILED, "IntegrityError"), (inbox.APPLIED, None)]
    assert effect_counts(engine) == {"taken": 1, events[1].id: 1}
