"""examples/orders.py tested with the test kit, as a service tests its own handlers.

The test places orders through the app's own function and transaction, calls ``drain()``
(the real relay and consumer, in-process) and asserts on the invoices the handler wrote, the
receipts and the dead letters. It runs on a temporary SQLite file and fakeredis; set
``OUTBOX_TEST_DATABASE_URL`` and ``OUTBOX_TEST_REDIS_URL`` to run it on real servers.
"""

from __future__ import annotations

import pytest
from sqlalchemy import text

from examples import orders
from outbox_relay import Handlers
from outbox_relay.testing import Options, Outbox

pytest_plugins = ["outbox_relay.testing.plugin"]


@pytest.fixture
def outbox_handlers() -> Handlers:
    return orders.handlers


@pytest.fixture
def outbox_options() -> Options:
    # the app's producer and the kit's relay and consumer must agree on the partitions
    return Options(partitions=orders.outbox.partitions, group="billing")


@pytest.fixture
def shop(outbox: Outbox) -> Outbox:
    """The kit with the example's tables."""
    with outbox.engine.begin() as conn:
        for statement in orders.SCHEMA:
            conn.execute(text(statement))
    return outbox


def invoices(shop: Outbox) -> list[tuple[str, int]]:
    with shop.engine.connect() as conn:
        rows = conn.execute(text("SELECT order_id, total FROM invoices ORDER BY order_id"))
        return [(r.order_id, r.total) for r in rows]


def test_each_placed_order_is_invoiced_once(shop: Outbox) -> None:
    with shop.engine.begin() as conn:
        orders.place_order(conn, "o-1", 42)
        orders.place_order(conn, "o-2", 7)

    report = shop.drain()

    assert invoices(shop) == [("o-1", 42), ("o-2", 7)]
    assert report.applied == 2 and report.dead == 0
    assert sorted((r.event_id, r.outcome) for r in shop.receipts()) == [
        ("o-1:order.placed:1", "applied"), ("o-2:order.placed:1", "applied")]
    assert shop.dead_letters() == []
    assert shop.drain().applied == 0  # nothing left: a second drain changes nothing


def test_a_rolled_back_order_sends_nothing(shop: Outbox) -> None:
    with pytest.raises(RuntimeError), shop.engine.begin() as conn:
        orders.place_order(conn, "o-3", 5)
        raise RuntimeError("payment declined")  # the business transaction fails

    assert shop.drain().delivered == 0
    assert invoices(shop) == [] and shop.receipts() == []


def test_an_order_that_cannot_be_invoiced_is_dead_lettered_not_lost(shop: Outbox) -> None:
    with shop.engine.begin() as conn:  # an invoice exists already: the handler's insert fails
        conn.execute(text("INSERT INTO invoices (order_id, total) VALUES ('o-4', 1)"))
        orders.place_order(conn, "o-4", 9)

    report = shop.drain()  # retried with backoff; the kit moves the clock to each retry

    assert report.failures > 1 and report.dead == 1
    [letter] = shop.dead_letters()
    assert (letter.event_id, letter.reason) == ("o-4:order.placed:1", "retry_horizon")
    assert invoices(shop) == [("o-4", 1)]
