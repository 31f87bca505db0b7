"""The verdict on the chained hop (publishing from a handler, design.md flow 3).

A handler of the source group enqueues, on its claim connection, one chained event per source
event it applies (:func:`torture.app.chains`, id :func:`torture.app.chained_id`, same aggregate
and revision); a second group applies the chained events. The chained event commits with the
source's ``applied`` receipt or neither, so from the ledger (never pruned):

- ``chain_missing``: a source event the source group applied (its receipt, pruned or not, says
  ``applied``) with no chained event in the ledger;
- ``chain_orphans``: a chained event whose source is unknown, is not a source, was not applied
  by the source group, or carries another aggregate or revision than its source.

That a chained event reached its stream once and the chained group applied it exactly once, in
revision order, is judged by :func:`torture.check.verify` like every event (``reads``: the
chained group reads only the chained stream): ``lost``, ``duplicate_entries``,
``missing_receipts``, ``duplicate_effects``, ``order_violations``, ``rows_reused`` …
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any, Protocol

from torture import app

APPLIED = "applied"


class Noting(Protocol):
    """The verdict's counters (:class:`torture.check.Verdict`)."""

    chain_sources: int
    chained_events: int
    chained_applied: int

    def note(self, name: str, what: str) -> None: ...


def check(
    v: Noting, events: Sequence[Any], receipts: Sequence[Any],
    effects: Counter[tuple[str, str]], source_group: str, chained_group: str,
) -> None:
    """Count the hop's figures and violations into ``v`` from the ledger's ``events`` and
    ``receipts`` and the effect rows per ``(group, event id)``."""
    by_id = {x.event_id: x for x in events}
    outcome = {(r.group_name, r.event_id): r.outcome for r in receipts}
    for x in events:
        if not app.chains(x.type, x.event_id):
            continue
        if outcome.get((source_group, x.event_id)) != APPLIED:
            continue
        v.chain_sources += 1
        if app.chained_id(x.event_id) not in by_id:
            v.note("chain_missing", f"{x.event_id} applied by {source_group}, "
                                    f"{app.chained_id(x.event_id)} never enqueued")
    for x in events:
        if x.type != app.CHAIN_TYPE:
            continue
        v.chained_events += 1
        if (outcome.get((chained_group, x.event_id)) == APPLIED
                and effects.get((chained_group, x.event_id), 0) == 1):
            v.chained_applied += 1
        source_id = app.source_of(x.event_id)
        source = by_id.get(source_id) if source_id is not None else None
        if source is None or not app.chains(source.type, source.event_id):
            v.note("chain_orphans", f"{x.event_id}: no source event {source_id}")
        elif outcome.get((source_group, source.event_id)) != APPLIED:
            v.note("chain_orphans", f"{x.event_id}: source {source.event_id} is "
                                    f"{outcome.get((source_group, source.event_id))}")
        elif _what(source) != _what(x):
            v.note("chain_orphans", f"{x.event_id} is {_what(x)}, its source {_what(source)}")


def _what(x: Any) -> tuple[Any, Any, Any]:
    return (x.aggregate_type, x.aggregate_id, None if x.revision is None else int(x.revision))
