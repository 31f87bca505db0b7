"""What a consumer applies is what the producer committed (design invariant 8), on the real
Redis and both databases: a redelivered id carrying other data is dead-lettered as
``conflicting_duplicate`` (never applied, never a quiet ``duplicate``), and receipts written
before fingerprints existed are compared with nothing."""

from __future__ import annotations

import json

import pytest
import redis
from sqlalchemy import Connection, Engine, select, update

from outbox_relay.consumer import inbox
from outbox_relay.consumer.daemon import Consumer
from outbox_relay.consumer.handlers import Handlers
from outbox_relay.shared.envelope import Event, fingerprint
from outbox_relay.shared.schema import inbox as inbox_table
from tests.helpers import (
    GROUP,
    consumer_settings,
    create_effects,
    dead_letters,
    effect_counts,
    event,
    partition_of,
    pending_total,
    record_effect,
    wait_until,
    xadd_event,
)

pytestmark = pytest.mark.integration


def orders(engine: Engine) -> tuple[Handlers, list[int]]:
    totals: list[int] = []

    def invoice(conn: Connection, ev: Event) -> None:
        totals.append(ev.data["total"])
        record_effect(conn, ev)

    handlers = Handlers()
    handlers.register("order.placed", invoice)
    create_effects(engine)
    return handlers, totals


def receipt(engine: Engine, event_id: str) -> tuple[str, str | None, str | None]:
    with engine.connect() as conn:
        row = conn.execute(select(inbox_table.c.outcome, inbox_table.c.reason,
                                  inbox_table.c.fingerprint).where(
            inbox_table.c.group_name == GROUP, inbox_table.c.event_id == event_id)).one()
        return row.outcome, row.reason, row.fingerprint


def test_a_redelivered_id_with_other_data_is_a_conflicting_duplicate(
    engine: Engine, redis_client: redis.Redis, key_prefix: str
) -> None:
    """Finding 3 of issue 22: an entry re-using an applied id with other data (total 999999)
    was recorded as a duplicate with no trace that the data differed."""
    handlers, totals = orders(engine)
    consumer = Consumer(consumer_settings(key_prefix), engine, redis_client, handlers)
    real = event("o-3", 1, type="order.placed", data={"total": 30})
    xadd_event(redis_client, key_prefix, real)
    wait_until(lambda: consumer.run_once() >= 0 and totals, what="the real event applied")
    same = event("o-3", 1, type="order.placed", data={"total": 30})  # another time: same event
    forged = event("o-3", 1, type="order.placed", data={"total": 999999})
    assert same.id == forged.id == real.id
    xadd_event(redis_client, key_prefix, same)
    xadd_event(redis_client, key_prefix, forged)
    wait_until(lambda: consumer.run_once() >= 0 and pending_total(redis_client, key_prefix) == 0
               and consumer.stats.dead, what="both redeliveries settled")

    assert totals == [30] and effect_counts(engine) == {real.id: 1}
    assert consumer.stats.duplicates == 1 and consumer.stats.dead == 1
    assert receipt(engine, real.id) == ("applied", None, fingerprint(real))  # unchanged
    (letter,) = dead_letters(redis_client, key_prefix, partition_of("o-3"))
    assert letter[b"dlq.reason"] == b"conflicting_duplicate"
    assert json.loads(letter[b"data"]) == {"total": 999999}
    assert letter[b"dlq.receipt_fingerprint"] == fingerprint(real).encode()  # the applied one
    assert letter[b"dlq.fingerprint"] == fingerprint(forged).encode()  # the delivered one


def test_the_conflict_is_found_in_one_batch_too(engine: Engine) -> None:
    """Two new entries under one id with different data in one claim: the first applies, the
    second is a conflict (the ledger keeps the fingerprint it just applied)."""
    handlers, totals = orders(engine)
    a = event("o-1", 1, type="order.placed", data={"total": 1})
    b = event("o-1", 1, type="order.placed", data={"total": 2})
    batch = [inbox.Delivery("k:0", "1-0", a, 1), inbox.Delivery("k:0", "1-1", b, 1)]
    outcomes = inbox.claim(engine, GROUP, batch, handlers)
    assert [(o.outcome, o.error) for o in outcomes] == [
        (inbox.APPLIED, None), (inbox.DEAD, inbox.CONFLICTING_DUPLICATE)]
    assert outcomes[1].detail == f"{fingerprint(a)} {fingerprint(b)}"
    assert totals == [1]


def test_a_receipt_without_a_fingerprint_is_compared_with_nothing(engine: Engine) -> None:
    """Receipts written before migration 0007 have no fingerprint: a delivery of their id
    is a ``duplicate`` whatever it carries (the data they settled is unknown)."""
    handlers, totals = orders(engine)
    ev = event("o-2", 1, type="order.placed", data={"total": 5})
    inbox.claim(engine, GROUP, [inbox.Delivery("k:0", "1-0", ev, 1)], handlers)
    with engine.begin() as conn:
        conn.execute(update(inbox_table).values(fingerprint=None))
    other = event("o-2", 1, type="order.placed", data={"total": 6})
    (o,) = inbox.claim(engine, GROUP, [inbox.Delivery("k:0", "1-1", other, 1)], handlers)
    assert o.outcome == inbox.DUPLICATE and totals == [5]
    assert receipt(engine, ev.id) == ("applied", None, None)


def test_key_order_and_whitespace_of_data_are_no_conflict() -> None:
    a = Event.from_fields({**event("x", 1).to_fields(), "data": '{"a":1,"b":[1,2]}'})
    b = Event.from_fields({**a.to_fields(), "data": '{ "b": [1, 2], "a": 1 }',
                           "time": "2020-01-01T00:00:00Z"})
    assert fingerprint(a) == fingerprint(b)
    c = Event.from_fields({**a.to_fields(), "data": '{"a":1,"b":[2,1]}'})
    d = Event.from_fields({**a.to_fields(), "source": "elsewhere"})
    assert len({fingerprint(a), fingerprint(c), fingerprint(d)}) == 3
