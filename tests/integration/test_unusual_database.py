"""The whole pipeline in a PostgreSQL database whose defaults are not the test server's.

Production databases differ from a fresh test server: glibc's ``en_US.UTF-8`` collation
(text comparison ignores punctuation first, reproduced here with ICU's ``en-u-ka-shifted``)
and a ``default_transaction_isolation`` of ``serializable`` each broke something of ours once
(tests/integration/test_entry_id_collation.py, test_isolation_level.py). This runs the relay
and a consumer (the test kit's ``drain()``, a real Redis) through a database with both, so a
new statement that depends on either shows up here."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import Connection, select, text

from outbox_relay import Event, Handlers
from outbox_relay.relay import entry_ids, repair_store
from outbox_relay.shared.schema import outbox
from outbox_relay.testing import Outbox
from tests.conftest import PG_ADMIN_URL, REDIS_URL
from tests.helpers import SHIFTED, private_database

pytestmark = pytest.mark.postgresql

AGGREGATES = ("a-1", "a-2", "a-3")
REVISIONS = 40


@pytest.fixture
def unusual_url() -> Iterator[str]:
    """A database with a punctuation-ignoring default collation and serializable default
    isolation, created and dropped here."""
    with private_database(PG_ADMIN_URL, "odd", options=SHIFTED, needs_icu=True,
                          settings={"default_transaction_isolation": "serializable"}) as url:
        yield url


handlers = Handlers()


@handlers.on("step.done")
def record(conn: Connection, event: Event) -> None:
    conn.execute(text("INSERT INTO applied (aggregate_id, revision) VALUES (:a, :r)"),
                 {"a": event.aggregateid, "r": event.revision})


def test_events_are_applied_once_in_order_and_repair_reads_the_right_ids(
    unusual_url: str,
) -> None:
    with Outbox(handlers, partitions=2, database_url=unusual_url, redis_url=REDIS_URL) as kit:
        with kit.engine.begin() as conn:
            conn.execute(text("CREATE TABLE applied (n BIGSERIAL PRIMARY KEY, "
                              "aggregate_id TEXT NOT NULL, revision BIGINT NOT NULL)"))
        for revision in range(1, REVISIONS + 1):  # seqs cross the 9 → 10 and 99 → 100 digits
            with kit.engine.begin() as conn:
                for aggregate in AGGREGATES:
                    kit.enqueue(conn, type="step.done", stream="steps",
                                aggregate_type="job", aggregate_id=aggregate,
                                revision=revision, data={"r": revision})

        report = kit.drain()

        assert report.applied == len(AGGREGATES) * REVISIONS and report.dead == 0
        with kit.engine.connect() as conn:
            rows = conn.execute(text("SELECT aggregate_id, revision FROM applied ORDER BY n"))
            seen: dict[str, list[int]] = {}
            for aggregate, revision in rows:
                seen.setdefault(aggregate, []).append(revision)
            delivered = conn.execute(select(outbox.c.partition, outbox.c.entry_id)).all()
        assert seen == {a: list(range(1, REVISIONS + 1)) for a in AGGREGATES}  # once, in order
        assert {r.outcome for r in kit.receipts()} == {"applied"}
        assert kit.dead_letters() == []
        assert kit.drain().applied == 0
        for partition in {p for p, _ in delivered}:
            ids = [e for p, e in delivered if p == partition]
            assert repair_store.newest_delivered_id(kit.engine, "steps", partition) == max(
                ids, key=entry_ids.parse)
