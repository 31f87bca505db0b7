"""The torture's verdict (:mod:`torture.check`) on hand-made data: each rule can fail.

A SQLite file holds the outbox rows, receipts and effect rows, with the torture's ledger
triggers installed (:mod:`torture.ledger`) so that pruning a row by hand is seen as the daemons'
pruning is; fakeredis holds the stream. A clean world passes; each test then breaks exactly one
promise (or prunes/trims something on purpose) and expects its counters. The last test runs the
ledger's triggers on both databases.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import fakeredis
import pytest
from sqlalchemy import Engine, select, update

from outbox_relay.shared import db, keys
from outbox_relay.shared.db import now_ms
from outbox_relay.shared.schema import inbox, inbox_heads, outbox, stream_trims
from torture import app, check, ledger, order

PREFIX = "tc"
GROUP = "torture"
KEY = keys.stream_key(PREFIX, "events", 0)

# (event id, type, aggregate type, aggregate id, revision) in commit order.
EVENTS = [
    ("item-1:item.changed:1", "item.changed", "item", "item-1", 1),
    ("item-1:item.noted:1", "item.noted", "item", "item-1", 1),
    ("touch-1:item.touched:1", "item.touched", "touch", "touch-1", 1),
    ("item-1:item.changed:2", "item.changed", "item", "item-1", 2),
    ("touch-1:item.touched:2", "item.touched", "touch", "touch-1", 2),
    ("evt-1", "torture.event", None, None, None),
]
C1, N1, T1, C2, T2, PLAIN = (e[0] for e in EVENTS)
ORDER = [e[0] for e in EVENTS]


@dataclass
class World:
    """The database and the stream the checker reads, written by hand. Each event is marked
    delivered under the entry id ``<100 + i>-<i + 1>``, ``i`` its place in the stream order."""

    engine: Engine
    client: Any
    events: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    entry_ids: dict[str, str] = field(default_factory=dict)
    streams: dict[str, str] = field(default_factory=dict)  # event id: its stream key

    def event(self, event_id: str, type_: str, agg_type: str | None, agg_id: str | None,
              revision: int | None, *, entry_id: str | None = None,
              delivered_at_ms: int = 2, stream: str = "events") -> None:
        """Enqueue the event, then (with ``entry_id``) mark it delivered under that id."""
        self.events[event_id] = (event_id, type_, agg_type, agg_id, revision)
        self.streams[event_id] = keys.stream_key(PREFIX, stream, 0)
        with self.engine.begin() as conn:
            conn.execute(outbox.insert().values(
                event_id=event_id, stream=stream, partition=0, type=type_,
                aggregate_type=agg_type, aggregate_id=agg_id, revision=revision,
                source="test", payload="null", headers="{}", created_at_ms=1,
                available_at_ms=1,
            ))
        if entry_id is not None:
            self.mark(event_id, entry_id, delivered_at_ms)

    def mark(self, event_id: str, entry_id: str, delivered_at_ms: int = 2) -> None:
        self.entry_ids[event_id] = entry_id
        with self.engine.begin() as conn:
            conn.execute(update(outbox).where(outbox.c.event_id == event_id).values(
                entry_id=entry_id, delivered_at_ms=delivered_at_ms))

    def entry(self, event_id: str, entry_id: str | None = None) -> None:
        """XADD the event under its marked entry id (or ``entry_id``: a stray copy)."""
        _, type_, agg_type, agg_id, revision = self.events[event_id]
        fields = {"id": event_id, "type": type_}
        if agg_id is not None:
            fields |= {"aggregatetype": agg_type, "aggregateid": agg_id,
                       "revision": str(revision)}
        self.client.xadd(self.streams[event_id], fields,
                         id=entry_id or self.entry_ids[event_id])

    def receipt(self, event_id: str, outcome: str = "applied", reason: str | None = None,
                group: str = GROUP, entry_id: str | None = None, created_at_ms: int = 1,
                ) -> None:
        _, type_, agg_type, agg_id, revision = self.events[event_id]
        with self.engine.begin() as conn:
            conn.execute(inbox.insert().values(
                group_name=group, event_id=event_id, event_type=type_,
                aggregate_type=agg_type, aggregate_id=agg_id, revision=revision,
                stream_key=self.streams[event_id],
                entry_id=entry_id or self.entry_ids.get(event_id, "1-1"),
                outcome=outcome, reason=reason, created_at_ms=created_at_ms,
            ))

    def effect(self, event_id: str, group: str = GROUP) -> None:
        """One applied effect; call order is apply order (``seq``)."""
        _, type_, agg_type, agg_id, revision = self.events[event_id]
        with self.engine.begin() as conn:
            conn.execute(app.effects.insert().values(
                event_id=event_id, group_name=group, event_type=type_,
                aggregate_type=agg_type, aggregate_id=agg_id, revision=revision, pid=1,
                created_at_ms=1,
            ))

    def apply(self, event_id: str) -> None:
        self.receipt(event_id)
        self.effect(event_id)

    def floor(self, entry_id: str) -> None:
        """Record the trim floor of the stream (as the relay does after an XTRIM)."""
        with self.engine.begin() as conn:
            conn.execute(stream_trims.insert().values(
                stream="events", partition=0, floor_entry_id=entry_id, trimmed=0,
                updated_at_ms=1))

    def prune_row(self, event_id: str) -> None:
        with self.engine.begin() as conn:
            conn.execute(outbox.delete().where(outbox.c.event_id == event_id))

    def prune_receipt(self, event_id: str, group: str = GROUP) -> None:
        with self.engine.begin() as conn:
            conn.execute(inbox.delete().where(inbox.c.group_name == group,
                                              inbox.c.event_id == event_id))

    def verify(self, retention: check.Retention | None = None) -> check.Verdict:
        return check.verify(self.engine, self.client, PREFIX, [GROUP], check_runs=False,
                            retention=retention)


def build(tmp_path: Path, order: Sequence[str] = ORDER) -> World:
    """A world holding :data:`EVENTS`, committed in their order, marked delivered under entry
    ids that follow ``order`` (the stream order)."""
    engine = db.make_engine(f"sqlite:///{tmp_path}/check.db")
    db.upgrade(engine)
    app.create_tables(engine)
    ledger.install(engine)
    w = World(engine, fakeredis.FakeRedis())
    for event in EVENTS:
        i = list(order).index(event[0])
        w.event(*event, entry_id=f"{100 + i}-{i + 1}")
    return w


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    w = build(tmp_path)
    yield w
    w.engine.dispose()


def all_in_stream(w: World) -> None:
    for event_id in sorted(w.entry_ids, key=lambda e: order.entry_key(w.entry_ids[e])):
        w.entry(event_id)


def broken(v: check.Verdict) -> dict[str, int]:
    """The violated counters and their values."""
    return {name: getattr(v, name) for name in v.violations(runs_must_finish=False)}


def test_a_clean_world_passes(world: World) -> None:
    all_in_stream(world)
    for event_id, *_ in EVENTS:
        world.apply(event_id)
    v = world.verify()
    assert broken(v) == {}
    assert v.events == len(EVENTS)
    assert v.superseded_latest == 0


def test_equal_revisions_apply_in_either_order(world: World) -> None:
    all_in_stream(world)
    for event_id in (N1, C1, T1, C2, T2, PLAIN):
        world.apply(event_id)
    assert broken(world.verify()) == {}


def test_a_stream_holding_a_later_revision_first_is_a_violation(tmp_path: Path) -> None:
    world = build(tmp_path, order=(C2, C1, N1, T1, T2, PLAIN))  # revision 2 above 1
    all_in_stream(world)
    for event_id, *_ in EVENTS:
        world.apply(event_id)
    assert broken(world.verify()) == {"stream_order_violations": 2}
    world.engine.dispose()


def test_a_strict_event_applied_after_a_higher_revision_is_an_order_violation(
    world: World,
) -> None:
    all_in_stream(world)
    for event_id in (C2, C1, N1, T1, T2, PLAIN):
        world.apply(event_id)
    assert broken(world.verify()) == {"order_violations": 2}


def test_a_same_revision_event_applied_after_the_next_revision_is_a_violation(
    world: World,
) -> None:
    all_in_stream(world)
    for event_id in (C1, C2, N1, T1, T2, PLAIN):
        world.apply(event_id)
    assert broken(world.verify()) == {"order_violations": 1}


def test_a_strict_event_never_applied_under_an_applied_revision_is_a_violation(
    world: World,
) -> None:
    all_in_stream(world)
    for event_id in (C1, T1, C2, T2, PLAIN):  # item.noted@1 never applied
        world.apply(event_id)
    assert broken(world.verify()) == {"order_violations": 1, "missing_receipts": 1}


def test_latest_types_are_not_held_to_apply_order(world: World) -> None:
    all_in_stream(world)
    for event_id in (C1, N1, T2, T1, C2, PLAIN):
        world.apply(event_id)
    assert broken(world.verify()) == {}


def test_an_out_of_order_letter_is_counted_and_skips_its_event(world: World) -> None:
    all_in_stream(world)
    for event_id in (N1, C2, T1, T2, PLAIN):
        world.apply(event_id)
    world.receipt(C1, "dead", "out_of_order")
    verdict = world.verify()
    assert broken(verdict) == {
        "out_of_order": 1, "skipped": 1, "not_applied": 1, "order_violations": 1,
    }
    [example] = verdict.examples["out_of_order"]  # what a run's report keeps to trace it
    assert example.startswith(f"{GROUP}/{C1}: ") and "revision" in example


def test_a_stale_receipt_is_no_longer_accepted(world: World) -> None:
    all_in_stream(world)
    for event_id in (N1, C2, T2, PLAIN):
        world.apply(event_id)
    world.receipt(C1, "stale")  # a newer revision was applied: the old rule let this pass
    world.receipt(T1, "stale")
    v = world.verify()
    assert broken(v) == {"skipped": 1, "not_applied": 2, "order_violations": 1}
    assert v.superseded_latest == 0


def test_superseded_is_accepted_for_a_latest_type_under_a_newer_applied_revision(
    world: World,
) -> None:
    all_in_stream(world)
    for event_id in (C1, N1, C2, T2, PLAIN):
        world.apply(event_id)
    world.receipt(T1, "superseded")
    v = world.verify()
    assert broken(v) == {}
    assert v.superseded_latest == 1


def test_superseded_without_a_newer_applied_revision_is_a_violation(world: World) -> None:
    all_in_stream(world)
    for event_id in (C1, N1, T1, C2, PLAIN):
        world.apply(event_id)
    world.receipt(T2, "superseded")  # the newest revision itself: nothing newer applied
    v = world.verify()
    assert broken(v) == {"not_applied": 1}
    assert v.superseded_latest == 0


def test_superseded_for_a_strict_type_is_a_skip(world: World) -> None:
    all_in_stream(world)
    for event_id in (N1, T1, C2, T2, PLAIN):
        world.apply(event_id)
    world.receipt(C1, "superseded")
    v = world.verify()
    assert broken(v) == {"skipped": 1, "not_applied": 1, "order_violations": 1}
    assert v.superseded_latest == 0


def test_superseded_counts_only_a_newer_revision_applied_by_the_same_group() -> None:
    def row(group: str, event_id: str, outcome: str, revision: int) -> SimpleNamespace:
        return SimpleNamespace(group_name=group, event_id=event_id, outcome=outcome,
                               aggregate_type="touch", aggregate_id="touch-1",
                               revision=revision)

    types = {T1: "item.touched", T2: "item.touched"}
    receipts = [row("a", T1, "superseded", 1), row("b", T2, "applied", 2)]
    assert order.superseded_latest(receipts, types, app.is_strict) == set()
    receipts.append(row("a", T2, "applied", 2))
    assert order.superseded_latest(receipts, types, app.is_strict) == {("a", T1)}


def test_lost_and_duplicate_entries(world: World) -> None:
    for event_id in (C1, N1, T1, C2, T2):  # evt-1 missing
        world.entry(event_id)
    world.entry(C2, "200-4")  # revision 2 twice: a copy the relay never marked
    for event_id, *_ in EVENTS:
        world.apply(event_id)
    assert broken(world.verify()) == {"lost": 1, "duplicate_entries": 1}


def test_duplicate_and_missing_effects(world: World) -> None:
    all_in_stream(world)
    for event_id in (C1, N1, T1, C2, PLAIN):
        world.apply(event_id)
    world.receipt(T2)  # applied, but its effect never committed
    world.effect(PLAIN)
    world.receipt(C1, group="other")  # another group's receipt is not judged here
    assert broken(world.verify()) == {"duplicate_effects": 1, "missing_effects": 1}


def test_pending_entries_are_a_violation(world: World) -> None:
    all_in_stream(world)
    for event_id, *_ in EVENTS:
        world.apply(event_id)
    world.client.xgroup_create(KEY, GROUP, id="0")
    world.client.xreadgroup(GROUP, "c0", {KEY: ">"}, count=2)
    assert broken(world.verify()) == {"pending": 2}


# -- retention: what may be missing, and only under its condition -------------------------------

FLOOR_ABOVE_T1 = "103-0"  # C1, N1, T1 (entries 100-1, 101-2, 102-3) are below it


def applied_everything(w: World) -> None:
    for event_id, *_ in EVENTS:
        w.apply(event_id)


def test_delivered_rows_pruned_after_their_retention_are_accepted(world: World) -> None:
    all_in_stream(world)
    applied_everything(world)
    world.prune_row(C1)
    world.prune_row(PLAIN)
    v = world.verify(check.Retention(delivered_s=20))  # delivered at 2 ms: long ago
    assert broken(v) == {}
    assert (v.events, v.rows_pruned) == (len(EVENTS), 2)


def test_a_missing_undelivered_row_is_a_violation(world: World) -> None:
    all_in_stream(world)
    applied_everything(world)
    world.event("evt-2", "torture.event", None, None, None)  # never delivered
    world.prune_row("evt-2")
    v = world.verify()
    assert broken(v) == {"rows_missing": 1, "undelivered": 1, "lost": 1, "missing_receipts": 1}
    assert v.rows_pruned == 0


def test_a_row_pruned_before_its_retention_is_a_violation(world: World) -> None:
    all_in_stream(world)
    applied_everything(world)
    world.event("evt-2", "torture.event", None, None, None, entry_id="200-7",
                delivered_at_ms=now_ms())
    world.entry("evt-2")
    world.apply("evt-2")
    world.prune_row("evt-2")
    assert broken(world.verify()) == {}
    assert broken(world.verify(check.Retention(delivered_s=20))) == {"rows_missing": 1}


def test_an_event_id_enqueued_again_after_its_row_was_pruned_is_a_violation(
    world: World,
) -> None:
    all_in_stream(world)
    applied_everything(world)
    world.prune_row(PLAIN)
    world.event(*EVENTS[-1])  # the same id, enqueued again
    assert broken(world.verify()) == {"rows_reused": 1}


def test_entries_below_the_floor_settled_by_every_group_are_trimmed(world: World) -> None:
    world.floor(FLOOR_ABOVE_T1)
    for event_id in (C2, T2, PLAIN):  # C1, N1, T1 were trimmed
        world.entry(event_id)
    for event_id in (C1, N1, C2, T2, PLAIN):
        world.apply(event_id)
    world.receipt(T1, "superseded")  # settled without an effect: a latest type
    v = world.verify()
    assert broken(v) == {}
    assert (v.entries_trimmed, v.entries_readable, v.superseded_latest) == (3, 3, 1)


def test_a_missing_entry_above_the_floor_is_lost(world: World) -> None:
    world.floor(FLOOR_ABOVE_T1)
    for event_id in (T2, PLAIN):  # C2 (103-4) is at or above the floor, and missing
        world.entry(event_id)
    applied_everything(world)
    v = world.verify()
    assert broken(v) == {"lost": 1}
    assert (v.entries_trimmed, v.trimmed_unsettled) == (3, 0)


def test_a_missing_entry_without_any_floor_is_lost(world: World) -> None:
    for event_id in (N1, T1, C2, T2, PLAIN):
        world.entry(event_id)
    applied_everything(world)
    assert broken(world.verify()) == {"lost": 1}


def test_an_entry_below_the_floor_the_group_never_settled_is_lost(world: World) -> None:
    world.floor(FLOOR_ABOVE_T1)
    for event_id in (C2, T2, PLAIN):
        world.entry(event_id)
    for event_id in (C1, N1, C2, T2, PLAIN):  # T1 trimmed, never received
        world.apply(event_id)
    v = world.verify()
    assert broken(v) == {"lost": 1, "missing_receipts": 1}
    assert (v.entries_trimmed, v.trimmed_unsettled) == (2, 1)


def test_an_entry_below_the_floor_applied_without_its_effect_is_lost(world: World) -> None:
    world.floor(FLOOR_ABOVE_T1)
    for event_id in (C2, T2, PLAIN):
        world.entry(event_id)
    for event_id in (C1, N1, C2, T2, PLAIN):
        world.apply(event_id)
    world.receipt(T1)  # "applied", but no effect row: not settled
    v = world.verify()
    assert broken(v) == {"lost": 1, "missing_effects": 1}
    assert v.trimmed_unsettled == 1


def test_order_is_judged_on_trimmed_entries_too(tmp_path: Path) -> None:
    world = build(tmp_path, order=(C2, C1, N1, T1, T2, PLAIN))
    world.floor("200-0")  # everything trimmed: the stream holds nothing
    applied_everything(world)
    v = world.verify()
    assert broken(v) == {"stream_order_violations": 2}
    assert (v.entries_readable, v.entries_trimmed) == (0, len(EVENTS))
    world.engine.dispose()


def test_a_receipt_pruned_below_the_floor_with_its_effect_is_accepted(world: World) -> None:
    world.floor(FLOOR_ABOVE_T1)
    for event_id in (C2, T2, PLAIN):
        world.entry(event_id)
    applied_everything(world)
    world.prune_receipt(C1)
    world.prune_receipt(T1)
    v = world.verify(check.Retention(inbox_s=30))  # created at 1 ms: long ago
    assert broken(v) == {}
    assert v.receipts_pruned == 2


def test_a_receipt_pruned_at_or_above_the_floor_is_a_violation(world: World) -> None:
    world.floor(FLOOR_ABOVE_T1)
    for event_id in (C2, T2, PLAIN):
        world.entry(event_id)
    applied_everything(world)
    world.prune_receipt(C2)  # 103-4: not below the floor 103-0
    v = world.verify()
    assert broken(v) == {"receipts_pruned_wrongly": 1}
    assert v.receipts_pruned == 0


def test_a_receipt_pruned_without_a_trim_floor_is_a_violation(world: World) -> None:
    all_in_stream(world)
    applied_everything(world)
    world.prune_receipt(C1)
    assert broken(world.verify()) == {"receipts_pruned_wrongly": 1}


def test_a_receipt_pruned_without_its_effect_is_a_violation(world: World) -> None:
    world.floor(FLOOR_ABOVE_T1)
    for event_id in (C2, T2, PLAIN):
        world.entry(event_id)
    for event_id in (N1, T1, C2, T2, PLAIN):
        world.apply(event_id)
    world.receipt(C1)  # applied, effect never written
    world.prune_receipt(C1)
    assert broken(world.verify()) == {
        "receipts_pruned_wrongly": 1, "missing_effects": 1, "lost": 1, "order_violations": 1,
    }


def test_a_receipt_pruned_before_its_retention_is_a_violation(world: World) -> None:
    world.floor(FLOOR_ABOVE_T1)
    for event_id in (C2, T2, PLAIN):
        world.entry(event_id)
    world.receipt(C1, created_at_ms=now_ms())
    world.effect(C1)
    for event_id in (N1, T1, C2, T2, PLAIN):
        world.apply(event_id)
    world.prune_receipt(C1)
    assert broken(world.verify()) == {}
    assert broken(world.verify(check.Retention(inbox_s=30))) == {"receipts_pruned_wrongly": 1}


def test_a_receipt_written_again_after_pruning_is_a_violation(world: World) -> None:
    world.floor(FLOOR_ABOVE_T1)
    for event_id in (C2, T2, PLAIN):
        world.entry(event_id)
    applied_everything(world)
    world.prune_receipt(T1)
    world.receipt(T1)  # the event came back and was received again
    assert broken(world.verify()) == {"receipts_recreated": 1}


def test_a_receipt_from_an_entry_the_relay_never_marked_is_foreign(world: World) -> None:
    all_in_stream(world)
    for event_id in (C1, N1, T1, C2, PLAIN):
        world.apply(event_id)
    world.receipt(T2, entry_id="99-5")  # a stray copy, received first
    world.effect(T2)
    assert broken(world.verify()) == {"foreign_receipts": 1}


def test_a_lost_receipt_is_a_violation(world: World) -> None:
    all_in_stream(world)
    for event_id in (C1, N1, C2, T2, PLAIN):
        world.apply(event_id)
    world.receipt(T1, "lost", "trimmed_while_pending")
    assert broken(world.verify()) == {"lost_receipts": 1, "not_applied": 1}


def test_a_row_marked_again_under_another_id_is_a_violation(world: World) -> None:
    all_in_stream(world)
    applied_everything(world)
    with world.engine.begin() as conn:
        conn.execute(update(outbox).where(outbox.c.event_id == PLAIN).values(entry_id="300-6"))
    # The stream holds the old id: a copy the ledger no longer knows (the event is not lost:
    # it was read from there); the receipt names it.
    assert broken(world.verify()) == {
        "remarked": 1, "duplicate_entries": 1, "foreign_receipts": 1,
    }


def test_redeliveries_are_reported_not_judged(world: World) -> None:
    all_in_stream(world)
    applied_everything(world)
    with world.engine.begin() as conn:
        conn.execute(update(inbox).where(inbox.c.event_id == C1)
                     .values(duplicates=inbox.c.duplicates + 2))
    v = world.verify()
    assert broken(v) == {}
    assert v.redeliveries == 2


def test_the_ledger_triggers_record_every_change(engine: Engine) -> None:
    """On both databases: enqueue, mark, prune a row; receive, count a duplicate, prune a
    receipt (stamping the floor); prune a head."""
    app.create_tables(engine)
    ledger.install(engine)
    ledger.install(engine)  # idempotent
    with engine.begin() as conn:
        conn.execute(outbox.insert().values(
            event_id="e1", stream="events", partition=2, type="t", source="s",
            payload="null", headers="{}", created_at_ms=1, available_at_ms=1))
        conn.execute(update(outbox).values(attempts=1))  # not a delivery: not a mark
        conn.execute(update(outbox).values(entry_id="500-1", delivered_at_ms=7))
        conn.execute(stream_trims.insert().values(
            stream="events", partition=2, floor_entry_id="600-0", trimmed=1, updated_at_ms=1))
        conn.execute(inbox.insert().values(
            group_name="g", event_id="e1", stream_key="k", entry_id="500-1",
            outcome="applied", created_at_ms=3))
        conn.execute(update(inbox).values(duplicates=inbox.c.duplicates + 1))
        conn.execute(inbox_heads.insert().values(
            group_name="g", aggregate_type="a", aggregate_id="b", revision=4, updated_at_ms=1))
    before = now_ms()
    with engine.begin() as conn:
        conn.execute(inbox.delete())
        conn.execute(outbox.delete())
        conn.execute(inbox_heads.delete())
    with engine.connect() as conn:
        event = conn.execute(select(ledger.events)).one()
        receipt = conn.execute(select(ledger.receipts)).one()
        head = conn.execute(select(ledger.pruned_heads)).one()
    assert (event.event_id, event.stream, event.partition, event.enqueued, event.marks,
            event.entry_id, event.delivered_at_ms) == ("e1", "events", 2, 1, 1, "500-1", 7)
    assert (receipt.entry_id, receipt.outcome, receipt.duplicates, receipt.inserts,
            receipt.floor_at_prune) == ("500-1", "applied", 1, 1, "600-0")
    assert (head.aggregate_id, head.revision) == ("b", 4)
    for stamped in (event.pruned_at_ms, receipt.pruned_at_ms, head.pruned_at_ms):
        assert before - 1000 <= stamped <= now_ms() + 1000  # the database's clock
    sizes = ledger.sizes(engine)
    assert (sizes["outbox_rows_pruned"], sizes["receipts_pruned"], sizes["heads_pruned"],
            sizes["trimmed_recorded"]) == (1, 1, 1, 1)


# -- the chained hop (torture/chain.py) -----------------------------------------------------------

CHAIN = app.CHAIN_GROUP
SOURCE = next(f"item-1:item.changed:{r}" for r in range(3, 500)
              if app.chains("item.changed", f"item-1:item.changed:{r}"))
SOURCE_REVISION = int(SOURCE.rsplit(":", 1)[1])
CHAINED = app.chained_id(SOURCE)


def chained_world(w: World, *, enqueue_chained: bool = True, revision: int = SOURCE_REVISION,
                  ) -> None:
    """The clean world plus a source event (applied by the torture group) and, unless told
    otherwise, its chained event on the chained stream, applied by the chain group."""
    w.event(SOURCE, "item.changed", "item", "item-1", SOURCE_REVISION, entry_id="200-1")
    if enqueue_chained:
        w.event(CHAINED, app.CHAIN_TYPE, "item", "item-1", revision, entry_id="300-1",
                stream=app.CHAIN_STREAM)
    all_in_stream(w)
    for event_id, *_ in EVENTS:
        w.apply(event_id)
    w.apply(SOURCE)


def verify_chain(w: World) -> check.Verdict:
    return check.verify(w.engine, w.client, PREFIX, [GROUP, CHAIN], check_runs=False,
                        reads={GROUP: frozenset({"events"}),
                               CHAIN: frozenset({app.CHAIN_STREAM})},
                        chain=(GROUP, CHAIN))


def test_only_some_item_changes_are_chain_sources() -> None:
    ids = [f"item-{k}:item.changed:{r}" for k in range(10) for r in range(1, 41)]
    share = sum(app.chains("item.changed", i) for i in ids) / len(ids)
    assert 0.1 < share < 0.4
    assert not any(app.chains(t, SOURCE) for t in ("item.noted", "item.touched", app.CHAIN_TYPE))
    assert app.source_of(CHAINED) == SOURCE and app.source_of(SOURCE) is None


def test_a_clean_chain_passes_and_each_group_is_judged_on_its_streams(world: World) -> None:
    chained_world(world)
    world.receipt(CHAINED, group=CHAIN)
    world.effect(CHAINED, group=CHAIN)
    v = verify_chain(world)
    assert broken(v) == {}
    assert (v.chain_sources, v.chained_events, v.chained_applied) == (1, 1, 1)


def test_a_source_applied_without_its_chained_event_is_a_violation(world: World) -> None:
    chained_world(world, enqueue_chained=False)
    v = verify_chain(world)
    assert broken(v) == {"chain_missing": 1}
    assert (v.chain_sources, v.chained_events) == (1, 0)


def test_a_chained_event_whose_source_was_not_applied_is_an_orphan(world: World) -> None:
    chained_world(world)
    with world.engine.begin() as conn:  # the source's receipt says it was not applied
        conn.execute(update(inbox).where(inbox.c.event_id == SOURCE)
                     .values(outcome="dead", reason="rejected"))
    world.receipt(CHAINED, group=CHAIN)
    world.effect(CHAINED, group=CHAIN)
    v = verify_chain(world)
    assert broken(v) == {"chain_orphans": 1, "skipped": 1, "not_applied": 1}
    assert v.chain_sources == 0


def test_a_chained_event_of_another_revision_is_an_orphan(world: World) -> None:
    chained_world(world, revision=SOURCE_REVISION + 1)
    world.receipt(CHAINED, group=CHAIN)
    world.effect(CHAINED, group=CHAIN)
    assert broken(verify_chain(world)) == {"chain_orphans": 1}


def test_a_chained_event_without_any_source_is_an_orphan(world: World) -> None:
    chained_world(world)
    stray = app.chained_id("item-1:item.changed:999")
    world.event(stray, app.CHAIN_TYPE, "item", "item-1", 999, entry_id="300-2",
                stream=app.CHAIN_STREAM)
    world.entry(stray)
    for event_id in (CHAINED, stray):
        world.receipt(event_id, group=CHAIN)
        world.effect(event_id, group=CHAIN)
    assert broken(verify_chain(world)) == {"chain_orphans": 1}


def test_a_chained_event_the_second_group_applied_twice_or_never_is_a_violation(
    world: World,
) -> None:
    chained_world(world)
    v = verify_chain(world)
    assert broken(v) == {"missing_receipts": 1}
    assert v.chained_applied == 0
    world.receipt(CHAINED, group=CHAIN)
    world.effect(CHAINED, group=CHAIN)
    world.effect(CHAINED, group=CHAIN)
    v = verify_chain(world)
    assert broken(v) == {"duplicate_effects": 1}
    assert v.chained_applied == 0


def test_stream_order_breaks_name_the_entry_and_both_revisions() -> None:
    from torture.order import revision_order_breaks, revision_order_violations

    a, b = ("item", "a"), ("item", "b")
    entries = [("1-3", a, 1), ("1-1", a, 2), ("1-2", b, 5), ("1-4", b, 6), ("1-5", a, 3)]
    assert revision_order_breaks(entries) == [("1-3", a, 1, 2)]  # in stream order: 2 then 1
    assert revision_order_violations(entries) == 1
