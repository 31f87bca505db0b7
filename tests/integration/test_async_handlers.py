"""Async handlers (``async def handler(conn: AsyncConnection, event)``) run by the one claim
implementation on an async engine (consumer/async_handlers.py): the same outcomes as sync
handlers, their writes in the claim transaction and their own savepoint. Both databases."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
from sqlalchemy import Connection, Engine, insert, select
from sqlalchemy.ext.asyncio import AsyncConnection

from outbox_relay import Producer
from outbox_relay.consumer import async_handlers, inbox
from outbox_relay.consumer.daemon import Consumer
from outbox_relay.consumer.handlers import Handlers
from outbox_relay.consumer.retry import PermanentError, Retry
from outbox_relay.shared.envelope import Event
from outbox_relay.shared.errors import ConfigError
from outbox_relay.shared.schema import outbox as outbox_table
from tests.helpers import (
    consumer_settings,
    create_effects,
    deliveries,
    effect_counts,
    effects,
    event,
    pending_total,
    receipt_outcomes,
    record_effect,
    wait_until,
    xadd_event,
)

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def _close_async_engines() -> Iterator[None]:
    yield
    async_handlers.close()




async def write(conn: AsyncConnection, ev: Event) -> None:
    await conn.execute(insert(effects).values(event_id=ev.id, note="async"))


def test_an_async_handler_writes_in_the_claim_transaction(engine: Engine) -> None:
    create_effects(engine)
    seen: list[type] = []
    handlers = Handlers()

    @handlers.on("thing.happened")
    async def handler(conn: AsyncConnection, ev: Event) -> None:
        seen.append(type(conn))
        await write(conn, ev)

    assert handlers.has_async
    events = [event(f"a{i}", 1) for i in range(5)]
    outcomes = inbox.claim(engine, "g", deliveries(events), handlers)
    assert [o.outcome for o in outcomes] == [inbox.APPLIED] * 5
    assert seen == [AsyncConnection] * 5
    assert effect_counts(engine) == {ev.id: 1 for ev in events}
    assert receipt_outcomes(engine) == {ev.id: inbox.APPLIED for ev in events}
    # Claimed again: duplicates, nothing written twice.
    again = inbox.claim(engine, "g", deliveries(events), handlers)
    assert [o.outcome for o in again] == [inbox.DUPLICATE] * 5
    assert effect_counts(engine) == {ev.id: 1 for ev in events}


def test_a_failing_async_handler_rolls_back_alone_and_holds_its_aggregate(
    engine: Engine,
) -> None:
    create_effects(engine)
    events = [event("b1", 1), event("b2", 1), event("b1", 2), event("b2", 2)]
    handlers = Handlers()

    @handlers.on("thing.happened")
    async def handler(conn: AsyncConnection, ev: Event) -> None:
        await write(conn, ev)  # written, then rolled back with its savepoint
        if ev.id == events[0].id:
            raise RuntimeError("downstream down")

    outcomes = inbox.claim(engine, "g", deliveries(events), handlers, retry=Retry())
    assert [o.outcome for o in outcomes] == [inbox.FAILED, inbox.APPLIED, inbox.WAITING,
                                             inbox.APPLIED]
    assert outcomes[0].retry_at_ms is not None  # durable next attempt
    assert effect_counts(engine) == {events[1].id: 1, events[3].id: 1}


def test_a_permanent_error_from_an_async_handler_is_a_dead_letter(engine: Engine) -> None:
    create_effects(engine)
    handlers = Handlers()

    @handlers.on("thing.happened")
    async def handler(conn: AsyncConnection, ev: Event) -> None:
        raise PermanentError("not for this service")

    outcomes = inbox.claim(engine, "g", deliveries([event("c1", 1)]), handlers, retry=Retry())
    assert [(o.outcome, o.error) for o in outcomes] == [(inbox.DEAD, "rejected")]


def test_async_batch_handlers_and_sync_handlers_share_a_group(engine: Engine) -> None:
    create_effects(engine)
    calls: list[list[str]] = []
    handlers = Handlers()

    @handlers.on_batch("thing.happened")
    async def batch(conn: AsyncConnection, evs: list[Event]) -> None:
        calls.append([ev.id for ev in evs])
        await conn.execute(insert(effects), [{"event_id": ev.id, "note": "b"} for ev in evs])
        if any(ev.aggregateid == "d3" for ev in evs):
            raise RuntimeError("one bad event")

    @handlers.on("thing.changed")
    def single(conn: Connection, ev: Event) -> None:
        record_effect(conn, ev)

    events = [event(f"d{i}", 1) for i in range(5)] + [event("d9", 2, type="thing.changed")]
    outcomes = inbox.claim(engine, "g", deliveries(events), handlers)
    assert [o.outcome for o in outcomes] == [inbox.APPLIED] * 3 + [inbox.FAILED] + [
        inbox.APPLIED] * 2
    assert calls[0] == [ev.id for ev in events[:5]]  # one call first, then one per event
    assert calls[1:] == [[ev.id] for ev in events[:5]]
    assert effect_counts(engine) == {ev.id: 1 for ev in events if ev.aggregateid != "d3"}


def test_an_async_handler_publishes_with_the_receipt_or_not_at_all(engine: Engine) -> None:
    """A handler enqueueing on its claim connection (enqueue_async): the new event commits
    with the receipt; when the handler fails after enqueueing, neither exists."""
    create_effects(engine)
    producer = Producer(source="billing", partitions=4)
    handlers = Handlers()

    @handlers.on("thing.happened")
    async def handler(conn: AsyncConnection, ev: Event) -> None:
        await producer.enqueue_async(conn, type="invoice.sent", stream="invoices",
                                     aggregate_type="invoice", aggregate_id=ev.aggregateid,
                                     revision=ev.revision, data={"for": ev.id})
        if ev.aggregateid == "e2":
            raise RuntimeError("failed after enqueueing")

    outcomes = inbox.claim(engine, "g", deliveries([event("e1", 1), event("e2", 1)]), handlers)
    assert [o.outcome for o in outcomes] == [inbox.APPLIED, inbox.FAILED]
    with engine.connect() as conn:
        published = conn.execute(select(outbox_table.c.event_id)).scalars().all()
    assert published == ["e1:invoice.sent:1"]


def test_an_async_handler_outside_a_claim_says_why() -> None:
    handlers = Handlers()

    @handlers.on("thing.happened")
    async def handler(conn: AsyncConnection, ev: Event) -> None:
        raise AssertionError("never runs")

    sync_form = handlers.get("thing.happened")
    assert sync_form is not None

    class Bare:
        info: dict[str, object] = {}

    with pytest.raises(ConfigError):
        sync_form(Bare(), event("f1", 1))  # type: ignore[arg-type]


def test_the_consumer_daemon_runs_async_handlers_end_to_end(
    engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    create_effects(engine)
    failed_once: set[str] = set()
    events = [event(f"g{i % 4}", i // 4 + 1) for i in range(24)]
    flaky = events[5].id
    handlers = Handlers()

    @handlers.on("thing.happened")
    async def handler(conn: AsyncConnection, ev: Event) -> None:
        if ev.id == flaky and flaky not in failed_once:
            failed_once.add(flaky)
            raise RuntimeError("downstream blinked")
        await write(conn, ev)

    settings = consumer_settings(key_prefix, retry_first_delay_s=0.05, retry_max_delay_s=0.05,
                                 retry_jitter=0.0)
    consumer = Consumer(settings, engine, redis_client, handlers)
    for ev in events:
        xadd_event(redis_client, key_prefix, ev)
    wait_until(lambda: consumer.run_once() >= 0 and len(receipt_outcomes(engine)) == len(events),
               what="every event applied")
    assert effect_counts(engine) == {ev.id: 1 for ev in events}
    assert set(receipt_outcomes(engine).values()) == {inbox.APPLIED}
    assert failed_once == {flaky}
    wait_until(lambda: consumer.run_once() >= 0
               and pending_total(redis_client, key_prefix) == 0, what="all acknowledged")
