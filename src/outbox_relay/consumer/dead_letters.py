"""Dead letters: list, show and replay what consumers set aside.

The consumer copies an entry it cannot handle to its partition's dead-letter stream
(``prefix:{stream:partition}:dead``, see :mod:`shared.keys`) with the original fields plus
``dlq.*`` fields saying why (``dlq.reason`` is a reason code), where from (``dlq.stream``,
``dlq.entry_id``), for which group and after how many deliveries. This module says what letters
mean and what an operator may do with them; the Redis commands it sends on those streams
(``SCAN``, ``XRANGE``, ``XDEL``) are in :mod:`consumer.letter_streams`, and the one SQL statement
of a replay besides its claim (:func:`consumer.claim_writes.reopen_dead_receipt`) with the
claim's writes.

**Replay claims directly; it does not ``XADD`` the entry back.** Re-adding the fields to the
partition stream would be wrong three ways: the stream would hold the event twice (invariant 2:
each event at most once per stream, which repair and the torture check rely on); an auto id
would jump the stream's top ahead of the relay's explicit ids (its next ``XADD`` would be
refused and counted as an ordering gap); and every *other* group of the stream, which handled
the event long ago, would receive it again. Instead replay parses the original fields and runs
them through :func:`consumer.inbox.claim` for the letter's own group, exactly as the consumer
would, with one difference: **replay is an operator's decision, so it applies the event
whatever the aggregate's head says** (an ``out_of_order`` letter is applied, never
``superseded``; the head is never lowered by it). An event already in the inbox is a
``duplicate``; otherwise its handler runs in a savepoint and the ``applied`` receipt commits
with its writes. So replaying twice, or racing a live consumer, applies the event at most once.

One subtlety: for ``unknown_type``, ``max_deliveries`` and ``out_of_order`` letters the claim
already wrote a ``dead`` receipt, which would make the replay a mere ``duplicate``. Replay
therefore deletes a ``dead`` receipt of that event (or a ``lost`` one: an entry that vanished
while pending, whose letter carries what the outbox knew; never any other outcome) just before
claiming. If the claim then fails, the letter is still in its stream, so a record of the event
always exists.

Only after the claim committed (``applied`` or ``duplicate``) is the letter deleted with
``XDEL``: the inbox receipt, which keeps the original stream key and entry id, is now the
record, and a letter that stays listed would only invite a second (harmless, but confusing)
replay. Letters that still do not parse, have no handler, or whose handler fails stay put.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import redis
from sqlalchemy import Engine

from outbox_relay.consumer import claim_writes, inbox, letter_streams
from outbox_relay.consumer.handlers import Handlers
from outbox_relay.consumer.letter_streams import dead_keys
from outbox_relay.consumer.streams import text
from outbox_relay.shared import keys
from outbox_relay.shared.envelope import DEFAULT_MAX_DATA_BYTES, Event
from outbox_relay.shared.errors import (
    ConfigError,
    InvalidEventError,
    InvalidRequestError,
    NotFoundError,
)

log = logging.getLogger(__name__)

META = "dlq."
SETTLED = (inbox.APPLIED, inbox.DUPLICATE)


@dataclass(frozen=True)
class DeadLetter:
    """One entry of a dead-letter stream: the original fields and the ``dlq.*`` record."""

    key: str  # the dead-letter stream
    dead_id: str  # the letter's own entry id in that stream
    stream: str
    partition: int
    fields: dict[bytes, bytes]  # the original entry, exactly as read (``dlq.*`` removed)
    meta: dict[str, str]  # ``dlq.*`` without the prefix: reason, message, stream, entry_id, …

    @property
    def letter_id(self) -> str:
        """What ``outbox dlq show/replay`` take: ``stream:partition:dead-entry-id``."""
        return f"{self.stream}:{self.partition}:{self.dead_id}"

    @property
    def reason(self) -> str:
        """The reason code (``missing_field``, ``unknown_type``, ``max_deliveries``,
        ``out_of_order`` (with ``dlq.revision`` and ``dlq.head``), ``trimmed``, ``oversized``
        (with ``dlq.size`` and no original fields) …)."""
        return self.meta.get("reason", "unknown")

    @property
    def group(self) -> str:
        """The consumer group that gave up on the entry."""
        return self.meta.get("group", "")

    def to_json(self) -> dict[str, Any]:
        """A JSON-safe view; field bytes that are not UTF-8 are shown backslash-escaped."""
        return {
            "id": self.letter_id,
            "dead_letter_key": self.key,
            "reason": self.reason,
            "message": self.meta.get("message", ""),
            "stream_key": self.meta.get("stream", ""),
            "entry_id": self.meta.get("entry_id", ""),
            "group": self.group,
            "consumer": self.meta.get("consumer", ""),
            "deliveries": int(self.meta.get("deliveries", "0") or 0),
            **{k: self.meta[k] for k in ("revision", "head") if k in self.meta},
            "time_ms": int(self.meta.get("time_ms", "0") or 0),
            "fields": {_show(k): _show(v) for k, v in self.fields.items()},
        }


@dataclass(frozen=True)
class Replayed:
    """What replay did with one letter; ``removed`` says whether it left the DLQ."""

    letter_id: str
    outcome: str  # applied | duplicate | failed | invalid | skipped
    detail: str = ""
    removed: bool = False


def list_letters(
    client: redis.Redis,
    prefix: str,
    *,
    stream: str | None = None,
    partition: int | None = None,
    count: int = 50,
) -> list[DeadLetter]:
    """Up to ``count`` letters, oldest first within each dead-letter stream."""
    out: list[DeadLetter] = []
    for key in dead_keys(client, prefix, stream, partition):
        if len(out) >= count:
            break
        out += _read(client, prefix, key, "-", count - len(out))
    return out


def show(client: redis.Redis, prefix: str, letter_id: str) -> DeadLetter:
    """The letter ``stream:partition:entry-id`` (or a bare entry id, if only one stream has it)."""
    stream, partition, dead_id = parse_letter_id(letter_id)
    found = [
        letter
        for key in dead_keys(client, prefix, stream, partition)
        for letter in _read(client, prefix, key, dead_id, 1, end=dead_id)
    ]
    if not found:
        raise NotFoundError(f"no dead letter {letter_id!r}")
    if len(found) > 1:
        raise InvalidRequestError(
            f"{letter_id!r} names letters in {len(found)} streams; use stream:partition:id"
        )
    return found[0]


def parse_letter_id(text: str) -> tuple[str | None, int | None, str]:
    """``runs:0:1700000000000-0`` → ``("runs", 0, "1700000000000-0")``; a bare id → Nones."""
    head, _, dead_id = text.rpartition(":")
    stream, _, part = head.rpartition(":")
    if not _is_entry_id(dead_id) or (head and not (stream and _is_number(part))):
        raise InvalidRequestError(
            f"{text!r} is not a dead letter id (stream:partition:ms-seq, as `dlq list` prints)"
        )
    if not head:
        return None, None, dead_id
    try:
        return keys.check_name("stream", stream), int(part), dead_id
    except ConfigError:
        raise InvalidRequestError(f"{stream!r} is not a stream name") from None


def replay(
    client: redis.Redis,
    engine: Engine,
    letter: DeadLetter,
    handlers: Handlers,
    *,
    group: str,
    max_data_bytes: int = DEFAULT_MAX_DATA_BYTES,
) -> Replayed:
    """Apply one letter through the claim path of ``group``, whatever the aggregate's head (see
    the module docstring); the letter is deleted only after that claim committed."""
    lid = letter.letter_id
    if letter.group != group:
        return Replayed(lid, "skipped", f"other_group: the letter belongs to {letter.group!r}")
    if letter.reason == "oversized":  # refused from its size: the letter holds no event
        return Replayed(lid, "invalid", "oversized: the entry was never read (dlq.size "
                        f"{letter.meta.get('size', '?')} bytes); there is nothing to replay")
    try:
        event = Event.from_fields(letter.fields, max_data_bytes=max_data_bytes)
    except InvalidEventError as err:
        return Replayed(lid, "invalid", err.code)
    if handlers.get(event.type) is None:
        return Replayed(lid, "skipped", "unknown_type: no handler for this type")
    claim_writes.reopen_dead_receipt(engine, group, event.id)
    delivery = inbox.Delivery(
        letter.meta.get("stream", ""), letter.meta.get("entry_id", ""), event,
        int(letter.meta.get("deliveries", "1") or 1), replay=True,
    )
    (outcome,) = inbox.claim(engine, group, [delivery], handlers)
    if outcome.outcome not in SETTLED:
        return Replayed(lid, outcome.outcome, outcome.error or "")
    remove(client, letter)
    return Replayed(lid, outcome.outcome, "", removed=True)


def replay_all(
    client: redis.Redis,
    engine: Engine,
    prefix: str,
    handlers: Handlers,
    *,
    group: str,
    stream: str | None = None,
    partition: int | None = None,
    max_data_bytes: int = DEFAULT_MAX_DATA_BYTES,
    batch: int = 100,
) -> list[Replayed]:
    """Replay every letter of ``group`` (other groups' letters are skipped, not reported)."""
    results = []
    for letter in _walk(client, prefix, dead_keys(client, prefix, stream, partition), batch):
        if letter.group == group:
            results.append(
                replay(client, engine, letter, handlers, group=group,
                       max_data_bytes=max_data_bytes)
            )
    return results


@dataclass(frozen=True)
class Filter:
    """Which letters an operator means (the console's list, replay and purge): each field
    narrows, ``None`` does not. Ages are read from the letter's own entry id (when it was
    written), as :func:`purge` reads them."""

    stream: str | None = None
    partition: int | None = None
    group: str | None = None
    reason: str | None = None
    type: str | None = None
    older_than_ms: int = 0  # written longer ago than this (0: any)
    newer_than_ms: int = 0  # written more recently than this (0: any)

    def is_empty(self) -> bool:
        """True when the filter selects every letter of every group."""
        return self == Filter()

    def matches(self, letter: DeadLetter, now_ms: int) -> bool:
        """Does ``letter`` pass every condition (stream and partition are the caller's keys)?"""
        written = int(letter.dead_id.partition("-")[0])
        return ((self.group is None or letter.group == self.group)
                and (self.reason is None or letter.reason == self.reason)
                and (self.type is None or letter.fields.get(b"type", b"").decode(
                    "utf-8", "backslashreplace") == self.type)
                and (not self.older_than_ms or written < now_ms - self.older_than_ms)
                and (not self.newer_than_ms or written > now_ms - self.newer_than_ms))


@dataclass(frozen=True)
class Page:
    """One page of :func:`find`: the letters, and where the next page starts (``None``: no
    more). ``scanned`` counts the letters read to fill it, matching or not."""

    letters: list[DeadLetter]
    next_after: str | None
    scanned: int


def find(
    client: redis.Redis,
    prefix: str,
    chosen: Filter,
    *,
    now_ms: int,
    after: str | None = None,
    limit: int = 50,
    max_scan: int = 10_000,
    batch: int = 200,
) -> Page:
    """Letters matching ``chosen``, in the order of :func:`list_letters`, after the letter id
    ``after`` (a previous page's ``next_after``). At most ``limit`` letters, and at most
    ``max_scan`` letters read: a page of a rare reason ends early with a ``next_after`` to go
    on from, so one request never walks a million letters."""
    start_at: tuple[str, int] | None = None
    start_id = "-"
    if after is not None:
        stream, partition, dead_id = parse_letter_id(after)
        if stream is None or partition is None:
            raise InvalidRequestError("after must be a full letter id (stream:partition:id)")
        start_at, start_id = (stream, partition), f"({dead_id}"
    found: list[DeadLetter] = []
    scanned = 0
    last: DeadLetter | None = None
    for key in dead_keys(client, prefix, chosen.stream, chosen.partition):
        at = letter_streams.partition_of(prefix, key)
        if start_at is not None and at is not None and at < start_at:
            continue
        start = start_id if at == start_at else "-"
        while len(found) < limit and scanned < max_scan:
            page = _read(client, prefix, key, start, min(batch, max_scan - scanned))
            for letter in page:
                scanned += 1
                last = letter
                if chosen.matches(letter, now_ms):
                    found.append(letter)
                    if len(found) >= limit:
                        break
            if len(page) < batch or not page:
                break
            start = f"({page[-1].dead_id}"
        if len(found) >= limit or scanned >= max_scan:
            return Page(found, last.letter_id if last else after, scanned)
    return Page(found, None, scanned)


def discard(client: redis.Redis, letter: DeadLetter) -> bool:
    """``XDEL`` the letter; ``False`` when it was already gone (deleted by someone else)."""
    return letter_streams.delete(client, letter.key, letter.dead_id) == 1


def letters_by_group(
    client: redis.Redis, prefix: str, *, stream: str | None = None,
    partition: int | None = None, batch: int = 500,
) -> dict[str, int]:
    """How many letters each group has (``""``: letters that name no group)."""
    counts: dict[str, int] = {}
    for letter in _walk(client, prefix, dead_keys(client, prefix, stream, partition), batch):
        counts[letter.group] = counts.get(letter.group, 0) + 1
    return counts


def purge(
    client: redis.Redis,
    prefix: str,
    *,
    older_than_ms: int,
    now_ms: int,
    group: str | None = None,
    stream: str | None = None,
    partition: int | None = None,
    dry_run: bool = False,
    batch: int = 500,
) -> int:
    """Delete the letters written more than ``older_than_ms`` ago (0: all), of ``group`` if
    given; letters deleted (or, with ``dry_run``, that would be). The event is given up for
    good: its ``dead``/``lost`` receipt stays, so it is never applied, and inbox retention
    prunes that receipt once no letter stands for it."""
    cutoff = now_ms - older_than_ms
    removed = 0
    for key in dead_keys(client, prefix, stream, partition):
        end = f"({cutoff}-0" if older_than_ms else "+"
        start = "-"
        while True:
            page = _read(client, prefix, key, start, batch, end=end)
            chosen = [letter.dead_id for letter in page
                      if group is None or letter.group == group]
            if not dry_run:
                letter_streams.delete(client, key, *chosen)
            removed += len(chosen)
            if len(page) < batch:
                break
            start = f"({page[-1].dead_id}"
    return removed


def remove(client: redis.Redis, letter: DeadLetter) -> None:
    """``XDEL`` the letter from its dead-letter stream."""
    letter_streams.delete(client, letter.key, letter.dead_id)


def _walk(
    client: redis.Redis, prefix: str, dead: list[str], batch: int
) -> Iterator[DeadLetter]:
    """Every letter of the given streams, read in pages, robust to deletes behind the cursor."""
    for key in dead:
        parsed = letter_streams.partition_of(prefix, key)
        if parsed is None:
            continue
        for page in letter_streams.walk(client, key, batch):
            yield from (_letter(key, parsed, dead_id, fields) for dead_id, fields in page)


def _read(
    client: redis.Redis, prefix: str, key: str, start: str, count: int, *, end: str = "+"
) -> list[DeadLetter]:
    parsed = letter_streams.partition_of(prefix, key)
    if parsed is None:
        return []
    return [_letter(key, parsed, dead_id, fields)
            for dead_id, fields in letter_streams.read_range(client, key, start, count, end=end)]


def _letter(
    key: str, parsed: tuple[str, int], dead_id: str, raw: Mapping[bytes, bytes]
) -> DeadLetter:
    meta = {
        text(k)[len(META):]: v.decode("utf-8", "backslashreplace")
        for k, v in raw.items() if k.startswith(META.encode())
    }
    fields = {k: v for k, v in raw.items() if not k.startswith(META.encode())}
    return DeadLetter(key, dead_id, parsed[0], parsed[1], fields, meta)


def _is_entry_id(text: str) -> bool:
    ms, _, seq = text.partition("-")
    return _is_number(ms) and _is_number(seq)


def _is_number(text: str) -> bool:
    """Digits only, and small enough for a stream id part (64 bits)."""
    return text.isascii() and text.isdigit() and len(text) <= 20 and int(text) < 2**64


def _show(value: bytes) -> str:
    return value.decode("utf-8", "backslashreplace")


