"""Publishing from a handler (the consumer-side outbox): events a handler enqueues with
``Producer.enqueue`` on its claim connection commit with the receipt, or neither; on both
databases, on the optimistic path (a neighbour fails, the batch is redone) too."""

from __future__ import annotations

import pytest
from sqlalchemy import Connection, Engine, select

from outbox_relay.consumer import inbox
from outbox_relay.consumer.handlers import Handlers
from outbox_relay.producer import Producer
from outbox_relay.shared.envelope import Event
from outbox_relay.shared.schema import inbox as inbox_table
from outbox_relay.shared.schema import outbox
from tests.helpers import event

pytestmark = pytest.mark.integration

producer = Producer(source="billing", partitions=4)


def invoicing(fail: set[str]) -> Handlers:
    """``thing.happened`` -> enqueue ``invoice.created`` for the same aggregate, then raise
    if the event's aggregate is in ``fail`` (after the enqueue)."""

    def handle(conn: Connection, ev: Event) -> None:
        producer.enqueue(conn, type="invoice.created", stream="invoices",
                         data={"for": ev.id}, aggregate_type="invoice",
                         aggregate_id=ev.aggregateid, revision=ev.revision)
        if ev.aggregateid in fail:
            raise ConnectionError("the ledger is down")

    handlers = Handlers()
    handlers.register("thing.happened", handle)
    return handlers


def state(engine: Engine) -> tuple[list[str], list[str]]:
    with engine.connect() as conn:
        published = conn.execute(select(outbox.c.aggregate_id).order_by(outbox.c.seq)).scalars()
        applied = conn.execute(select(inbox_table.c.event_id)).scalars()
        return sorted(published), sorted(applied)


def test_an_enqueue_commits_with_the_receipt_or_not_at_all(engine: Engine) -> None:
    fail = {"b"}
    handlers = invoicing(fail)
    events = [event("a", 1), event("b", 1), event("c", 1)]
    batch = [inbox.Delivery("k:0", f"1-{i}", ev, 1) for i, ev in enumerate(events)]
    outcomes = inbox.claim(engine, "g", batch, handlers)
    assert [o.outcome for o in outcomes] == [inbox.APPLIED, inbox.FAILED, inbox.APPLIED]
    # a ran twice (the optimistic pass rolled back, then the redo): one invoice, not two;
    # b's enqueue rolled back with its failure
    assert state(engine) == (["a", "c"], [events[0].id, events[2].id])
    fail.clear()
    (o,) = inbox.claim(engine, "g", batch[1:2], handlers)
    assert o.outcome == inbox.APPLIED
    assert state(engine) == (["a", "b", "c"], sorted(ev.id for ev in events))
    # a redelivery is a duplicate: its handler does not run, nothing is enqueued again
    (o,) = inbox.claim(engine, "g", batch[:1], handlers)
    assert o.outcome == inbox.DUPLICATE and state(engine)[0] == ["a", "b", "c"]
