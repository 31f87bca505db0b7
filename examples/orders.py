"""A complete producer/consumer pair, as shown in the README.

Producer: ``python -m examples.orders place o-1 42`` writes an order and its ``order.placed``
event in one transaction. Relay: ``outbox relay``. Consumer: ``outbox consume --streams orders
--group billing --app examples.orders:handlers`` records an invoice exactly once per event.
"""

from __future__ import annotations

import sys

from sqlalchemy import Connection, text

from outbox_relay import CommonSettings, Event, Handlers, Producer, make_engine, upgrade

# partitions: the same OUTBOX_PARTITIONS as the relays and consumers (checked at first write)
outbox = Producer(source="shop", partitions=CommonSettings().partitions)
handlers = Handlers()

SCHEMA = (
    "CREATE TABLE IF NOT EXISTS orders (id VARCHAR(64) PRIMARY KEY, total INTEGER)",
    "CREATE TABLE IF NOT EXISTS invoices (order_id VARCHAR(64) PRIMARY KEY, total INTEGER)",
)


def place_order(conn: Connection, order_id: str, total: int) -> str:
    """The business write and its event commit together, or neither does."""
    conn.execute(
        text("INSERT INTO orders (id, total) VALUES (:id, :t)"), {"id": order_id, "t": total}
    )
    return outbox.enqueue(
        conn,
        type="order.placed",
        stream="orders",
        aggregate_type="order",
        aggregate_id=order_id,
        revision=1,  # event id = "o-1:order.placed:1": a second enqueue is a duplicate
        data={"total": total},
    )


@handlers.on("order.placed")  # ordering="strict" (the default)
def invoice(conn: Connection, event: Event) -> None:
    """Runs inside the consumer's claim transaction: the invoice and the inbox receipt commit
    together, so a redelivered event never invoices twice."""
    conn.execute(
        text("INSERT INTO invoices (order_id, total) VALUES (:id, :t)"),
        {"id": event.aggregateid, "t": event.data["total"]},
    )


def main(argv: list[str]) -> int:
    """``place ORDER_ID TOTAL``: migrate, create the demo tables, place one order.

    Safe to run again: placing an order that exists changes nothing and says so (its event,
    ``<order>:order.placed:1``, is already in the outbox)."""
    if len(argv) != 3 or argv[0] != "place" or not argv[2].lstrip("-").isdigit():
        print("usage: python -m examples.orders place ORDER_ID TOTAL  (TOTAL: a whole number)",
              file=sys.stderr)
        return 2
    order_id, total = argv[1], int(argv[2])
    engine = make_engine(CommonSettings().database_url)
    upgrade(engine)
    with engine.begin() as conn:
        for statement in SCHEMA:
            conn.execute(text(statement))
        placed = conn.execute(
            text("SELECT total FROM orders WHERE id = :id"), {"id": order_id}
        ).scalar_one_or_none()
        if placed is None:
            event_id = place_order(conn, order_id, total)
    if placed is None:
        print(f"placed {order_id}; event {event_id} is in the outbox")
        return 0
    if placed == total:
        print(f"{order_id} was placed before (total {placed}): nothing written")
        return 0
    print(f"error conflict: {order_id} was placed before with total {placed}, not {total}",
          file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
