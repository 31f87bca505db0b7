"""The test kit (outbox_relay.testing) on SQLite + fakeredis and on PostgreSQL + the real Redis:
drain() applies in order, dead-letters what a handler refuses, retries by moving the clock,
and says what is left when it cannot settle."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Column, Connection, Integer, MetaData, String, Table, select

from outbox_relay.consumer.handlers import Handlers
from outbox_relay.consumer.retry import PermanentError, Retry
from outbox_relay.shared.envelope import Event
from outbox_relay.testing import NotSettledError, Outbox
from tests.conftest import PG_ADMIN_URL, REDIS_URL

pytestmark = pytest.mark.integration

BACKENDS = {"sqlite+fakeredis": (None, None), "postgresql+redis": (PG_ADMIN_URL, REDIS_URL)}

metadata = MetaData()
effects = Table("kit_effects", metadata,
                Column("n", Integer, primary_key=True, autoincrement=True),
                Column("aggregate_id", String(64), nullable=False),
                Column("revision", Integer, nullable=False))


def record(conn: Connection, event: Event) -> None:
    conn.execute(effects.insert().values(aggregate_id=event.aggregateid,
                                         revision=event.revision))


def refuse(_conn: Connection, _event: Event) -> None:
    raise PermanentError("this service does not take refunds")


@pytest.fixture
def handlers() -> Handlers:
    registry = Handlers()
    registry.register("thing.happened", record)
    registry.register("thing.refused", refuse)
    return registry


@pytest.fixture(params=[pytest.param(name, marks=pytest.mark.postgresql)
                        if name.startswith("postgresql") else name for name in BACKENDS])
def backend(request: pytest.FixtureRequest) -> tuple[str | None, str | None]:
    return BACKENDS[request.param]


@pytest.fixture
def make_kit(backend: tuple[str | None, str | None]) -> Iterator[Any]:
    """A factory of kits on this backend with the effects table; all closed afterwards."""
    kits: list[Outbox] = []

    def make(handlers: Handlers, **options: Any) -> Outbox:
        database_url, redis_url = backend
        kit = Outbox(handlers, database_url=database_url, redis_url=redis_url, **options)
        kits.append(kit)
        metadata.create_all(kit.engine)
        return kit

    yield make
    for kit in kits:
        kit.close()


def applied(kit: Outbox) -> list[tuple[str, int]]:
    with kit.engine.connect() as conn:
        rows = conn.execute(select(effects.c.aggregate_id, effects.c.revision)
                            .order_by(effects.c.n))
        return [(a, r) for a, r in rows]


def happened(
    kit: Outbox, conn: Connection | None, aggregate: str, revision: int, **extra: Any
) -> str:
    return kit.enqueue(conn, type=extra.pop("type", "thing.happened"), stream="things",
                       aggregate_type="thing", aggregate_id=aggregate, revision=revision,
                       **extra)


def test_drain_applies_in_order_and_dead_letters_a_permanent_error(
    make_kit: Any, handlers: Handlers
) -> None:
    kit = make_kit(handlers)
    with kit.engine.begin() as conn:  # the test's own transaction
        for revision in range(1, 6):
            happened(kit, conn, "a", revision)
        happened(kit, conn, "b", 1, type="thing.refused")
        happened(kit, conn, "c", 1)

    report = kit.drain()

    assert [r for a, r in applied(kit) if a == "a"] == [1, 2, 3, 4, 5]
    assert sorted(applied(kit)) == [("a", 1), ("a", 2), ("a", 3), ("a", 4), ("a", 5), ("c", 1)]
    assert (report.delivered, report.applied, report.dead, report.advanced_ms) == (7, 6, 1, 0)
    outcomes = {r.event_id: (r.outcome, r.reason) for r in kit.receipts()}
    assert outcomes.pop("b:thing.refused:1") == ("dead", "rejected")
    assert set(outcomes.values()) == {("applied", None)} and len(outcomes) == 6
    [letter] = kit.dead_letters()
    assert (letter.event_id, letter.type, letter.reason, letter.group) == (
        "b:thing.refused:1", "thing.refused", "rejected", "tests")
    assert "this service does not take refunds" in letter.message
    assert kit.backlog().settled


def test_a_handler_failing_once_is_retried_by_moving_the_clock(make_kit: Any) -> None:
    calls: list[str] = []

    def flaky(conn: Connection, event: Event) -> None:
        calls.append(event.id)
        if len(calls) == 1:
            raise ConnectionError("the payment service is down")
        record(conn, event)

    handlers = Handlers()
    handlers.register("thing.happened", flaky, retry=Retry(first_delay_s=60, jitter=0))
    kit = make_kit(handlers)
    with kit.engine.begin() as conn:
        happened(kit, conn, "a", 1)
        happened(kit, conn, "a", 2)  # strict: waits behind revision 1 while it retries

    report = kit.drain()  # the retry is due a minute after the failure

    assert applied(kit) == [("a", 1), ("a", 2)]
    assert calls[0] == calls[1] == "a:thing.happened:1"
    assert report.failures == 1 and report.applied == 2 and report.dead == 0
    assert 50_000 <= report.advanced_ms <= 60_001  # a minute less the time it took: moved
    assert kit.dead_letters() == []


def test_a_handler_that_keeps_failing_reaches_its_horizon(make_kit: Any) -> None:
    def broken(_conn: Connection, _event: Event) -> None:
        raise ConnectionError("down for good")

    handlers = Handlers()
    handlers.register("thing.happened", broken)
    kit = make_kit(handlers, consumer_options={"retry_horizon": "2m"})
    happened(kit, None, "a", 1)  # no connection: in a transaction of the kit's own

    report = kit.drain()

    assert report.dead == 1 and report.failures >= 3 and report.advanced_ms >= 100_000
    [letter] = kit.dead_letters()
    assert letter.reason == "retry_horizon"


def test_events_handlers_enqueue_and_delayed_events_are_drained_too(make_kit: Any) -> None:
    handlers = Handlers()
    kit: Outbox

    def placed(conn: Connection, event: Event) -> None:
        record(conn, event)
        kit.enqueue(conn, type="thing.shipped", stream="shipping", aggregate_type="thing",
                    aggregate_id=event.aggregateid, revision=(event.revision or 0) + 1)

    handlers.register("thing.happened", placed)
    handlers.register("thing.shipped", record)
    kit = make_kit(handlers)  # streams=None: the group reads every stream the outbox has
    with kit.engine.begin() as conn:
        happened(kit, conn, "a", 1, delay_ms=60_000)

    report = kit.drain()

    assert applied(kit) == [("a", 1), ("a", 2)]
    assert report.delivered == 2 and report.advanced_ms >= 55_000


def test_drain_says_what_is_left_when_it_cannot_settle(make_kit: Any) -> None:
    def broken(_conn: Connection, _event: Event) -> None:
        raise ConnectionError("down")

    handlers = Handlers()
    handlers.register("thing.happened", broken)
    kit = make_kit(handlers)
    with kit.engine.begin() as conn:
        happened(kit, conn, "a", 1)

    with pytest.raises(NotSettledError,
                       match=r"fast_forward is off; left: .*retrying a:thing.happened:1"):
        kit.drain(fast_forward=False)
    with pytest.raises(NotSettledError, match="did not settle within 3 rounds"):
        kit.drain(max_rounds=3)
    assert not kit.backlog().settled and kit.dead_letters() == []
