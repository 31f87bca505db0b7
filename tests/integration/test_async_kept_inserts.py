"""Async handlers' one-row inserts kept and sent together (consumer/pipelining.py): on
PostgreSQL the claim's async connection keeps a handler's plain insert instead of awaiting
it, and sends the kept ones with one ``executemany`` before any other statement and at the
batch's end. What an async handler reads and which event fails are those of the sync path.
Both databases (on SQLite only Core inserts are kept: a text insert's ``lastrowid`` is read
from its own cursor)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
from sqlalchemy import (
    Column,
    Engine,
    MetaData,
    String,
    Table,
    func,
    insert,
    select,
    text,
)
from sqlalchemy import exc as sa_exc
from sqlalchemy.ext.asyncio import AsyncConnection

from outbox_relay.consumer import async_handlers, inbox
from outbox_relay.consumer.handlers import Handlers
from outbox_relay.consumer.pipelining import _ACTIVE
from outbox_relay.shared.db import is_postgres
from outbox_relay.shared.envelope import Event
from tests.helpers import (
    create_effects,
    deliveries,
    effect_counts,
    effects,
    event,
    receipt_outcomes,
)

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def _close_async_engines() -> Iterator[None]:
    yield
    async_handlers.close()


def kept(conn: AsyncConnection) -> int:
    """How many one-row inserts the claim's connection keeps unsent right now."""
    state = _ACTIVE.get(id(conn.sync_connection))
    return len(state.rows) if state is not None else 0


def test_an_async_handlers_inserts_are_kept_and_read_back_inside_the_batch(
    engine: Engine,
) -> None:
    create_effects(engine)
    before: list[int] = []
    counts: list[int] = []
    rowcounts: list[int] = []

    async def handler(conn: AsyncConnection, ev: Event) -> None:
        before.append(kept(conn))
        n = 60_000 + int(ev.aggregateid[1:])  # type: ignore[index]
        result = await conn.execute(insert(effects).values(n=n, event_id=ev.id, note="a"))
        rowcounts.append(result.rowcount)
        if ev.aggregateid == "a3":  # a read sees every kept insert before it
            counts.append((await conn.execute(select(func.count()).select_from(effects)))
                          .scalar_one())

    handlers = Handlers()
    handlers.register("*", handler)
    events = [event(f"a{i}", 1) for i in range(6)]
    outcomes = inbox.claim(engine, "g", deliveries(events), handlers)
    assert [o.outcome for o in outcomes] == [inbox.APPLIED] * 6
    assert before == [0, 1, 2, 3, 0, 1]  # the read sent the four kept before it
    assert counts == [4]
    assert rowcounts == [1] * 6
    assert effect_counts(engine) == {ev.id: 1 for ev in events}


# The order of kept inserts against other statements, async handlers included: in
# tests/integration/test_handler_pipelining.py (test_kept_inserts_go_before_any_other_...).


def test_a_failing_kept_insert_of_an_async_handler_fails_only_its_own_event(
    engine: Engine,
) -> None:
    """A duplicate key among the kept inserts is raised when they are sent (by a later read,
    or at the batch's end): the batch is redone with a savepoint per handler, only the
    duplicate's event fails, and every other event commits its one row."""
    create_effects(engine)
    with engine.begin() as conn:
        conn.execute(insert(effects).values(n=70_002, event_id="taken", note="x"))

    async def handler(conn: AsyncConnection, ev: Event) -> None:
        n = 70_000 + int(ev.aggregateid[1:])  # type: ignore[index]
        await conn.execute(text("INSERT INTO test_effects (n, event_id, note) "
                                "VALUES (:n, :e, 'x')"), {"n": n, "e": ev.id})

    handlers = Handlers()
    handlers.register("*", handler)
    events = [event(f"c{i}", 1) for i in range(5)]
    outcomes = inbox.claim(engine, "g", deliveries(events), handlers)
    assert [o.outcome for o in outcomes] == [
        inbox.APPLIED, inbox.APPLIED, inbox.FAILED, inbox.APPLIED, inbox.APPLIED]
    assert outcomes[2].error == "IntegrityError"
    assert effect_counts(engine) == {"taken": 1, **{ev.id: 1 for i, ev in enumerate(events)
                                                    if i != 2}}
    assert receipt_outcomes(engine) == {ev.id: inbox.APPLIED for i, ev in enumerate(events)
                                        if i != 2}


def test_an_insert_whose_new_key_is_read_back_is_never_kept(engine: Engine) -> None:
    """An insert that leaves its key to the database: SQLAlchemy reads the new key from the
    statement's own cursor (SQLite's ``lastrowid``; PostgreSQL adds ``RETURNING``), so it is
    sent at once and ``inserted_primary_key`` is the row's key."""
    create_effects(engine)
    keys: dict[str, int] = {}

    async def handler(conn: AsyncConnection, ev: Event) -> None:
        result = await conn.execute(insert(effects).values(event_id=ev.id, note="k"))
        keys[ev.id] = result.inserted_primary_key[0]

    handlers = Handlers()
    handlers.register("*", handler)
    events = [event(f"d{i}", 1) for i in range(4)]
    outcomes = inbox.claim(engine, "g", deliveries(events), handlers)
    assert [o.outcome for o in outcomes] == [inbox.APPLIED] * 4
    with engine.connect() as conn:
        stored = {e: n for n, e in conn.execute(select(effects.c.n, effects.c.event_id))}
    assert keys == stored


