"""Order per aggregate (design.md flow 3, invariant 6) on the real Redis and both databases:
``strict`` events apply in revision order or are dead-lettered ``out_of_order``, ``latest``
ones are ``superseded``; nothing is ever skipped silently. Most tests go through the real
``Consumer``; errors are classified so one bad handler never takes its batch down with it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any, ClassVar

import pytest
import redis
from sqlalchemy import Connection, Engine, exc, select, text
from sqlalchemy.ext.asyncio import AsyncConnection

from outbox_relay.consumer import Handlers, async_handlers, dead_letters, inbox, streams
from outbox_relay.consumer.daemon import Consumer
from outbox_relay.shared import keys
from outbox_relay.shared.envelope import Event
from outbox_relay.shared.errors import UnavailableError
from outbox_relay.shared.schema import inbox_heads
from tests import helpers
from tests.helpers import (
    GROUP,
    PARTITIONS,
    effect_counts,
    effects,
    event,
    key_of,
    pending_total,
    receipts,
    record_effect,
    wait_until,
    xadd_event,
)
from tests.helpers import dead_letters as letters_of

pytestmark = pytest.mark.integration

Fails = Callable[[Event, int], bool]


@pytest.fixture(autouse=True, params=["sync", "async"])
def handler_style(request: pytest.FixtureRequest) -> Iterator[str]:
    """Every test here runs with sync handlers and with async ones (the same claim code on an
    async engine: consumer/async_handlers.py)."""
    App.style = request.param
    yield request.param
    App.style = "sync"
    async_handlers.close()


class App:
    """``thing.happened`` (strict), ``other.thing`` (strict) and ``news.changed`` (latest)
    handlers that record an effect row per application; ``fails(event, call)`` raises.
    ``style`` (set by the ``handler_style`` fixture): ``def`` or ``async def`` handlers."""

    style: ClassVar[str] = "sync"

    def __init__(self, fails: Fails = lambda _e, _n: False,
                 sql: Callable[[Event], str | None] = lambda _e: None) -> None:
        self.calls: Counter[str] = Counter()
        self.fails, self.sql = fails, sql
        self.handlers = Handlers()
        handle = self.handle_async if self.style == "async" else self.handle
        self.handlers.register("thing.happened", handle)
        self.handlers.register("other.thing", handle)
        self.handlers.register("news.changed", handle, ordering="latest")

    def handle(self, conn: Connection, ev: Event) -> None:
        self.calls[ev.id] += 1
        record_effect(conn, ev)
        statement = self.sql(ev)
        if statement is not None:
            conn.execute(text(statement))
        if self.fails(ev, self.calls[ev.id]):
            raise RuntimeError("the handler failed on purpose")

    async def handle_async(self, conn: AsyncConnection, ev: Event) -> None:
        self.calls[ev.id] += 1
        await conn.execute(effects.insert().values(event_id=ev.id, note="applied"))
        statement = self.sql(ev)
        if statement is not None:
            await conn.execute(text(statement))
        if self.fails(ev, self.calls[ev.id]):
            raise RuntimeError("the handler failed on purpose")



# tests.helpers.make_consumer, with pending passes only when a test says (pending_pass)
make_consumer = partial(helpers.make_consumer, claim_interval_ms=60_000)


def pending_pass(consumer: Consumer) -> int:
    """Re-read our own pending entries in id order, with a fresh ``blocked`` set."""
    return consumer.drain_pending()


def apply_order(engine: Engine) -> list[str]:
    with engine.connect() as conn:
        return list(conn.execute(select(effects.c.event_id).order_by(effects.c.n)).scalars())


def delivered(client: redis.Redis, prefix: str, ev: Event) -> int:
    """The group's delivery counter of the pending entry holding ``ev``."""
    rows: Any = client.xpending_range(key_of(prefix, ev.aggregateid or ""), GROUP, "-", "+", 100)
    by_id = {r["message_id"]: int(r["times_delivered"]) for r in rows}
    for entry_id, fields in client.xrange(key_of(prefix, ev.aggregateid or "")):
        if fields[b"id"] == ev.id.encode() and entry_id in by_id:
            return by_id[entry_id]
    raise AssertionError(f"{ev.id} is not pending")


