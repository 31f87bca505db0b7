"""The verdict, read from the ledger, the database and Redis after everything settled.

Ground truth is the torture's ledger (:mod:`torture.ledger`), which the daemons never prune,
and the handlers' effect rows (:mod:`torture.app`), never pruned either. Every event the ledger
holds must be, exactly once, in its stream; every group must hold exactly one ``applied``
receipt and exactly one side-effect row per event; nothing may be left undelivered or pending.
With run workers, every run must be terminal and the workers' group must hold exactly one
receipt per event of the runs stream.

Retention deletes on purpose; each disappearance is accepted only under its exact condition
(``retention`` given: the ages too), anything else is a violation:

- an **outbox row** may be missing only if the ledger says it was delivered and then pruned
  (``retention``: at least ``delivered_s`` after its delivery); otherwise ``rows_missing``;
- a **stream entry** may be missing only if its entry id is below the trim floor recorded for
  its ``(stream, partition)`` (``outbox_stream_trims``) and every group that reads the stream
  settled the event: a receipt ``applied`` (plus, for the torture groups, its effect row),
  ``superseded`` or ``dead`` (dead-lettered). Anything else missing is ``lost``
  (``trimmed_unsettled`` counts the part of it below the floor);
- a **receipt** may be missing only if it was pruned while its entry id was below the trim
  floor of its partition (the floor at the moment of the delete, stamped by the ledger's
  trigger), older than ``inbox_s``, and, if ``applied`` by a torture group, with its effect row;
  otherwise ``receipts_pruned_wrongly``. A receipt inserted twice (``receipts_recreated``)
  means its event came back after the receipt was pruned.

Duplicates: ``duplicate_entries`` counts the readable stream entries that are not the entry the
relay marked for their event (the ledger's ``entry_id``). For the trimmed range the inbox cannot
tell: ``outbox_inbox.duplicates`` counts every ``duplicate`` outcome, a redelivery of the same
entry (a consumer killed between commit and ``XACK``) exactly like a second entry of the same
event, and the receipt keeps only the first entry id. What is checked instead is exact for the
way a second entry could arise: the relay's ids only grow, so a stray copy of an event would
sort *before* the entry the relay marked, and a group would receive the event from it first;
its receipt would then name an entry the relay never marked (``foreign_receipts``). A second
application shows as ``duplicate_effects`` whatever the stream held.

Order (design.md flow 3, invariant 6), each rule a violation of its own:

- ``stream_order_violations``: in every stream, an aggregate's entries appear in non-decreasing
  revision order, judged on the union of the ledger's entry ids (trimmed entries included) and
  what is still readable (``XRANGE``); each entry below a revision already seen counts.
- ``order_violations``: for ``strict`` types, per group and aggregate, the apply order (the
  effect rows' ``seq``) follows the revisions: a strict event counts when an effect of a higher
  revision of its aggregate was recorded before its own, or when it was never applied while a
  higher revision was (two events of one revision must both apply before the next revision).
- ``out_of_order``: dead receipts with reason ``out_of_order``, in any group.
- ``skipped``: strict events whose receipt is anything but ``applied``.
- ``not_applied``: any receipt other than ``applied`` (``skipped`` is its strict share), except
  a ``superseded`` receipt of a ``latest`` type when the same group applied a strictly newer
  revision of the same aggregate: that one is counted in ``superseded_latest``, the only
  non-applied outcome the torture accepts. There is no other exception (no ``stale``).

Each group is judged on the streams it reads (``reads``; by default every stream). The chained
hop (``chain``: the source group and the chained group) is judged by :mod:`torture.chain`.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import redis
from sqlalchemy import Engine, func, select

from outbox_relay.runs import schema as runs_schema
from outbox_relay.runs.schema import runs
from outbox_relay.shared import keys
from outbox_relay.shared.schema import inbox, outbox, stream_trims
from torture import app, ledger
from torture import chain as torture_chain
from torture.order import (
    AggregateKey,
    aggregate_of,
    entry_key,
    order_violations,
    revision_order_breaks,
    superseded_latest,
)

TERMINAL = ("completed", "failed")
APPLIED, SUPERSEDED, DEAD, OUT_OF_ORDER, LOST = (
    "applied", "superseded", "dead", "out_of_order", "lost")
SETTLED = frozenset({APPLIED, SUPERSEDED, DEAD})
PAGE = 5000

StreamId = tuple[str, int]

VIOLATIONS = (
    "undelivered", "lost", "duplicate_entries", "stream_order_violations", "missing_receipts",
    "not_applied", "skipped", "out_of_order", "order_violations", "duplicate_effects",
    "missing_effects", "pending", "dead_letters", "rows_missing", "rows_reused", "remarked",
    "foreign_receipts", "lost_receipts", "receipts_recreated", "receipts_pruned_wrongly",
    "chain_missing", "chain_orphans",
)
RUN_VIOLATIONS = ("runs_not_terminal", "worker_receipts_missing", "worker_receipts_bad")


@dataclass
class Verdict:
    """Figures of the final check; ``violations`` lists every broken promise by name."""

    events: int = 0
    strict_events: int = 0
    runs: int = 0
    runs_not_terminal: int = 0
    undelivered: int = 0
    lost: int = 0
    duplicate_entries: int = 0
    stream_order_violations: int = 0
    missing_receipts: int = 0
    not_applied: int = 0
    skipped: int = 0
    out_of_order: int = 0
    order_violations: int = 0
    duplicate_effects: int = 0
    missing_effects: int = 0
    pending: int = 0
    dead_letters: int = 0
    superseded_latest: int = 0
    worker_receipts_missing: int = 0
    worker_receipts_bad: int = 0
    # Retention's violations (see the module docstring).
    rows_missing: int = 0
    rows_reused: int = 0  # an event id enqueued again after its row was pruned
    remarked: int = 0  # a row marked delivered more than once, or under another entry id
    foreign_receipts: int = 0  # a receipt naming an entry the relay never marked for the event
    lost_receipts: int = 0  # outcome ``lost``: an entry vanished while pending
    receipts_recreated: int = 0
    receipts_pruned_wrongly: int = 0
    # The chained hop (torture/chain.py): sources applied without their chained event, and
    # chained events without an applied source (or not matching it).
    chain_missing: int = 0
    chain_orphans: int = 0
    chain_sources: int = 0  # source events applied by the source group
    chained_events: int = 0  # chained events enqueued (the ledger)
    chained_applied: int = 0  # chained events the chained group applied
    # What retention did, accepted (not violations).
    rows_pruned: int = 0
    receipts_pruned: int = 0
    entries_readable: int = 0
    entries_trimmed: int = 0
    trimmed_unsettled: int = 0  # part of ``lost``
    redeliveries: int = 0  # sum of ``duplicates``: redeliveries and duplicate entries alike
    # A few instances of the retention and stream violations, for whoever reads the report.
    examples: dict[str, list[str]] = field(default_factory=dict)

    def note(self, name: str, what: str) -> None:
        """Count one ``name`` violation and keep ``what`` as an example (the first 5)."""
        setattr(self, name, getattr(self, name) + 1)
        kept = self.examples.setdefault(name, [])
        if len(kept) < 5:
            kept.append(what)

    def violations(self, *, runs_must_finish: bool) -> list[str]:
        names = VIOLATIONS + (RUN_VIOLATIONS if runs_must_finish else ())
        return [n for n in names if getattr(self, n)]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Retention:
    """The ages below which nothing may be pruned (seconds; 0: not checked)."""

    delivered_s: float = 0.0
    inbox_s: float = 0.0


@dataclass(frozen=True)
class Entry:
    """One readable stream entry."""

    entry_id: str
    event_id: str
    aggregate: AggregateKey | None
    revision: int | None


@dataclass
class Snapshot:
    """Everything the verdict reads from the database, read once."""

    events: list[Any]  # the ledger's events
    present_rows: set[str]  # event ids still in outbox_events
    floors: dict[StreamId, tuple[int, int]]
    receipts: list[Any]  # the receipt ledger, with each event's type and aggregate
    present_receipts: set[tuple[str, str]]
    effect_rows: list[Any]
    runs: int = 0
    runs_not_terminal: int = 0
    effects: Counter[tuple[str, str]] = field(default_factory=Counter)


def read_stream(client: redis.Redis, key: str) -> list[Entry]:
    """Every readable entry of one stream, in id order (``XRANGE`` in pages)."""
    found: list[Entry] = []
    start = "-"
    while True:
        page: Any = client.xrange(key, start, "+", count=PAGE)
        for entry_id, fields in page:
            aggregate_id, revision = fields.get(b"aggregateid"), fields.get(b"revision")
            aggregate = None if aggregate_id is None or revision is None else (
                fields.get(b"aggregatetype", b"").decode(), aggregate_id.decode())
            found.append(Entry(entry_id.decode(), fields.get(b"id", b"").decode(), aggregate,
                               None if revision is None else int(revision)))
        if len(page) < PAGE:
            return found
        start = "(" + page[-1][0].decode()


def pending_total(client: redis.Redis, key: str) -> int:
    """Entries pending in every group of one stream (0 for a missing stream)."""
    if not client.exists(key):
        return 0
    return sum(int(g["pending"]) for g in client.xinfo_groups(key))


def lag_total(client: redis.Redis, key: str) -> int:
    """Entries not yet read by some group (a missing group counts as the whole stream),
    counted exactly: the entries above each group's last-delivered id (``XINFO GROUPS``' lag
    can stay wrong after a failover, see :func:`outbox_relay.consumer.group_status.unread`)."""
    if not client.exists(key):
        return 0
    groups = client.xinfo_groups(key)
    if not groups:
        return int(client.xlen(key))
    unread: list[Any] = [client.xrange(key, "(" + _text(g["last-delivered-id"]), "+")
                         for g in groups]
    return sum(len(entries) for entries in unread)


def consumers_per_group(client: redis.Redis, stream_keys: Iterable[str]) -> dict[str, int]:
    """Distinct consumer names each group has over ``stream_keys`` (``XINFO CONSUMERS``)."""
    names: dict[str, set[str]] = defaultdict(set)
    for key in stream_keys:
        if not client.exists(key):
            continue
        for group in client.xinfo_groups(key):
            name = _text(group["name"])
            for consumer in client.xinfo_consumers(key, name):
                names[name].add(_text(consumer["name"]))
    return {group: len(found) for group, found in sorted(names.items())}


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def snapshot(engine: Engine, *, check_runs: bool) -> Snapshot:
    """Read the ledger, what is left of the outbox and the inbox, the floors and the effects."""
    e, r = ledger.events.c, ledger.receipts.c
    with engine.connect() as conn:
        events = conn.execute(select(ledger.events)).all()
        present_rows = {i for (i,) in conn.execute(select(outbox.c.event_id))}
        floors = {(s, p): entry_key(f) for s, p, f in conn.execute(
            select(stream_trims.c.stream, stream_trims.c.partition,
                   stream_trims.c.floor_entry_id))}
        receipts = conn.execute(
            select(ledger.receipts, e.type, e.aggregate_type, e.aggregate_id, e.revision)
            .select_from(ledger.receipts.outerjoin(ledger.events, r.event_id == e.event_id))
        ).all()
        present_receipts = {(g, i) for g, i in conn.execute(
            select(inbox.c.group_name, inbox.c.event_id))}
        effect_rows = conn.execute(
            select(app.effects.c.seq, app.effects.c.group_name, app.effects.c.event_id,
                   app.effects.c.event_type, app.effects.c.aggregate_type,
                   app.effects.c.aggregate_id, app.effects.c.revision)
            .order_by(app.effects.c.seq)
        ).all()
        snap = Snapshot(list(events), present_rows, floors, list(receipts), present_receipts,
                        list(effect_rows))
        if runs_schema.MIGRATIONS.database_revision(conn) is not None:  # the soak has none
            snap.runs = int(conn.execute(select(func.count()).select_from(runs)).scalar_one())
            snap.runs_not_terminal = int(conn.execute(
                select(func.count()).where(runs.c.status.not_in(TERMINAL))).scalar_one())
    snap.effects = Counter((x.group_name, x.event_id) for x in snap.effect_rows)
    return snap


def verify(
    engine: Engine, client: redis.Redis, prefix: str, groups: list[str], *, check_runs: bool,
    worker_group: str | None = None, runs_stream: str = "runs",
    strict: Callable[[str], bool] = app.is_strict, retention: Retention | None = None,
    reads: dict[str, frozenset[str]] | None = None, chain: tuple[str, str] | None = None,
) -> Verdict:
    """Compare the ledger with the outbox, the streams, the inboxes and the side effects of
    ``groups`` (``strict(type)`` says which types those groups apply in strict order; ``reads``
    which streams each group reads, default all) and, with ``worker_group``, that group's
    receipts for every event of ``runs_stream`` (latest); with ``chain`` (source group,
    chained group) the hop end to end (:func:`torture.chain.check`)."""
    snap = snapshot(engine, check_runs=check_runs)

    def reads_stream(group: str, stream: str) -> bool:
        return reads is None or group not in reads or stream in reads[group]

    retention = retention or Retention()
    v = Verdict(events=len(snap.events), runs=snap.runs,
                runs_not_terminal=snap.runs_not_terminal)
    v.strict_events = sum(1 for x in snap.events if strict(x.type))
    v.undelivered = sum(1 for x in snap.events if x.delivered_at_ms is None)
    _outbox_rows(v, snap, retention)
    readers = {stream: [g for g in groups if reads_stream(g, stream)]
               for stream in {x.stream for x in snap.events}}
    if worker_group is not None:
        readers.setdefault(runs_stream, []).append(worker_group)
    _streams(v, snap, client, prefix, readers, set(groups))
    _pruned_receipts(v, snap, prefix, set(groups), retention)
    accepted = superseded_latest(snap.receipts, {x.event_id: x.type for x in snap.events},
                                 strict)
    v.superseded_latest = len(accepted)
    marked = {x.event_id: x.entry_id for x in snap.events}
    for x in snap.receipts:
        if x.outcome == DEAD and x.reason == OUT_OF_ORDER:  # kept, so a run can be traced
            v.note("out_of_order",
                   f"{x.group_name}/{x.event_id}: {x.aggregate_type}/{x.aggregate_id} revision "
                   f"{x.revision} from {x.stream_key} {x.entry_id} (marked "
                   f"{marked.get(x.event_id)}), received {x.created_at_ms}")
    for group in groups:
        read = [x for x in snap.events if reads_stream(group, x.stream)]
        _receipts_and_effects(v, read, [group], snap.receipts, snap.effects, accepted, strict)
        v.order_violations += order_violations(
            [x for x in read if strict(x.type)],
            [x for x in snap.effect_rows if x.group_name == group and strict(x.event_type)],
        )
    if chain is not None:
        torture_chain.check(v, snap.events, snap.receipts, snap.effects, *chain)
    if worker_group is not None:
        outcome = {x.event_id: x.outcome for x in snap.receipts if x.group_name == worker_group}
        run_events = [x.event_id for x in snap.events if x.stream == runs_stream]
        v.worker_receipts_missing = sum(1 for e in run_events if e not in outcome)
        v.worker_receipts_bad = sum(
            1 for e in run_events if e in outcome and outcome[e] != APPLIED
            and (worker_group, e) not in accepted)
    return v


def _outbox_rows(v: Verdict, snap: Snapshot, retention: Retention) -> None:
    """A missing row must have been delivered, then pruned (late enough); an id is enqueued
    and marked delivered once."""
    min_age = int(retention.delivered_s * 1000)
    for x in snap.events:
        for _ in range(int(x.enqueued) - 1):
            v.note("rows_reused", x.event_id)
        for _ in range(int(x.marks) - 1):
            v.note("remarked", f"{x.event_id} now at {x.entry_id}")
        if x.event_id in snap.present_rows:
            continue
        if (x.delivered_at_ms is not None and x.pruned_at_ms is not None
                and x.pruned_at_ms - x.delivered_at_ms >= min_age):
            v.rows_pruned += 1
        else:
            v.note("rows_missing", f"{x.event_id} delivered_at={x.delivered_at_ms} "
                                   f"pruned_at={x.pruned_at_ms}")


def _streams(
    v: Verdict, snap: Snapshot, client: redis.Redis, prefix: str,
    readers: dict[str, list[str]], effect_groups: set[str],
) -> None:
    """Duplicates and order on what is readable plus the ledger; each missing entry is
    trimmed (below the floor, settled by every reader) or lost."""
    by_stream: dict[StreamId, list[Any]] = defaultdict(list)
    for x in snap.events:
        by_stream[(x.stream, x.partition)].append(x)
    outcome = {(x.group_name, x.event_id): x.outcome for x in snap.receipts}

    def settled(group: str, event_id: str) -> bool:
        got = outcome.get((group, event_id))
        return got in SETTLED and (group not in effect_groups or got != APPLIED
                                   or snap.effects[(group, event_id)] > 0)

    for (stream, partition), events in sorted(by_stream.items()):
        key = keys.stream_key(prefix, stream, partition)
        readable = read_stream(client, key)
        v.entries_readable += len(readable)
        v.pending += pending_total(client, key)
        v.dead_letters += int(client.xlen(keys.dead_letter_key(prefix, stream, partition)))
        marked = {x.event_id: x.entry_id for x in events}
        present = {e.event_id for e in readable}
        for e in readable:
            if marked.get(e.event_id) != e.entry_id:
                v.note("duplicate_entries", f"{key} {e.entry_id}: {e.event_id!r}, marked at "
                                            f"{marked.get(e.event_id)}")
        floor = snap.floors.get((stream, partition))
        for x in events:
            if x.event_id in present:
                continue
            if x.entry_id is None or floor is None or entry_key(x.entry_id) >= floor:
                v.note("lost", f"{x.event_id} at {key} {x.entry_id}, floor {floor}")
            elif all(settled(g, x.event_id) for g in readers.get(stream, [])):
                v.entries_trimmed += 1
            else:
                v.note("lost", f"{x.event_id} at {key} {x.entry_id}, below the floor {floor} "
                               "but not settled by every group")
                v.trimmed_unsettled += 1
        ordered = {e.entry_id: (e.aggregate, e.revision) for e in readable}
        for x in events:
            if x.entry_id is not None and x.entry_id not in ordered:
                ordered[x.entry_id] = (aggregate_of(x), x.revision)
        _note_order_breaks(v, key, revision_order_breaks(
            (i, a, int(r)) for i, (a, r) in ordered.items() if a is not None and r is not None))


def _note_order_breaks(v: Verdict, key: str,
                       breaks: list[tuple[str, tuple[str, str], int, int]]) -> None:
    """Count each stream-order break of ``key`` and keep the first ones as examples."""
    for entry_id, aggregate, rev, higher in breaks:
        v.note("stream_order_violations",
               f"{key} {entry_id}: {aggregate} revision {rev} after revision {higher}")


def _pruned_receipts(
    v: Verdict, snap: Snapshot, prefix: str, effect_groups: set[str], retention: Retention
) -> None:
    """Receipts: from the entry the relay marked, inserted once, pruned only below the floor
    (late enough, the effect kept)."""
    marked = {x.event_id: (keys.stream_key(prefix, x.stream, x.partition), x.entry_id)
              for x in snap.events}
    min_age = int(retention.inbox_s * 1000)
    for r in snap.receipts:
        v.redeliveries += int(r.duplicates)
        what = f"{r.group_name}/{r.event_id} from {r.stream_key} {r.entry_id}"
        for _ in range(int(r.inserts) - 1):
            v.note("receipts_recreated", f"{what}, pruned {r.pruned_at_ms} (floor then "
                                         f"{r.floor_at_prune}), received again from "
                                         f"{r.last_entry_id}, marked at {marked.get(r.event_id)}")
        expected = marked.get(r.event_id)
        if r.outcome == LOST:
            v.note("lost_receipts", what)
        elif expected is None or (expected[1] is not None
                                  and expected != (r.stream_key, r.entry_id)):
            # (an undelivered event is counted as such)
            v.note("foreign_receipts", f"{what}, marked at {expected}")
        if (r.group_name, r.event_id) in snap.present_receipts:
            continue
        floor = r.floor_at_prune
        if (
            r.pruned_at_ms is not None and floor is not None
            and entry_key(r.entry_id) < entry_key(floor)
            and r.pruned_at_ms - r.created_at_ms >= min_age
            and (r.group_name not in effect_groups or r.outcome != APPLIED
                 or snap.effects[(r.group_name, r.event_id)] > 0)
        ):
            v.receipts_pruned += 1
        else:
            v.note("receipts_pruned_wrongly", f"{what} ({r.outcome}) floor at prune {floor}, "
                                              f"created {r.created_at_ms}, "
                                              f"pruned {r.pruned_at_ms}")


def _receipts_and_effects(
    v: Verdict, events: Sequence[Any], groups: list[str], receipts: Sequence[Any],
    effects: Counter[tuple[str, str]], accepted: set[tuple[str, str]],
    strict: Callable[[str], bool],
) -> None:
    outcome = {(r.group_name, r.event_id): r.outcome for r in receipts}
    for group in groups:
        for row in events:
            got = outcome.get((group, row.event_id))
            v.missing_receipts += got is None
            if got is not None and got != APPLIED:
                v.skipped += strict(row.type)
                v.not_applied += (group, row.event_id) not in accepted
            n = effects.get((group, row.event_id), 0)
            v.missing_effects += got == APPLIED and n == 0
            v.duplicate_effects += max(n - 1, 0)