others = Table("test_kept_others", MetaData(), Column("id", String(64), primary_key=True))


@pytest.mark.parametrize("catch", [sa_exc.IntegrityError, Exception])
def test_a_kept_inserts_failure_caught_by_a_later_handler_still_fails_its_own_event(
    engine: Engine, catch: type[Exception],
) -> None:
    """Event e0's kept insert is a duplicate; e1's handler sends it (by a read of its own)
    and catches errors around that read, as an idempotent handler does around its writes. The
    failure is not taken for e1's own: ``except IntegrityError`` does not match it, and one
    caught by ``except Exception`` is raised again after the handler. The batch is redone:
    e0 fails alone, e1 is applied with its row (checked on SQLite too, whose transaction would
    otherwise go on and commit without e0's row)."""
    create_effects(engine)
    others.metadata.create_all(engine)
    with engine.begin() as conn:
        conn.execute(insert(effects).values(n=80_000, event_id="taken", note="x"))

    async def handler(conn: AsyncConnection, ev: Event) -> None:
        if ev.aggregateid == "e0":
            await conn.execute(insert(effects).values(n=80_000, event_id=ev.id, note="dup"))
            return
        with contextlib.suppress(catch):
            await conn.execute(select(func.count()).select_from(others))  # sends e0's
        await conn.execute(insert(others).values(id=ev.id))

    handlers = Handlers()
    handlers.register("*", handler)
    events = [event("e0", 1), event("e1", 1)]
    try:
        outcomes = inbox.claim(engine, "g", deliveries(events), handlers)
        assert [(o.outcome, o.error) for o in outcomes] == [
            (inbox.FAILED, "IntegrityError"), (inbox.APPLIED, None)]
        with engine.connect() as conn:
            assert conn.execute(select(others.c.id)).scalars().all() == [events[1].id]
        assert effect_counts(engine) == {"taken": 1}
        assert receipt_outcomes(engine) == {events[1].id: inbox.APPLIED}
    finally:
        others.metadata.drop_all(engine)


def test_a_kept_insert_failing_when_a_later_handler_reads_fails_only_its_own_event(
    engine: Engine,
) -> None:
    """The duplicate of event f0 is sent by f1's read, in the middle of the batch: the error
    names no handler (not f1), the batch is redone, and only f0 fails, as SQLAlchemy's
    ``IntegrityError``."""
    create_effects(engine)
    with engine.begin() as conn:
        conn.execute(insert(effects).values(n=81_000, event_id="taken", note="x"))

    async def handler(conn: AsyncConnection, ev: Event) -> None:
        i = int(ev.aggregateid[1:])  # type: ignore[index]
        if i:
            await conn.execute(select(func.count()).select_from(effects))
        await conn.execute(insert(effects).values(n=81_000 + 10 * i, event_id=ev.id, note="f"))

    handlers = Handlers()
    handlers.register("*", handler)
    events = [event(f"f{i}", 1) for i in range(3)]
    outcomes = inbox.claim(engine, "g", deliveries(events), handlers)
    assert [(o.outcome, o.error) for o in outcomes] == [
        (inbox.FAILED, "IntegrityError"), (inbox.APPLIED, None), (inbox.APPLIED, None)]
    assert effect_counts(engine) == {"taken": 1, events[1].id: 1, events[2].id: 1}


def test_a_text_insert_on_sqlite_is_sent_at_once_and_its_lastrowid_is_its_rows(
    engine: Engine,
) -> None:
    """SQLite: a handler reading ``lastrowid`` of its text insert gets its row's key (text
    inserts are not kept there); PostgreSQL keeps them (no ``lastrowid`` to read)."""
    if is_postgres(engine):
        pytest.skip("lastrowid is SQLite's")
    create_effects(engine)
    got: dict[str, int] = {}

    async def handler(conn: AsyncConnection, ev: Event) -> None:
        result = await conn.execute(text("INSERT INTO test_effects (event_id, note) "
                                         "VALUES (:e, :note)"), {"e": ev.id, "note": "x"})
        got[ev.id] = result.lastrowid

    handlers = Handlers()
    handlers.register("*", handler)
    events = [event(f"g{i}", 1) for i in range(3)]
    outcomes = inbox.claim(engine, "g", deliveries(events), handlers)
    assert [o.outcome for o in outcomes] == [inbox.APPLIED] * 3
    with engine.connect() as conn:
        stored = {e: n for n, e in conn.execute(select(effects.c.n, effects.c.event_id))}
    assert got == stored
