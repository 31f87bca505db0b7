"""The verdict, read from the database and from Redis after everything settled.

Every committed outbox row is an event that must be, exactly once, in its stream; every group
must hold exactly one ``applied`` receipt and exactly one side-effect row per event; nothing may
be left undelivered or pending. With run workers, every run must be terminal and the workers'
group must hold exactly one receipt per event of the runs stream.

Order (design.md flow 3, invariant 6), each rule a violation of its own:

- ``stream_order_violations``: in every stream, an aggregate's entries appear in non-decreasing
  revision order (read with ``XRANGE``); each entry below a revision already seen counts.
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
"""

from __future__ import annotations

import bisect
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import redis
from sqlalchemy import Engine, func, select

from shared import keys
from shared.schema import inbox, outbox, runs
from torture import app

TERMINAL = ("completed", "failed")
APPLIED, SUPERSEDED, DEAD, OUT_OF_ORDER = "applied", "superseded", "dead", "out_of_order"
PAGE = 5000

AggregateKey = tuple[str, str]


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

    def violations(self, *, runs_must_finish: bool) -> list[str]:
        names = ["undelivered", "lost", "duplicate_entries", "stream_order_violations",
                 "missing_receipts", "not_applied", "skipped", "out_of_order",
                 "order_violations", "duplicate_effects", "missing_effects", "pending",
                 "dead_letters"]
        if runs_must_finish:
            names += ["runs_not_terminal", "worker_receipts_missing", "worker_receipts_bad"]
        return [n for n in names if getattr(self, n)]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class StreamScan:
    """One stream read whole: occurrences per event id, and entries out of revision order."""

    ids: Counter[str]
    order_violations: int


def scan_stream(client: redis.Redis, key: str) -> StreamScan:
    """Read a stream in pages with ``XRANGE``: count each event id, and count entries whose
    revision is below one already seen for the same aggregate in this stream."""
    seen: Counter[str] = Counter()
    highest: dict[AggregateKey, int] = {}
    violations = 0
    start = "-"
    while True:
        page: Any = client.xrange(key, start, "+", count=PAGE)
        for _entry_id, fields in page:
            seen[fields.get(b"id", b"").decode()] += 1
            aggregate_id, revision = fields.get(b"aggregateid"), fields.get(b"revision")
            if aggregate_id is None or revision is None:
                continue
            aggregate = (fields.get(b"aggregatetype", b"").decode(), aggregate_id.decode())
            rev = int(revision)
            if rev < highest.get(aggregate, rev):
                violations += 1
            else:
                highest[aggregate] = rev
        if len(page) < PAGE:
            return StreamScan(seen, violations)
        ms, _, seq = page[-1][0].decode().partition("-")
        start = f"{ms}-{int(seq) + 1}"


def stream_event_ids(client: redis.Redis, key: str) -> Counter[str]:
    """How many times each event id occurs in one stream."""
    return scan_stream(client, key).ids


def pending_total(client: redis.Redis, key: str) -> int:
    """Entries pending in every group of one stream (0 for a missing stream)."""
    if not client.exists(key):
        return 0
    return sum(int(g["pending"]) for g in client.xinfo_groups(key))


def lag_total(client: redis.Redis, key: str) -> int:
    """Entries not yet read by some group (a missing group counts as the whole stream)."""
    if not client.exists(key):
        return 0
    groups = client.xinfo_groups(key)
    if not groups:
        return int(client.xlen(key))
    return sum(int(g.get("lag") or 0) for g in groups)


def verify(
    engine: Engine, client: redis.Redis, prefix: str, groups: list[str], *, check_runs: bool,
    worker_group: str | None = None, runs_stream: str = "runs",
    strict: Callable[[str], bool] = app.is_strict,
) -> Verdict:
    """Compare the outbox with the streams, the inboxes and the side effects of ``groups``
    (``strict(type)`` says which types those groups apply in strict order) and, with
    ``worker_group``, that group's receipts for every event of ``runs_stream`` (latest)."""
    v = Verdict()
    with engine.connect() as conn:
        rows = conn.execute(
            select(outbox.c.event_id, outbox.c.stream, outbox.c.partition,
                   outbox.c.delivered_at_ms, outbox.c.type, outbox.c.aggregate_type,
                   outbox.c.aggregate_id, outbox.c.revision)
        ).all()
        v.runs = int(conn.execute(select(func.count()).select_from(runs)).scalar_one())
        v.runs_not_terminal = int(conn.execute(
            select(func.count()).where(runs.c.status.not_in(TERMINAL))
        ).scalar_one()) if check_runs else 0
        receipts = conn.execute(
            select(inbox.c.group_name, inbox.c.event_id, inbox.c.outcome, inbox.c.reason,
                   inbox.c.aggregate_type, inbox.c.aggregate_id, inbox.c.revision)
        ).all()
        effect_rows = conn.execute(
            select(app.effects.c.seq, app.effects.c.group_name, app.effects.c.event_id,
                   app.effects.c.event_type, app.effects.c.aggregate_type,
                   app.effects.c.aggregate_id, app.effects.c.revision)
            .order_by(app.effects.c.seq)
        ).all()
    v.events = len(rows)
    v.strict_events = sum(1 for r in rows if strict(r.type))
    v.undelivered = sum(1 for r in rows if r.delivered_at_ms is None)
    in_streams: dict[tuple[str, int], Counter[str]] = {}
    for stream, partition in sorted({(r.stream, r.partition) for r in rows}):
        key = keys.stream_key(prefix, stream, partition)
        scan = scan_stream(client, key)
        in_streams[(stream, partition)] = scan.ids
        v.stream_order_violations += scan.order_violations
        v.pending += pending_total(client, key)
        v.dead_letters += int(client.xlen(keys.dead_letter_key(prefix, stream, partition)))
    for r in rows:
        count = in_streams[(r.stream, r.partition)].get(r.event_id, 0)
        v.lost += count == 0
        v.duplicate_entries += max(count - 1, 0)
    v.out_of_order = sum(1 for r in receipts if r.outcome == DEAD and r.reason == OUT_OF_ORDER)
    accepted = superseded_latest(receipts, {r.event_id: r.type for r in rows}, strict)
    v.superseded_latest = len(accepted)
    _receipts_and_effects(v, rows, groups, receipts, effect_rows, accepted, strict)
    for group in groups:
        v.order_violations += order_violations(
            [r for r in rows if strict(r.type)],
            [e for e in effect_rows if e.group_name == group and strict(e.event_type)],
        )
    if worker_group is not None:
        outcome = {r.event_id: r.outcome for r in receipts if r.group_name == worker_group}
        run_events = [r.event_id for r in rows if r.stream == runs_stream]
        v.worker_receipts_missing = sum(1 for e in run_events if e not in outcome)
        v.worker_receipts_bad = sum(
            1 for e in run_events if e in outcome and outcome[e] != APPLIED
            and (worker_group, e) not in accepted)
    return v


