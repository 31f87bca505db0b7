"""The torture's verdict (:mod:`torture.check`) on hand-made data: each rule can fail.

A SQLite file holds the outbox rows, receipts and effect rows; fakeredis holds the stream.
A clean world passes; each test then breaks exactly one promise and expects its counter.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import fakeredis
import pytest
from sqlalchemy import Engine

from shared import db, keys
from shared.schema import inbox, outbox
from torture import app, check

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


@dataclass
class World:
    """The database and the stream the checker reads, written by hand."""

    engine: Engine
    client: Any
    events: dict[str, tuple[Any, ...]] = field(default_factory=dict)

    def event(self, event_id: str, type_: str, agg_type: str | None, agg_id: str | None,
              revision: int | None) -> None:
        self.events[event_id] = (event_id, type_, agg_type, agg_id, revision)
        with self.engine.begin() as conn:
            conn.execute(outbox.insert().values(
                event_id=event_id, stream="events", partition=0, type=type_,
                aggregate_type=agg_type, aggregate_id=agg_id, revision=revision,
                source="test", payload="null", headers="{}", created_at_ms=1,
                available_at_ms=1, delivered_at_ms=2,
            ))

    def entry(self, event_id: str) -> None:
        _, type_, agg_type, agg_id, revision = self.events[event_id]
        fields = {"id": event_id, "type": type_}
        if agg_id is not None:
            fields |= {"aggregatetype": agg_type, "aggregateid": agg_id,
                       "revision": str(revision)}
        self.client.xadd(KEY, fields)

    def receipt(self, event_id: str, outcome: str = "applied", reason: str | None = None,
                group: str = GROUP) -> None:
        _, type_, agg_type, agg_id, revision = self.events[event_id]
        with self.engine.begin() as conn:
            conn.execute(inbox.insert().values(
                group_name=group, event_id=event_id, event_type=type_,
                aggregate_type=agg_type, aggregate_id=agg_id, revision=revision,
                stream_key=KEY, entry_id="1-1", outcome=outcome, reason=reason,
                created_at_ms=1,
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

    def verify(self) -> check.Verdict:
        return check.verify(self.engine, self.client, PREFIX, [GROUP], check_runs=False)


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    engine = db.make_engine(f"sqlite:///{tmp_path}/check.db")
    db.upgrade(engine)
    app.create_tables(engine)
    w = World(engine, fakeredis.FakeRedis())
    for event in EVENTS:
        w.event(*event)
    yield w
    engine.dispose()


def all_in_stream(w: World) -> None:
    for event_id, *_ in EVENTS:
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


def test_a_stream_holding_a_later_revision_first_is_a_violation(world: World) -> None:
    for event_id in (C2, C1, N1, T1, T2, PLAIN):  # item-1 revision 2 above revision 1
        world.entry(event_id)
    for event_id, *_ in EVENTS:
        world.apply(event_id)
    assert broken(world.verify()) == {"stream_order_violations": 2}


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
    assert broken(world.verify()) == {
        "out_of_order": 1, "skipped": 1, "not_applied": 1, "order_violations": 1,
    }


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
    assert check.superseded_latest(receipts, types, app.is_strict) == set()
    receipts.append(row("a", T2, "applied", 2))
    assert check.superseded_latest(receipts, types, app.is_strict) == {("a", T1)}


def test_lost_and_duplicate_entries(world: World) -> None:
    for event_id in (C1, N1, T1, C2, T2, C2):  # evt-1 missing, revision 2 twice
        world.entry(event_id)
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
