"""How many statements a claim sends: on PostgreSQL the receipts, heads, trim floors and retry
rows a batch is decided from come back in one statement, after the advisory locks."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import Column, Connection, Engine, MetaData, String, Table, event, select

from outbox_relay.consumer import claim_writes, inbox
from outbox_relay.consumer.handlers import Handlers
from outbox_relay.shared import keys, psycopg_driver
from outbox_relay.shared.db import is_postgres
from outbox_relay.shared.envelope import Event
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


_effects = Table("claim_statement_effects", MetaData(), Column("event_id", String(64),
                                                                 primary_key=True))


def _effect_or_fail(conn: Connection, ev: Event) -> None:
    """Write one effect row; the aggregate ``bad`` fails after writing its row."""
    conn.execute(_effects.insert().values(event_id=ev.id))
    if ev.aggregateid == "bad":
        raise RuntimeError("the downstream said no")


@pytest.mark.parametrize("size", [1, 3])
def test_a_claim_sends_no_savepoint_unless_a_handler_raises(engine: Engine, size: int) -> None:
    """Everything before the handlers only reads, so the optimistic path runs them with no
    savepoint; when one raises, the whole transaction rolls back and the batch is claimed
    again in a new one, with a savepoint per handler (the raising one not run again)."""
    _effects.create(engine, checkfirst=True)
    key = keys.stream_key("claimtest", "runs", 1)
    handlers = Handlers()
    handlers.register("*", _effect_or_fail)
    good = [inbox.Delivery(key, f"20-{i}", make_event(f"g{i}", 1), 1) for i in range(size)]
    sent = statements_of(engine)
    assert [o.outcome for o in inbox.claim(engine, f"s{size}", good, handlers)] == (
        [inbox.APPLIED] * size)
    assert not [s for s in sent if "SAVEPOINT" in s.upper()]
    assert sum(s.startswith("INSERT INTO claim_statement_effects") for s in sent) == size

    sent.clear()
    bad = [*[inbox.Delivery(key, f"21-{i}", make_event(f"h{i}", 1), 1) for i in range(1, size)],
           inbox.Delivery(key, "21-0", make_event("bad", 1), 1)]
    outcomes = inbox.claim(engine, f"s{size}", bad, handlers)
    assert [o.outcome for o in outcomes] == [inbox.APPLIED] * (size - 1) + [inbox.FAILED]
    effects = [s for s in sent if s.startswith("INSERT INTO claim_statement_effects")]
    assert len(effects) == size + (size - 1)  # every handler once, then all but the bad one
    assert sum(s.upper().startswith("SAVEPOINT") for s in sent) == size - 1
    lookups = [s for s in sent if s.startswith(("SELECT", "WITH"))]
    assert lookups[:len(lookups) // 2] == lookups[len(lookups) // 2:]  # read again
    with engine.connect() as conn:
        written = set(conn.execute(select(_effects.c.event_id)).scalars())
    assert written == {d.event.id for d in good} | {d.event.id for d in bad[:-1]}


def test_a_claims_writes_go_in_the_handlers_pipeline_on_postgresql(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On PostgreSQL (libpq with pipeline mode) the receipts and heads are sent while the
    handlers' pipeline is open and nothing waits for them (no sync until the pipeline's end),
    so they and its end are one round trip; elsewhere they are plain statements."""
    syncs: list[str] = []
    pg = psycopg_driver.module()
    if pg is not None:
        real_sync = pg.Pipeline.sync

        def sync(pipeline: Any) -> None:
            syncs.append("sync")
            real_sync(pipeline)

        monkeypatch.setattr(pg.Pipeline, "sync", sync)
    _effects.create(engine, checkfirst=True)
    key = keys.stream_key("claimtest", "runs", 2)
    handlers = Handlers()
    handlers.register("*", _effect_or_fail)
    modes: dict[str, bool] = {}

    def on_execute(conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        raw = conn.connection.driver_connection
        pgconn = getattr(raw, "pgconn", None)
        modes[" ".join(statement.split())[:30]] = bool(pgconn and pgconn.pipeline_status)

    event.listen(engine, "before_cursor_execute", on_execute)
    batch = [inbox.Delivery(key, f"30-{i}", make_event(f"p{i}", 1), 1) for i in range(3)]
    assert {o.outcome for o in inbox.claim(engine, "pipe", batch, handlers)} == {inbox.APPLIED}
    writes = {k: v for k, v in modes.items() if k.startswith(
        ("INSERT INTO outbox_inbox ", "INSERT INTO outbox_inbox_heads"))}
    assert len(writes) == 2
    expected = is_postgres(engine) and pg is not None and bool(pg.Pipeline.is_supported())
    assert syncs == []  # the pipeline's end is psycopg's own exit, not a sync before it
    assert set(writes.values()) == {expected}
    effects = [v for k, v in modes.items() if k.startswith("INSERT INTO claim_statement")]
    assert effects == [expected]


def test_every_column_of_a_batchs_receipts_is_written_as_decided(engine: Engine) -> None:
    """One claim's receipts, whatever the outcome: applied, superseded (a latest event behind
    its head), dead (an unknown type, its reason); an event without aggregate or revision
    (NULLs), text with quotes, backslashes and non-ASCII; each with its own entry, stream,
    fingerprint and the claim's time."""
    from outbox_relay.shared.envelope import fingerprint
    from outbox_relay.shared.schema import inbox as inbox_table

    handlers = Handlers()
    handlers.register("thing.happened", lambda _c, _e: None, ordering="latest")
    plain = Event(id='e"\\ü-1', source="tests", type="thing.happened",
                  time=make_event("x", 1).time, data={"a": "ö"})
    batch = [
        inbox.Delivery("s:0", "5-0", make_event("agg-ü", 3), 1),
        inbox.Delivery("s:0", "5-1", make_event("agg-ü", 2), 1),  # behind: superseded
        inbox.Delivery("s:1", "6-0", make_event("other", 1, type="nobody.handles"), 1),
        inbox.Delivery("s:1", "6-1", plain, 1),
    ]
    outcomes = inbox.claim(engine, "g", batch, handlers, now=1_700_000_000_123)
    assert [o.outcome for o in outcomes] == [
        inbox.APPLIED, inbox.SUPERSEDED, inbox.DEAD, inbox.APPLIED]
    with engine.connect() as conn:
        rows = {r.event_id: r for r in conn.execute(select(inbox_table))}
    want = {
        d.event.id: (d.event.type, d.event.aggregatetype, d.event.aggregateid,
                     d.event.revision, d.key, d.entry_id, outcome, reason,
                     fingerprint(d.event), 1_700_000_000_123)
        for d, outcome, reason in zip(batch, [inbox.APPLIED, inbox.SUPERSEDED, inbox.DEAD,
                                              inbox.APPLIED],
                                      [None, None, "unknown_type", None], strict=True)
    }
    got = {i: (r.event_type, r.aggregate_type, r.aggregate_id, r.revision, r.stream_key,
               r.entry_id, r.outcome, r.reason, r.fingerprint, r.created_at_ms)
           for i, r in rows.items()}
    assert got == want
    assert {r.group_name for r in rows.values()} == {"g"}
