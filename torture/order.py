"""The order rules of the torture's verdict (design.md flow 3, invariant 6), as pure functions.

:mod:`torture.check` feeds them the ledger's entry ids and the readable entries (stream order),
the receipts (what a ``superseded`` outcome may stand for) and the effect rows (apply order).
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

AggregateKey = tuple[str, str]
APPLIED, SUPERSEDED = "applied", "superseded"


def entry_key(entry_id: str) -> tuple[int, int]:
    """``"1700000000000-3"`` → ``(1700000000000, 3)``, the order Redis sorts ids in."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def aggregate_of(row: Any) -> AggregateKey | None:
    """A row's ``(aggregate type, aggregate id)``, or None for an event without one."""
    if row.aggregate_id is None or row.revision is None:
        return None
    return (row.aggregate_type or "", row.aggregate_id)


def revision_order_violations(entries: Iterable[tuple[str, AggregateKey, int]]) -> int:
    """Of ``(entry id, aggregate, revision)`` of one stream (any order), the entries whose
    revision is below one an earlier entry of the same aggregate already had."""
    return len(revision_order_breaks(entries))


def revision_order_breaks(
    entries: Iterable[tuple[str, AggregateKey, int]]
) -> list[tuple[str, AggregateKey, int, int]]:
    """The entries :func:`revision_order_violations` counts, as ``(entry id, aggregate,
    revision, the higher revision an earlier entry had)``, in stream order."""
    highest: dict[AggregateKey, int] = {}
    breaks = []
    for entry_id, aggregate, rev in sorted(entries, key=lambda e: entry_key(e[0])):
        if rev < highest.get(aggregate, rev):
            breaks.append((entry_id, aggregate, rev, highest[aggregate]))
        else:
            highest[aggregate] = rev
    return breaks


def superseded_latest(
    receipts: Iterable[Any], types: dict[str, str], strict: Callable[[str], bool]
) -> set[tuple[str, str]]:
    """``(group, event_id)`` of the ``superseded`` receipts the torture accepts: a latest type
    (``types`` maps event id to type), and the same group applied a strictly newer revision of
    the same aggregate."""
    receipts = list(receipts)
    newest: dict[tuple[str, AggregateKey], int] = {}
    for r in receipts:
        aggregate = aggregate_of(r)
        if r.outcome == APPLIED and aggregate is not None:
            key = (r.group_name, aggregate)
            newest[key] = max(newest.get(key, -1), int(r.revision))
    accepted = set()
    for r in receipts:
        aggregate = aggregate_of(r)
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
        aggregate = aggregate_of(e)
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
        aggregate = aggregate_of(event)
        if aggregate is None or aggregate not in earliest_from:
            continue
        revisions, suffix_min = earliest_from[aggregate]
        i = bisect.bisect_right(revisions, int(event.revision))  # first strictly higher
        if i < len(revisions) and suffix_min[i] < first.get(event.event_id, float("inf")):
            violations += 1
    return violations
