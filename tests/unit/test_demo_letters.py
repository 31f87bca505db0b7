"""``make demo``'s exit status (issue 26): its deliberate dead letters never fail it, any other
letter does. The demo's billing group dead-letters the late customer's invoices on purpose
(``cli.demo``); an earlier demo's deliberate letters, refilled into a new demo's streams from a
shared database, are no failure either, but counted apart; everything else is."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import pytest
from sqlalchemy import create_engine, insert, select

from outbox_relay.cli import demo_app, demo_billing
from outbox_relay.consumer import PermanentError
from outbox_relay.consumer.dead_letters import DeadLetter
from outbox_relay.shared.envelope import Event

STAMP = "demo-20260101000000-1"
EARLIER = "demo-20251231000000-9"


def letter(event_id: str, customer: str, *, group: str = demo_app.BILLING_GROUP,
           reason: str = "rejected", kind: str = demo_app.INVOICE_ISSUED) -> DeadLetter:
    fields = {b"id": event_id.encode(), b"type": kind.encode(),
              b"data": json.dumps({"customer_id": customer}).encode()}
    return DeadLetter(key=f"{STAMP}:{{invoices:0}}:dead", dead_id="1-1", stream="invoices",
                      partition=0, fields=fields, meta={"reason": reason, "group": group})


def test_only_the_demos_own_and_earlier_deliberate_letters_are_not_failures() -> None:
    late = f"{STAMP}-{demo_billing.LATE_CUSTOMER}"
    mine = f"{STAMP}-invoice-0005:invoice.issued:1"
    on_purpose = frozenset({mine})
    own = letter(mine, late)
    earlier = letter(f"{EARLIER}-invoice-0007:invoice.issued:1",
                     f"{EARLIER}-{demo_billing.LATE_CUSTOMER}")
    failures = [
        letter(mine, late, reason="unknown_type"),  # the right event, dead for another reason
        letter(mine, late, reason="out_of_order"),
        letter(mine, late, group="demo"),  # another group's letter
        letter(mine, late, kind="invoice.voided"),
        letter(f"{STAMP}-invoice-0000:invoice.issued:1", f"{STAMP}-acme"),  # a known customer
        letter(f"{EARLIER}-invoice-0001:invoice.issued:1", f"{EARLIER}-acme"),
        letter("someone-else:invoice.issued:1", "initech"),  # not a demo's customer
    ]
    broken = letter("x:invoice.issued:1", late)
    broken.fields[b"data"] = b"{not json"
    split = demo_billing.split_letters([own, earlier, *failures, broken], on_purpose)
    assert split.mine == [own]
    assert split.earlier == [earlier]
    assert split.other == [*failures, broken]


def test_the_billing_handler_rejects_an_unknown_customer_then_books_the_invoice(
        tmp_path: Path) -> None:
    """The deliberate letters come from PermanentError (``rejected`` at once), not from retries
    that would end at the horizon hours later; once the customer exists, the same event books
    its invoice (what a replay from the console then does)."""
    engine = create_engine(f"sqlite:///{tmp_path}/billing.db")
    demo_app.create_billing_tables(engine)
    event = Event(id="inv-1:invoice.issued:1", source="test", type=demo_app.INVOICE_ISSUED,
                  time=datetime.now(UTC), aggregateid="inv-1",
                  data={"customer_id": "c-late", "amount_cents": 1250})
    handler = demo_app.billing.get(demo_app.INVOICE_ISSUED)
    assert handler is not None
    with engine.begin() as conn, pytest.raises(PermanentError, match="unknown customer 'c-late'"):
        handler(conn, event)
    with engine.begin() as conn:
        conn.execute(insert(demo_app.customers).values(id="c-late", name="Late"))
        handler(conn, event)
    with engine.connect() as conn:
        rows = conn.execute(select(demo_app.invoices)).all()
    assert [tuple(r) for r in rows] == [("inv-1", "c-late", 1250, event.id)]
    engine.dispose()
