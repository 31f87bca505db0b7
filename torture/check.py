"""The verdict, read from the database and from Redis after everything settled.

Every committed outbox row is an event that must be, exactly once, in its stream; every group
must hold exactly one ``applied`` receipt and exactly one side-effect row per event; nothing may
be left undelivered or pending. With run workers, every run must be terminal and the workers'
group must hold exactly one receipt per event of the runs stream.

One exception to ``applied``: an aggregate's event may be ``stale`` (skipped by the inbox's
revision head, its handler not run) when the same group applied a *newer* revision of that
aggregate. That happens after broker data loss: a run's ``run.completed`` appended after the
loss can be read before its ``run.created`` is refilled below it. Applying the older one then
would move the aggregate backward, so skipping it is the promise; ``stale_superseded`` counts
them, and a ``stale`` receipt without a newer applied revision is a violation.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

import redis
from sqlalchemy import Engine, func, select

from shared import keys
from shared.schema import inbox, outbox, runs
from torture import app

TERMINAL = ("completed", "failed")


@dataclass
class Verdict:
    """Figures of the final check; ``violations`` lists every broken promise by name."""

    events: int = 0
    runs: int = 0
    runs_not_terminal: int = 0
    undelivered: int = 0
    lost: int = 0
    duplicate_entries: int = 0
    missing_receipts: int = 0
    not_applied: int = 0
    duplicate_effects: int = 0
    missing_effects: int = 0
    pending: int = 0
    dead_letters: int = 0
    stale_superseded: int = 0
    worker_receipts_missing: int = 0
    worker_receipts_bad: int = 0

    def violations(self, *, runs_must_finish: bool) -> list[str]:
        names = ["undelivered", "lost", "duplicate_entries", "missing_receipts", "not_applied",
                 "duplicate_effects", "missing_effects", "pending", "dead_letters"]
        if runs_must_finish:
            names += ["runs_not_terminal", "worker_receipts_missing", "worker_receipts_bad"]
        return [n for n in names if getattr(self, n)]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def stream_event_ids(client: redis.Redis, key: str) -> Counter[str]:
    """How many times each event id occurs in one stream (read in pages)."""
    seen: Counter[str] = Counter()
    start = "-"
    while True:
        page: Any = client.xrange(key, start, "+", count=5000)
        for _entry_id, fields in page:
            seen[fields.get(b"id", b"").decode()] += 1
        if len(page) < 5000:
            return seen
        last = page[-1][0].decode()
        ms, _, seq = last.partition("-")
        start = f"{ms}-{int(seq) + 1}"


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
) -> Verdict:
    """Compare the outbox with the streams, the inboxes and the side effects (and, with
    ``worker_group``, that group's receipts for every event of ``runs_stream``)."""
    v = Verdict()
    with engine.connect() as conn:
        rows = conn.execute(
            select(outbox.c.event_id, outbox.c.stream, outbox.c.partition,
                   outbox.c.delivered_at_ms)
        ).all()
        v.runs = int(conn.execute(select(func.count()).select_from(runs)).scalar_one())
        v.runs_not_terminal = int(conn.execute(
            select(func.count()).where(runs.c.status.not_in(TERMINAL))
        ).scalar_one()) if check_runs else 0
        receipts = conn.execute(
            select(inbox.c.group_name, inbox.c.event_id, inbox.c.outcome,
                   inbox.c.aggregate_type, inbox.c.aggregate_id, inbox.c.revision)
        ).all()
        effect_counts = conn.execute(
            select(app.effects.c.group_name, app.effects.c.event_id, func.count())
            .group_by(app.effects.c.group_name, app.effects.c.event_id)
        ).all()
    v.events = len(rows)
    v.undelivered = sum(1 for r in rows if r.delivered_at_ms is None)
    stream_keys = sorted({(r.stream, r.partition) for r in rows})
    in_streams: dict[tuple[str, int], Counter[str]] = {}
    for stream, partition in stream_keys:
        key = keys.stream_key(prefix, stream, partition)
        in_streams[(stream, partition)] = stream_event_ids(client, key)
        v.pending += pending_total(client, key)
        v.dead_letters += int(client.xlen(keys.dead_letter_key(prefix, stream, partition)))
    for r in rows:
        count = in_streams[(r.stream, r.partition)].get(r.event_id, 0)
        v.lost += count == 0
        v.duplicate_entries += max(count - 1, 0)
    superseded = _superseded(receipts)
    v.stale_superseded = len(superseded)
    _receipts_and_effects(v, [r.event_id for r in rows], groups, receipts, effect_counts,
                          superseded)
    if worker_group is not None:
        outcome = {r.event_id: r.outcome for r in receipts if r.group_name == worker_group}
        run_events = [r.event_id for r in rows if r.stream == runs_stream]
        v.worker_receipts_missing = sum(1 for e in run_events if e not in outcome)
        v.worker_receipts_bad = sum(
            1 for e in run_events if e in outcome and outcome[e] != "applied"
            and (worker_group, e) not in superseded)
    return v


def _superseded(receipts: Any) -> set[tuple[str, str]]:
    """``(group, event_id)`` of ``stale`` receipts whose group applied a newer revision of
    the same aggregate."""
    newest: dict[tuple[str, str, str], int] = {}
    for r in receipts:
        if r.outcome == "applied" and r.aggregate_id is not None and r.revision is not None:
            key = (r.group_name, r.aggregate_type, r.aggregate_id)
            newest[key] = max(newest.get(key, 0), int(r.revision))
    return {
        (r.group_name, r.event_id) for r in receipts
        if r.outcome == "stale" and r.revision is not None
        and newest.get((r.group_name, r.aggregate_type, r.aggregate_id), 0) > int(r.revision)
    }


def _receipts_and_effects(
    v: Verdict, event_ids: list[str], groups: list[str], receipts: Any, effect_counts: Any,
    superseded: set[tuple[str, str]],
) -> None:
    outcome = {(r.group_name, r.event_id): r.outcome for r in receipts}
    effects = {(g, e): int(n) for g, e, n in effect_counts}
    for group in groups:
        for event_id in event_ids:
            got = outcome.get((group, event_id))
            v.missing_receipts += got is None
            v.not_applied += (got is not None and got != "applied"
                              and (group, event_id) not in superseded)
            n = effects.get((group, event_id), 0)
            v.missing_effects += got == "applied" and n == 0
            v.duplicate_effects += max(n - 1, 0)
