"""How many statements a claim sends: on PostgreSQL the receipts, heads, trim floors and retry
rows a batch is decided from come back in one statement, after the advisory locks."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import Engine, event, select

from outbox_relay.consumer import claim_writes, inbox
from outbox_relay.consumer.handlers import Handlers
from outbox_relay.shared import keys
from outbox_relay.shared.db import is_postgres
from outbox_relay.shared.schema import inbox_heads, stream_trims
from tests.helpers import event as make_event

pytestmark = pytest.mark.integration


def statements_of(engine: Engine) -> list[str]:
    seen: list[str] = []

    def on_execute(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        seen.append(" ".join(statement.split())[:60])

    event.listen(engine, "before_cursor_execute", on_execute)
    return seen


def test_a_claim_reads_receipts_heads_and_floors_in_one_statement_on_postgresql(
    engine: Engine,
) -> None:
    key = keys.stream_key("claimtest", "runs", 1)
    with engine.begin() as conn:  # entries below 5-0 were trimmed on purpose
        conn.execute(stream_trims.insert().values(stream="runs", partition=1,
                                                  floor_entry_id="5-0", updated_at_ms=0))
    handlers = Handlers()
    handlers.register("*", lambda _conn, _ev: None)
    first = [inbox.Delivery(key, f"10-{i}", make_event(f"a{i % 3}", i // 3 + 1), 1)
             for i in range(6)]
    inbox.claim(engine, "g", first, handlers)
    sent = statements_of(engine)

    again = [*first[:2], inbox.Delivery(key, "1-0", make_event("a9", 1), 1),
             inbox.Delivery(key, "11-0", make_event("a5", 1), 1),
             inbox.Delivery(key, "11-1", make_event("a0", 1, type="other.thing"), 1)]
    outcomes = inbox.claim(engine, "g", again, handlers)

    by_id = {o.delivery.event.id: o.outcome for o in outcomes}
    assert by_id[first[0].event.id] == by_id[first[1].event.id] == inbox.DUPLICATE
    assert by_id[again[2].event.id] == inbox.RESURRECTED  # below the floor, no receipt
    assert by_id[again[3].event.id] == inbox.APPLIED
    assert by_id[again[4].event.id] != inbox.APPLIED  # a0's head is at revision 2
    reads = [s for s in sent if s.startswith(("SELECT", "WITH"))]
    if is_postgres(engine):
        assert reads[0].startswith("SELECT pg_advisory_xact_lock")
        assert len(reads) == 2  # the locks, then receipts + heads + floors + retries in one
    else:
        assert len(reads) == 4  # receipts, floors, heads, retries


def test_the_heads_upsert_raises_a_head_and_never_lowers_it(engine: Engine) -> None:
    # Both dialects send a statement compiled once (SQLAlchemy cannot cache an ON CONFLICT …
    # WHERE upsert); its WHERE is what keeps a late, lower revision from moving a head back.
    def heads() -> dict[str, int]:
        with engine.connect() as conn:
            rows = conn.execute(select(inbox_heads.c.aggregate_id, inbox_heads.c.revision)
                                .where(inbox_heads.c.group_name == "g"))
            return {r.aggregate_id: r.revision for r in rows}

    for given, expected in [({"a": 5, "b": 1}, {"a": 5, "b": 1}),
                            ({"a": 3, "b": 2}, {"a": 5, "b": 2}),
                            ({"a": 7}, {"a": 7, "b": 2})]:
        with engine.begin() as conn:
            claim_writes._upsert_heads(conn, "g", {("t", i): r for i, r in given.items()})
        assert heads() == expected
