"""The console's durable log of mutations: who replayed or purged what, when, and the result.

Every replay or purge is written **before** it runs (:func:`begin`: caller, time, the ids or the
filter asked for) and completed after (:func:`finish`: how many letters matched and changed, the
outcome of each). A server stopped mid-way leaves the row unfinished (``finished_at_ms`` NULL):
the log never lacks an action that happened, though it may lack the results of one. Each
letter's outcome is kept too, so :func:`fates` can tell a later request for a letter already
gone what became of it. The only SQL on the console's tables; the log is read-only over HTTP.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, insert, select, update

from outbox_relay.shared.db import now_ms
from outbox_relay.shared.db_errors import translate_errors
from outbox_relay.shared.schema import console_action_letters as letters_table
from outbox_relay.shared.schema import console_actions as actions_table

DETAIL_CHARS = 500  # the column's width: a handler's long error message is cut to it


@dataclass(frozen=True)
class LetterOutcome:
    """What one action did to one letter: ``outcome`` is a word (applied, duplicate, purged,
    already_replayed, failed …); ``changed`` says whether the letter left its dead-letter stream
    by this action."""

    letter_id: str
    outcome: str
    detail: str = ""
    changed: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"id": self.letter_id, "outcome": self.outcome, "detail": self.detail,
                "changed": self.changed}


@dataclass(frozen=True)
class Fate:
    """The last action that took a letter out of its dead-letter stream."""

    action_seq: int
    action: str
    outcome: str
    caller: str
    at_ms: int


def begin(engine: Engine, caller: str, action: str, target: dict[str, Any]) -> int:
    """Record that ``caller`` asks for ``action`` on ``target`` now; the action's number."""
    with translate_errors(), engine.begin() as conn:
        result = conn.execute(insert(actions_table).values(
            at_ms=now_ms(), caller=caller, action=action,
            target=json.dumps(target, sort_keys=True)))
        key = result.inserted_primary_key
    assert key is not None
    return int(key[0])


def finish(engine: Engine, seq: int, matched: int, outcomes: Sequence[LetterOutcome]) -> None:
    """Complete action ``seq``: how many letters matched, what happened to each."""
    counts = Counter(o.outcome for o in outcomes)
    with translate_errors(), engine.begin() as conn:
        if outcomes:
            conn.execute(insert(letters_table), [
                {"action_seq": seq, "letter_id": o.letter_id, "outcome": o.outcome,
                 "detail": o.detail[:DETAIL_CHARS]} for o in _unique(outcomes)])
        conn.execute(update(actions_table).where(actions_table.c.seq == seq).values(
            matched=matched, changed=sum(o.changed for o in outcomes),
            outcomes=json.dumps(dict(sorted(counts.items()))), finished_at_ms=now_ms()))


REMOVING = {"replay": ("applied", "duplicate"), "purge": ("purged",)}
"""The outcomes by which an action took a letter out of its stream."""


def fates(engine: Engine, letter_ids: Iterable[str]) -> dict[str, Fate]:
    """For each of ``letter_ids`` the console removed, the last action that removed it."""
    ids = list(dict.fromkeys(letter_ids))
    if not ids:
        return {}
    removing = [o for outcomes in REMOVING.values() for o in outcomes]
    query = (select(letters_table.c.letter_id, letters_table.c.outcome, actions_table.c.seq,
                    actions_table.c.action, actions_table.c.caller, actions_table.c.at_ms)
             .join(actions_table, actions_table.c.seq == letters_table.c.action_seq)
             .where(letters_table.c.letter_id.in_(ids), letters_table.c.outcome.in_(removing))
             .order_by(actions_table.c.seq))
    with translate_errors(), engine.connect() as conn:
        rows = conn.execute(query).all()
    return {r.letter_id: Fate(int(r.seq), r.action, r.outcome, r.caller, int(r.at_ms))
            for r in rows}  # ordered by seq: the last one wins


def recent(engine: Engine, *, limit: int = 50, before: int | None = None) -> list[dict[str, Any]]:
    """The newest actions first (those numbered below ``before``, if given)."""
    query = select(actions_table).order_by(actions_table.c.seq.desc()).limit(limit)
    if before is not None:
        query = query.where(actions_table.c.seq < before)
    with translate_errors(), engine.connect() as conn:
        rows = conn.execute(query).all()
    return [_action(r) for r in rows]


def one(engine: Engine, seq: int) -> dict[str, Any] | None:
    """Action ``seq`` with each letter's outcome, or ``None``."""
    with translate_errors(), engine.connect() as conn:
        row = conn.execute(select(actions_table).where(actions_table.c.seq == seq)).first()
        if row is None:
            return None
        letters = conn.execute(select(letters_table).where(letters_table.c.action_seq == seq)
                               .order_by(letters_table.c.letter_id)).all()
    return {**_action(row), "letters": [
        {"id": r.letter_id, "outcome": r.outcome, "detail": r.detail} for r in letters]}


def _action(r: Any) -> dict[str, Any]:
    return {"seq": int(r.seq), "at_ms": int(r.at_ms), "caller": r.caller, "action": r.action,
            "target": json.loads(r.target), "matched": r.matched, "changed": r.changed,
            "outcomes": json.loads(r.outcomes) if r.outcomes else None,
            "finished_at_ms": r.finished_at_ms}


def _unique(outcomes: Sequence[LetterOutcome]) -> list[LetterOutcome]:
    """One row per letter (an id asked for twice in one request is done once)."""
    return list({o.letter_id: o for o in outcomes}.values())