def _aggregate(row: Any) -> AggregateKey | None:
    if row.aggregate_id is None or row.revision is None:
        return None
    return (row.aggregate_type or "", row.aggregate_id)


def superseded_latest(
    receipts: Iterable[Any], types: dict[str, str], strict: Callable[[str], bool]
) -> set[tuple[str, str]]:
    """``(group, event_id)`` of the ``superseded`` receipts the torture accepts: a latest type
    (``types`` maps event id to type), and the same group applied a strictly newer revision of
    the same aggregate."""
    receipts = list(receipts)
    newest: dict[tuple[str, AggregateKey], int] = {}
    for r in receipts:
        aggregate = _aggregate(r)
        if r.outcome == APPLIED and aggregate is not None:
            key = (r.group_name, aggregate)
            newest[key] = max(newest.get(key, -1), int(r.revision))
    accepted = set()
    for r in receipts:
        aggregate = _aggregate(r)
        if (r.outcome != SUPERSEDED or aggregate is None or r.event_id not in types
                or strict(types[r.event_id])):
            continue
        if newest.get((r.group_name, aggregate), -1) > int(r.revision):
            accepted.add((r.group_name, r.event_id))
    return accepted


def order_violations(strict_events: Iterable[Any], effects: Iterable[Any]) -> int:
    """Strict events (rows with ``event_id``, aggregate and ``revision``) that one group did not
    apply in revision order, judged from its effect rows (``seq``, ``event_id``, aggregate,
    ``revision``): an event counts when an effect of a higher revision of its aggregate has a
    lower ``seq`` than the event's first effect, or than forever if it has none."""
    first: dict[str, int] = {}
    by_aggregate: dict[AggregateKey, list[tuple[int, int]]] = defaultdict(list)
    for e in effects:
        first[e.event_id] = min(first.get(e.event_id, e.seq), e.seq)
        aggregate = _aggregate(e)
        if aggregate is not None:
            by_aggregate[aggregate].append((int(e.revision), int(e.seq)))
    # Per aggregate: its applied revisions ascending, and the earliest seq at or above each.
    earliest_from: dict[AggregateKey, tuple[list[int], list[int]]] = {}
    for aggregate, applied in by_aggregate.items():
        applied.sort()
        revisions = [rev for rev, _ in applied]
        suffix_min = [seq for _, seq in applied]
        for i in range(len(suffix_min) - 2, -1, -1):
            suffix_min[i] = min(suffix_min[i], suffix_min[i + 1])
        earliest_from[aggregate] = (revisions, suffix_min)
    violations = 0
    for event in strict_events:
        aggregate = _aggregate(event)
        if aggregate is None or aggregate not in earliest_from:
            continue
        revisions, suffix_min = earliest_from[aggregate]
        i = bisect.bisect_right(revisions, int(event.revision))  # first strictly higher
        if i < len(revisions) and suffix_min[i] < first.get(event.event_id, float("inf")):
            violations += 1
    return violations


def _receipts_and_effects(
    v: Verdict, rows: Sequence[Any], groups: list[str], receipts: Any, effect_rows: Any,
    accepted: set[tuple[str, str]], strict: Callable[[str], bool],
) -> None:
    outcome = {(r.group_name, r.event_id): r.outcome for r in receipts}
    effects = Counter((e.group_name, e.event_id) for e in effect_rows)
    for group in groups:
        for row in rows:
            got = outcome.get((group, row.event_id))
            v.missing_receipts += got is None
            if got is not None and got != APPLIED:
                v.skipped += strict(row.type)
                v.not_applied += (group, row.event_id) not in accepted
            n = effects.get((group, row.event_id), 0)
            v.missing_effects += got == APPLIED and n == 0
            v.duplicate_effects += max(n - 1, 0)
