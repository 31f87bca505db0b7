"""Replay and purge, by letter id or by filter, each recorded and each safe to repeat.

The work is :mod:`consumer.dead_letters`'s (the same functions as ``outbox dlq replay`` and
``purge``: a replay goes through the letter's group's claim path, so it applies an event at
most once whatever happens); this module adds the record (:mod:`console.action_log`, written
before anything is done) and the answers a repeated request gets:

- a letter still listed whose event was already applied: ``duplicate`` (the inbox's answer;
  nothing runs twice) and the letter is removed;
- a letter gone that the console replayed or purged: ``already_replayed`` / ``already_purged``,
  naming the action, its caller and time; nothing is done;
- a letter gone otherwise (trimmed, or removed by ``outbox dlq``): ``already_gone`` for a purge
  (what was asked for holds), ``not_found`` for a replay (nothing can say it was applied);
- a filter that matches nothing any more: an action with 0 matched.

A letter is replayed with the handlers configured for its own group (``OUTBOX_CONSOLE_APPS``);
a group without them is ``skipped`` and its letter stays.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

import redis
from sqlalchemy import Engine

from outbox_relay.console import action_log
from outbox_relay.console.action_log import LetterOutcome
from outbox_relay.consumer import dead_letters
from outbox_relay.consumer.dead_letters import DeadLetter, Filter
from outbox_relay.consumer.handlers import Handlers
from outbox_relay.shared.db import now_ms
from outbox_relay.shared.envelope import DEFAULT_MAX_DATA_BYTES
from outbox_relay.shared.errors import InvalidRequestError, NotFoundError

MAX_IDS = 500
"""Letter ids one request may name."""
MAX_SCAN = 100_000
"""Letters one filtered action reads at most (the answer says when more may match)."""


@dataclass(frozen=True)
class Letters:
    """Where the letters are and how to replay them: the Redis, database and key prefix of
    ``outbox serve``, the handlers of each group (``OUTBOX_CONSOLE_APPS``)."""

    client: redis.Redis
    engine: Engine
    prefix: str
    handlers: Mapping[str, Handlers]
    max_data_bytes: int = DEFAULT_MAX_DATA_BYTES


@dataclass(frozen=True)
class Done:
    """One recorded action: its number, how many letters it matched, what it did to each,
    and whether the filter may match more than this action took (``limit``)."""

    seq: int
    action: str
    matched: int
    outcomes: list[LetterOutcome]
    more: bool = False

    def to_json(self) -> dict[str, object]:
        return {"action": self.action, "seq": self.seq, "matched": self.matched,
                "changed": sum(o.changed for o in self.outcomes), "more": self.more,
                "results": [o.to_json() for o in self.outcomes]}


def by_ids(letters: Letters, caller: str, action: str, ids: Sequence[str]) -> Done:
    """Replay or purge (``action``) the letters ``ids`` (full ``stream:partition:id``s)."""
    _check_action(action)
    ids = list(dict.fromkeys(ids))
    if not ids or len(ids) > MAX_IDS:
        raise InvalidRequestError(f"name 1 to {MAX_IDS} letter ids")
    for letter_id in ids:
        if dead_letters.parse_letter_id(letter_id)[0] is None:
            raise InvalidRequestError(f"{letter_id!r}: give the full id, stream:partition:id")
    seq = action_log.begin(letters.engine, caller, action, {"ids": ids})
    found: list[DeadLetter] = []
    gone: list[str] = []
    for letter_id in ids:
        try:
            found.append(dead_letters.show(letters.client, letters.prefix, letter_id))
        except NotFoundError:
            gone.append(letter_id)
    outcomes = [_do(letters, action, letter) for letter in found] + _gone(letters, action, gone)
    action_log.finish(letters.engine, seq, len(found), outcomes)
    return Done(seq, action, len(found), outcomes)


def by_filter(letters: Letters, caller: str, action: str, chosen: Filter, *,
              limit: int) -> Done:
    """Replay or purge up to ``limit`` letters matching ``chosen`` (the filter must narrow
    something; the caller checks that an empty one was meant)."""
    _check_action(action)
    seq = action_log.begin(letters.engine, caller, action,
                           {"filter": dataclasses.asdict(chosen), "limit": limit})
    page = dead_letters.find(letters.client, letters.prefix, chosen, now_ms=now_ms(),
                             limit=limit, max_scan=MAX_SCAN)
    outcomes = [_do(letters, action, letter) for letter in page.letters]
    action_log.finish(letters.engine, seq, len(page.letters), outcomes)
    return Done(seq, action, len(page.letters), outcomes, more=page.next_after is not None)


def _do(letters: Letters, action: str, letter: DeadLetter) -> LetterOutcome:
    if action == "purge":
        if dead_letters.discard(letters.client, letter):
            return LetterOutcome(letter.letter_id, "purged", changed=True)
        return LetterOutcome(letter.letter_id, "already_gone", "removed meanwhile")
    handlers = letters.handlers.get(letter.group)
    if handlers is None:
        return LetterOutcome(letter.letter_id, "skipped", f"no handlers for group "
                             f"{letter.group!r} (OUTBOX_CONSOLE_APPS); the letter stays")
    r = dead_letters.replay(letters.client, letters.engine, letter, handlers,
                            group=letter.group, max_data_bytes=letters.max_data_bytes)
    return LetterOutcome(r.letter_id, r.outcome, r.detail, changed=r.removed)


def _gone(letters: Letters, action: str, ids: list[str]) -> list[LetterOutcome]:
    """The answers for letters no longer in their streams (see the module)."""
    known = action_log.fates(letters.engine, ids)
    out = []
    for letter_id in ids:
        fate = known.get(letter_id)
        if fate is not None:
            when = datetime.fromtimestamp(fate.at_ms / 1000, UTC).isoformat(timespec="seconds")
            verb = "replayed" if fate.action == "replay" else "purged"
            out.append(LetterOutcome(letter_id, f"already_{verb}", f"{fate.outcome} by action "
                                     f"{fate.action_seq} of {fate.caller} at {when}"))
        elif action == "purge":
            out.append(LetterOutcome(letter_id, "already_gone", "not in its dead-letter stream"))
        else:
            out.append(LetterOutcome(letter_id, "not_found", "no such dead letter (trimmed, or "
                                     "removed outside the console): nothing to replay"))
    return out


def _check_action(action: str) -> None:
    if action not in action_log.REMOVING:
        raise InvalidRequestError(f"unknown action {action!r}")
