"""The demo's billing story: dead letters made on purpose, whose cause is then fixed.

A second group, ``billing``, books ``invoice.issued`` events of the stream ``invoices``
(:data:`cli.demo_app.billing`) and rejects an invoice whose customer it does not know. The demo
issues a few invoices for known customers and some for a customer whose row it adds only once
their letters are dead, so a replay from the console then applies them (issue 26). This module
is the producer's side of that story and the demo's accounting of its letters.

Why it touches both sides: the accounting compares the billing group's receipts (its own
statements) with the letters in Redis, which it reads through
:func:`consumer.dead_letters.list_letters` (it sends no Redis command itself).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import redis
from sqlalchemy import Engine, func, insert, select

from outbox_relay.cli import demo_app
from outbox_relay.consumer import dead_letters
from outbox_relay.consumer.dead_letters import DeadLetter
from outbox_relay.producer.enqueue import Producer
from outbox_relay.shared.redis_conn import translate_redis_errors
from outbox_relay.shared.schema import inbox, outbox
from outbox_relay.shared.settings import CommonSettings

KNOWN_CUSTOMERS = ("acme", "globex")
INVOICES_FOR_KNOWN = 5
"""Invoices for customers billing knows: applied at once, beside the ones dead on purpose."""
LATE_CUSTOMER = "initech"


@dataclass(frozen=True)
class Billing:
    """The invoices the demo issued: how many, and the event ids it dead-letters on purpose."""

    issued: int
    late_customer: str
    on_purpose: frozenset[str]


def late_customer_arrives(engine: Engine, client: redis.Redis, stamp: str, billing: Billing,
                           go_on: Callable[[], bool]) -> None:
    """Wait (while ``go_on()``) until billing settled every invoice and wrote the deliberate
    letters, then add their customer: from now on a replay of those letters applies them.
    Added only after they are dead, or billing would have applied them in the first place."""
    while not billing_settled(engine, client, stamp, billing) and go_on():
        time.sleep(0.1)
    with engine.begin() as conn:
        conn.execute(insert(demo_app.customers).values(
            id=billing.late_customer, name=LATE_CUSTOMER.title()))


def issue_invoices(engine: Engine, settings: CommonSettings, stamp: str, late: int) -> Billing:
    """Billing's known customers, ``INVOICES_FOR_KNOWN`` invoices for them and ``late`` for a
    customer billing does not know yet, each invoice with its ``invoice.issued`` event in one
    transaction (the producer's side of the story). Ids carry the demo's stamp, so a demo
    tells its own rows and events from those of earlier demos in a shared database."""
    producer = Producer(source="outbox-demo", partitions=settings.partitions, key_prefix=stamp)
    late_customer = f"{stamp}-{LATE_CUSTOMER}"
    wanted = [f"{stamp}-{KNOWN_CUSTOMERS[n % len(KNOWN_CUSTOMERS)]}"
              for n in range(INVOICES_FOR_KNOWN)] + [late_customer] * late
    on_purpose = set()
    with engine.begin() as conn:
        conn.execute(insert(demo_app.customers), [
            {"id": f"{stamp}-{name}", "name": name.title()} for name in KNOWN_CUSTOMERS])
        for n, customer in enumerate(wanted):
            event_id = producer.enqueue(
                conn, type=demo_app.INVOICE_ISSUED, stream=demo_app.INVOICES,
                aggregate_type="invoice", aggregate_id=f"{stamp}-invoice-{n:04d}", revision=1,
                data={"customer_id": customer, "amount_cents": 1000 + 250 * n})
            if customer == late_customer:
                on_purpose.add(event_id)
    return Billing(len(wanted), late_customer, frozenset(on_purpose))


def billing_settled(engine: Engine, client: redis.Redis, stamp: str, billing: Billing) -> bool:
    """Every invoice delivered and settled by billing, and the deliberate letters written."""
    with engine.connect() as conn:
        undelivered = conn.execute(select(func.count()).where(
            outbox.c.stream == demo_app.INVOICES, outbox.c.event_id.like(f"{stamp}-%"),
            outbox.c.delivered_at_ms.is_(None))).scalar_one()
        receipts = conn.execute(select(func.count()).where(
            inbox.c.group_name == demo_app.BILLING_GROUP,
            inbox.c.event_id.like(f"{stamp}-%"))).scalar_one()
    if undelivered or receipts < billing.issued:
        return False
    letters = invoice_letters(client, stamp)
    return len(split_letters(letters, billing.on_purpose).mine) >= len(billing.on_purpose)


def invoice_letters(client: redis.Redis, stamp: str) -> list[DeadLetter]:
    with translate_redis_errors():
        return dead_letters.list_letters(client, stamp, stream=demo_app.INVOICES, count=10_000)


@dataclass(frozen=True)
class Split:
    """A demo's invoice letters, by who made them and whether that was meant."""

    mine: list[DeadLetter]  # this demo's deliberate letters
    earlier: list[DeadLetter]  # earlier demos' deliberate letters, never replayed, back again
    other: list[DeadLetter]  # anything else: a failure


def split_letters(letters: Iterable[DeadLetter], on_purpose: frozenset[str]) -> Split:
    """Only the demo's deliberate letters (billing's ``rejected`` letters of the late
    customer's invoices) may be dead in a demo that succeeds: an out-of-order, unknown-type or
    any other letter is a failure it must report.

    One more kind is no failure: an **earlier** demo's deliberate letter. Demos that share a
    database (``OUTBOX_DATABASE_URL``; the default SQLite file is new each time) share the
    outbox, and a relay under the new key prefix finds the earlier demos' delivered rows missing
    from its (new, empty) streams and refills them (repair, as after a Redis that lost data);
    billing's ``dead`` receipt of an invoice nobody replayed then makes a letter of it again."""
    split = Split([], [], [])
    for letter in letters:
        event_id = letter.fields.get(b"id", b"").decode("utf-8", "replace")
        deliberate = (letter.group == demo_app.BILLING_GROUP and letter.reason == "rejected"
                      and letter.fields.get(b"type") == demo_app.INVOICE_ISSUED.encode())
        if deliberate and event_id in on_purpose:
            split.mine.append(letter)
        elif deliberate and _late_customer_of_a_demo(letter):
            split.earlier.append(letter)
        else:
            split.other.append(letter)
    return split


def _late_customer_of_a_demo(letter: DeadLetter) -> bool:
    try:
        data = json.loads(letter.fields.get(b"data", b"null"))
    except ValueError:
        return False
    customer = data.get("customer_id") if isinstance(data, dict) else None
    return (isinstance(customer, str) and customer.startswith("demo-")
            and customer.endswith(f"-{LATE_CUSTOMER}"))


def billing_summary(engine: Engine, client: redis.Redis, stamp: str,
                     billing: Billing | None) -> dict[str, Any]:
    """Billing's counts; its letters and ``dead`` receipts beyond the deliberate ones are
    added to the summary's ``dead``."""
    if billing is None:
        return {"invoices_issued": 0, "invoices_applied": 0, "dead_on_purpose": 0}
    with engine.connect() as conn:
        outcomes = list(conn.execute(select(inbox.c.event_id, inbox.c.outcome).where(
            inbox.c.group_name == demo_app.BILLING_GROUP, inbox.c.event_id.like(f"{stamp}-%"))))
    split = split_letters(invoice_letters(client, stamp), billing.on_purpose)
    stray_receipts = sum(1 for event_id, outcome in outcomes
                         if outcome == "dead" and event_id not in billing.on_purpose)
    return {
        "invoices_issued": billing.issued,
        "invoices_applied": sum(1 for _e, outcome in outcomes if outcome == "applied"),
        "dead_on_purpose": len(split.mine),
        "dead_on_purpose_ids": [letter.letter_id for letter in split.mine],
        "dead_on_purpose_earlier_demos": len(split.earlier),
        "late_customer": billing.late_customer,
        "billing_dead_other": len(split.other) + stray_receipts,
    }