def letters(client: redis.Redis, prefix: str, aggregate: str) -> list[dict[bytes, bytes]]:
    return letters_of(client, prefix, keys.partition_for(aggregate, PARTITIONS))


def test_a_failing_revision_holds_back_the_next_one_in_its_batch(
    effects_engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    rev1, rev2 = event("agg", 1), event("agg", 2)
    app = App(fails=lambda ev, n: ev.id == rev1.id and n == 1)
    consumer = make_consumer(effects_engine, redis_client, key_prefix, app)
    xadd_event(redis_client, key_prefix, rev1)
    xadd_event(redis_client, key_prefix, rev2)
    assert consumer.run_once() == 2

    assert (consumer.stats.failed, consumer.stats.waiting) == (1, 1)
    assert apply_order(effects_engine) == [] and receipts(effects_engine) == {}
    assert pending_total(redis_client, key_prefix) == 2  # neither is acknowledged
    assert delivered(redis_client, key_prefix, rev2) == 0  # waiting is not an attempt

    pending_pass(consumer)
    assert apply_order(effects_engine) == [rev1.id, rev2.id]
    assert receipts(effects_engine) == {rev1.id: ("applied", None), rev2.id: ("applied", None)}
    assert app.calls == {rev1.id: 2, rev2.id: 1}
    assert pending_total(redis_client, key_prefix) == 0 and letters(
        redis_client, key_prefix, "agg") == []


def test_a_failing_revision_holds_back_the_next_one_read_later(
    effects_engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    rev1, rev2 = event("agg", 1), event("agg", 2)
    app = App(fails=lambda ev, n: ev.id == rev1.id and n == 1)
    consumer = make_consumer(effects_engine, redis_client, key_prefix, app)
    xadd_event(redis_client, key_prefix, rev1)
    consumer.run_once()
    assert consumer.stats.failed == 1
    xadd_event(redis_client, key_prefix, rev2)
    consumer.run_once()  # the next read: revision 2 waits behind the failing revision 1
    assert effect_counts(effects_engine) == {}
    assert consumer.stats.waiting == 1 and pending_total(redis_client, key_prefix) == 2

    pending_pass(consumer)
    assert apply_order(effects_engine) == [rev1.id, rev2.id]
    assert set(receipts(effects_engine).values()) == {("applied", None)}
    assert pending_total(redis_client, key_prefix) == 0


def test_waiting_never_counts_toward_max_deliveries(
    effects_engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    rev1, rev2 = event("agg", 1), event("agg", 2)
    app = App(fails=lambda ev, _n: ev.id == rev1.id)  # revision 1 never succeeds
    consumer = make_consumer(effects_engine, redis_client, key_prefix, app, max_deliveries=3)
    xadd_event(redis_client, key_prefix, rev1)
    xadd_event(redis_client, key_prefix, rev2)
    consumer.run_once()
    for attempt in (2, 3):
        pending_pass(consumer)
        assert delivered(redis_client, key_prefix, rev1) == attempt
        assert delivered(redis_client, key_prefix, rev2) == 0
    pending_pass(consumer)  # delivery 4 of revision 1: dead-lettered; revision 2 applies

    (letter,) = letters(redis_client, key_prefix, "agg")
    assert letter[b"id"] == rev1.id.encode() and letter[b"dlq.reason"] == b"max_deliveries"
    assert receipts(effects_engine) == {rev1.id: ("dead", "max_deliveries"),
                                        rev2.id: ("applied", None)}
    assert consumer.stats.waiting == 3 and pending_total(redis_client, key_prefix) == 0


def test_two_types_at_one_revision_both_apply(
    effects_engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    app = App()
    consumer = make_consumer(effects_engine, redis_client, key_prefix, app)
    same_batch = [event("a", 1), event("a", 1, type="other.thing")]
    for ev in same_batch:
        xadd_event(redis_client, key_prefix, ev)
    consumer.run_once()
    later = [event("b", 1), event("b", 1, type="other.thing")]
    for ev in later:  # the second type in a later read: equal to the head, still applied
        xadd_event(redis_client, key_prefix, ev)
        consumer.run_once()
    evs = same_batch + later
    assert receipts(effects_engine) == {ev.id: ("applied", None) for ev in evs}
    assert effect_counts(effects_engine) == {ev.id: 1 for ev in evs}
    assert pending_total(redis_client, key_prefix) == 0


def test_latest_an_older_revision_is_superseded_and_acknowledged(
    effects_engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    app = App()
    consumer = make_consumer(effects_engine, redis_client, key_prefix, app)
    newer, older = event("n", 2, type="news.changed"), event("n", 1, type="news.changed")
    xadd_event(redis_client, key_prefix, newer)
    consumer.run_once()
    xadd_event(redis_client, key_prefix, older)
    consumer.run_once()
    assert receipts(effects_engine) == {newer.id: ("applied", None),
                                        older.id: ("superseded", None)}
    assert app.calls == {newer.id: 1}
    assert consumer.stats.superseded == 1 and consumer.stats.dead == 0
    assert letters(redis_client, key_prefix, "n") == []
    assert pending_total(redis_client, key_prefix) == 0


def test_a_latest_event_waits_behind_a_failing_strict_one_of_its_aggregate(
    effects_engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    """Strict rev 1 fails once; latest rev 2 of the same aggregate must not raise the head past
    it (rev 1 would then come back out_of_order): it waits, and both apply in order."""
    strict1, latest2 = event("mix", 1), event("mix", 2, type="news.changed")
    app = App(fails=lambda ev, n: ev.id == strict1.id and n == 1)
    consumer = make_consumer(effects_engine, redis_client, key_prefix, app)
    xadd_event(redis_client, key_prefix, strict1)
    xadd_event(redis_client, key_prefix, latest2)
    consumer.run_once()
    assert (consumer.stats.failed, consumer.stats.waiting) == (1, 1)
    pending_pass(consumer)
    assert apply_order(effects_engine) == [strict1.id, latest2.id]
    assert receipts(effects_engine) == {strict1.id: ("applied", None),
                                        latest2.id: ("applied", None)}
    assert letters(redis_client, key_prefix, "mix") == []


def test_a_database_outage_never_counts_as_deliveries(
    effects_engine: Engine, redis_client: redis.Redis, key_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The claim fails (database unavailable) more times than max_deliveries while the
    consumer keeps re-reading its pending entries: no handler ever ran, so when the database is
    back nothing is dead-lettered as max_deliveries; everything applies."""
    from outbox_relay.consumer import inbox

    evs = [event("x", 1), event("x", 2), event("y", 1)]
    app = App()
    consumer = make_consumer(effects_engine, redis_client, key_prefix, app, max_deliveries=2)
    for ev in evs:
        xadd_event(redis_client, key_prefix, ev)
    real_claim, failures = inbox.claim, [0]

    def down(*args: Any, **kwargs: Any) -> Any:
        if failures[0] < 6:
            failures[0] += 1
            raise UnavailableError("the database is down")
        return real_claim(*args, **kwargs)

    monkeypatch.setattr(inbox, "claim", down)
    while failures[0] < 6:
        with pytest.raises(UnavailableError):
            consumer.run_once()
    consumer.run_once()
    assert sorted(apply_order(effects_engine)) == sorted(ev.id for ev in evs)
    assert consumer.stats.dead == 0 and letters(redis_client, key_prefix, "x") == []


def make_out_of_order(engine: Engine, client: redis.Redis, prefix: str,
                      consumer: Consumer) -> tuple[Event, Event]:
    newer, older = event("o", 2), event("o", 1)
    xadd_event(client, prefix, newer)
    consumer.run_once()
    xadd_event(client, prefix, older)
    return newer, older


def test_replay_of_an_out_of_order_letter_applies_it_and_removes_it_after_the_commit(
    effects_engine: Engine, redis_client: redis.Redis, key_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    app = App()
    consumer = make_consumer(effects_engine, redis_client, key_prefix, app)
    _newer, older = make_out_of_order(effects_engine, redis_client, key_prefix, consumer)
    consumer.run_once()
    (letter,) = dead_letters.list_letters(redis_client, key_prefix)
    assert letter.reason == "out_of_order"
    assert (letter.meta["revision"], letter.meta["head"]) == ("1", "2")
    assert letter.to_json()["head"] == "2"

    seen_at_removal: list[tuple[str, str | None]] = []
    remove = dead_letters.remove

    def checked_remove(client: redis.Redis, gone: dead_letters.DeadLetter) -> None:
        seen_at_removal.append(receipts(effects_engine)[older.id])  # read on another conn
        remove(client, gone)

    monkeypatch.setattr(dead_letters, "remove", checked_remove)
    result = dead_letters.replay(redis_client, effects_engine, letter, app.handlers, group=GROUP)
    assert (result.outcome, result.removed) == ("applied", True)
    assert seen_at_removal == [("applied", None)]  # the receipt had committed already
    assert dead_letters.list_letters(redis_client, key_prefix) == []
    assert effect_counts(effects_engine)[older.id] == 1
    with effects_engine.connect() as conn:
        head = conn.execute(select(inbox_heads.c.revision).where(
            inbox_heads.c.group_name == GROUP, inbox_heads.c.aggregate_id == "o")).scalar_one()
    assert head == 2  # a replay never lowers the head


def test_a_crash_before_the_letter_is_written_again_on_redelivery(
    effects_engine: Engine, redis_client: redis.Redis, key_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    app = App()
    consumer = make_consumer(effects_engine, redis_client, key_prefix, app)
    _newer, older = make_out_of_order(effects_engine, redis_client, key_prefix, consumer)
    write = streams.dead_letter

    def crash_on_letters(client: redis.Redis, prefix: str, items: list[Any],
                         *args: Any) -> None:
        if items:
            raise UnavailableError("the process died after the commit, before the letter")
        write(client, prefix, items, *args)

    monkeypatch.setattr(streams, "dead_letter", crash_on_letters)
    with pytest.raises(UnavailableError):
        consumer.run_once()
    monkeypatch.undo()
    assert receipts(effects_engine)[older.id] == ("dead", "out_of_order")  # committed
    assert letters(redis_client, key_prefix, "o") == []
    assert pending_total(redis_client, key_prefix) == 1

    restarted = make_consumer(effects_engine, redis_client, key_prefix, app)
    pending_pass(restarted)
    (letter,) = letters(redis_client, key_prefix, "o")
    assert letter[b"id"] == older.id.encode() and letter[b"dlq.reason"] == b"out_of_order"
    assert (letter[b"dlq.revision"], letter[b"dlq.head"]) == (b"1", b"2")
    assert restarted.stats.duplicates == 1 and pending_total(redis_client, key_prefix) == 0
    assert older.id not in effect_counts(effects_engine)


def test_a_bad_statement_fails_only_its_own_event(
    effects_engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    bad = event("bad", 1)
    app = App(sql=lambda ev: "SELECT * FROM no_such_table" if ev.id == bad.id else None)
    consumer = make_consumer(effects_engine, redis_client, key_prefix, app)
    good = [event("good-1", 1), event("good-2", 1)]
    for ev in (good[0], bad, good[1]):
        xadd_event(redis_client, key_prefix, ev)
    assert consumer.run_once() == 3
    assert effect_counts(effects_engine) == {good[0].id: 1, good[1].id: 1}
    assert consumer.stats.failed == 1 and pending_total(redis_client, key_prefix) == 1

    wait_until(lambda: pending_pass(consumer) >= 0
               and pending_total(redis_client, key_prefix) == 0, what="bad to be dead")
    assert receipts(effects_engine) == {good[0].id: ("applied", None), bad.id: (
        "dead", "max_deliveries"), good[1].id: ("applied", None)}
    assert [f[b"id"] for p in range(PARTITIONS) for f in letters_of(
        redis_client, key_prefix, p)] == [bad.id.encode()]  # no innocent event


def claim_with(engine: Engine, handler: Callable[[Connection, Event], None],
               events: list[Event], **kwargs: Any) -> list[inbox.Outcome]:
    """Claim ``events`` with ``handler``; with async handlers (``App.style``) the handler
    runs from an ``async def`` through its ``AsyncConnection`` (``run_sync``)."""
    handlers = Handlers()
    if App.style == "async":
        sync_handler = handler

        async def handler_async(conn: AsyncConnection, ev: Event) -> None:
            await conn.run_sync(sync_handler, ev)

        handlers.register("thing.happened", handler_async)
        handlers.register("news.changed", handler_async, ordering="latest")
    else:
        handlers.register("thing.happened", handler)
        handlers.register("news.changed", handler, ordering="latest")
    batch = [inbox.Delivery("k", f"1-{i}", ev, 1) for i, ev in enumerate(events)]
    return inbox.claim(engine, "g", batch, handlers, **kwargs)


def test_postgresql_statement_timeout_is_the_handlers_failure(effects_engine: Engine) -> None:
    if effects_engine.dialect.name != "postgresql":
        pytest.skip("statement_timeout is PostgreSQL's")
    slow = event("slow", 1)

    def handler(conn: Connection, ev: Event) -> None:
        record_effect(conn, ev)
        if ev.id == slow.id:
            conn.execute(text("SET LOCAL statement_timeout = '50ms'"))
        conn.execute(text("SELECT pg_sleep(0.2)" if ev.id == slow.id else "SELECT 1"))
        conn.execute(text("SELECT pg_sleep(0.1)"))  # the timeout rolled back with its savepoint

    evs = [event("before", 1), slow, event("after", 1)]
    got = claim_with(effects_engine, handler, evs)
    assert [o.outcome for o in got] == [inbox.APPLIED, inbox.FAILED, inbox.APPLIED]
    assert effect_counts(effects_engine) == {evs[0].id: 1, evs[2].id: 1}


@pytest.mark.parametrize("kind", ["disconnect", "locked"])
def test_a_lost_connection_or_a_locked_sqlite_fails_the_whole_claim(
    effects_engine: Engine, kind: str
) -> None:
    if kind == "locked" and effects_engine.dialect.name != "sqlite":
        pytest.skip("`database is locked` is SQLite's contention")
    victim = event("v", 1)

    def handler(conn: Connection, ev: Event) -> None:
        record_effect(conn, ev)
        if ev.id == victim.id:
            raise exc.OperationalError("SELECT 1", {}, Exception(
                "database is locked" if kind == "locked" else "server closed the connection"),
                connection_invalidated=kind == "disconnect")

    with pytest.raises(UnavailableError):
        claim_with(effects_engine, handler, [event("u", 1), victim])
    assert effect_counts(effects_engine) == {} and receipts(effects_engine) == {}


def test_claim_rules_on_the_redo_path(effects_engine: Engine) -> None:
    """The optimistic path's redo keeps strict order: the failing delivery blocks the later
    ones of its aggregate; latest ones, and other aggregates, go on."""
    def handler(conn: Connection, ev: Event) -> None:
        record_effect(conn, ev)
        if ev.revision == 1 and ev.aggregateid in ("a", "n"):
            raise RuntimeError("boom")

    evs = [event("a", 1), event("a", 2), event("b", 1), event("a", 3),
           event("n", 1, type="news.changed"), event("n", 2, type="news.changed")]
    blocked: set[tuple[str, str]] = set()
    got = claim_with(effects_engine, handler, evs, blocked=blocked)
    assert [o.outcome for o in got] == [inbox.FAILED, inbox.WAITING, inbox.APPLIED,
                                        inbox.WAITING, inbox.FAILED, inbox.APPLIED]
    assert blocked == {("thing", "a")}
    # a blocked aggregate's delivery waits, even one the daemon marked max_deliveries
    later = inbox.Delivery("k", "2-0", event("a", 4), 9, dead_reason="max_deliveries")
    handlers = Handlers()
    handlers.register("thing.happened", handler)
    (waiting,) = inbox.claim(effects_engine, "g", [later], handlers, blocked=blocked)
    assert waiting.outcome == inbox.WAITING
    (dead,) = inbox.claim(effects_engine, "g", [later], handlers)
    assert (dead.outcome, dead.error) == (inbox.DEAD, "max_deliveries")
