"""Broker data-loss repair: put lost entries back from the outbox under their original ids.

Redis can lose acknowledged writes: a restart without persistence (everything gone), an AOF
that had not reached the disk, a failover to a lagging replica. The outbox still knows every
delivered row and the entry id Redis accepted it under, so a stream is *behind* when:

* it is missing while the outbox delivered rows to it;
* its last generated id is older than the newest delivered id; or
* it has added fewer entries over its life (``XINFO STREAM`` ``entries-added``) than the outbox
  delivered to it: this catches a loss that was followed by newer appends.

Two repairs. Both write only through fenced scripts (:mod:`relay.repair_streams`): a relay
whose partition was taken over changes nothing and gets :class:`LeaseLostError`, checked in
Redis atomically with each write. Neither creates a duplicate, removes an entry it did not put
there, or loses a consumer group:

* **refill** when nothing at or below the stream's top is missing: ``XADD`` every delivered row
  above the top, in entry id order, with its original id, ``chunk`` rows per script. Redis
  refuses any id that is not above the top, so a row cannot land twice; groups and their
  pending lists are untouched.
* **rebuild** otherwise (newer entries were appended after the loss): the outbox's delivered
  rows and the entries the stream holds now are merged in id order (one entry per id, the
  stream's own copy kept) into a temporary key, ``chunk`` entries per script; one last script
  checks the stream did not change meanwhile, moves every consumer group with its pending
  entries list onto the rebuilt stream and swaps it in. A group that had read past a restored
  entry is rewound to just before it, so the restored entries are delivered to it.

**Foreign entries.** The relay assigns every id in a take that records it on the partition's
lease row (``last_entry_id``) before any ``XADD``, so no entry it appended is above that id.
An entry above it that no outbox row holds as its entry id was written by someone else (a
careless ``XADD``, the maximum id, an id far in the future); one also ahead of the clock is
above the ids the relay takes next (``<now ms>-<seq>``), so every append of the partition
would be refused. The check reads the stream first and the lease row after, so an entry the
relay appended is never taken for foreign. Foreign entries are moved (:func:`settle_foreign`,
through the fenced :func:`rebuild`, which leaves them out) to the stream's dead-letter stream
with reason ``foreign_entry`` and their original ids and fields, the stream's last id goes
back to its own entries, and groups that had read past it are set back; appends resume at
the next round. A stream whose last id alone was raised (its foreign entry deleted) is
adopted when near the clock (:data:`ADOPT_AHEAD_MS`: ids continue above it), else set back
the same way. Foreign entries behind the clock halt nothing (the relay's next ids pass
them): they stay, for the consumers to dead-letter (invalid, unsigned) as before.

Only rows at or above the stream's **trim floor** count, are compared and are put back: what
:mod:`relay.trim` removed because every group had acknowledged it is never re-added. A stream
whose every delivered entry was trimmed and then lost gets its last id raised back instead.

**Where it runs.** The periodic check (:meth:`Repairer.screen`, every
:data:`REPAIR_INTERVAL_S`) runs on a thread of its own while the relay appends: on the relay's
thread its reads held every round 25-40 ms each time (the tail of the relay's latency at a
steady rate). It only reads, in the order that keeps a stream in step from ever looking behind
or foreign while appends go on (the outbox before the stream, the lease row after it), and
anything it finds asks for the full check (:meth:`Repairer.run`) at the relay thread's next
round, which reads again and repairs. That full check also runs when the relay wins a
partition, and when an append finds a stream behind (:meth:`Repairer.check_soon`). Every
check that may write holds :attr:`Repairer.lock`, which the stream trim (relay/trim.py, also
off the relay thread) holds too: a trim never runs in the middle of a rebuild.

Its SQL is in :mod:`relay.repair_store`, its Redis commands in :mod:`relay.repair_streams`.
"""

from __future__ import annotations

import heapq
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import redis
from sqlalchemy import Engine

from outbox_relay.relay import append, entry_ids, outgoing, repair_store
from outbox_relay.relay import repair_streams as streams
from outbox_relay.relay.leases import renew_lease
from outbox_relay.relay.repair_streams import Entry, StreamState
from outbox_relay.shared import keys
from outbox_relay.shared.db import now_ms
from outbox_relay.shared.errors import LeaseLostError
from outbox_relay.shared.settings import RelaySettings
from outbox_relay.shared.signing import Signer

log = logging.getLogger(__name__)

REPAIR_INTERVAL_S = 5.0
ADOPT_AHEAD_MS = 24 * 3_600_000
"""A stream's last id raised above the relay's ids with no entry there (a foreign entry,
deleted) is adopted, the relay's ids continuing above it, when at most this far ahead of the
clock; beyond it, the ids could run out (``18446744073709551615-…``) or stay far in the future,
so it is set back to the stream's own entries instead."""
CHUNK = 500  # entries per script: a few ms of Redis time, far below any lease


@dataclass(frozen=True)
class Finding:
    """One ``(stream, partition)`` compared with the outbox; ``reason`` is None when in step."""

    stream: str
    partition: int
    key: str
    fence: str
    delivered: int
    newest: str | None
    state: StreamState
    reason: str | None
    dead: str = ""  # its dead-letter stream (shared/keys.py)


@dataclass
class RepairStats:
    """Counters since start: checks, streams found behind, entries appended back; rebuilds
    dropped because the stream changed meanwhile (retried at the next check); repairs refused
    by the fence; foreign entries moved to the dead-letter stream and foreign stream tops
    set back or adopted."""

    checks: int = 0
    behind: int = 0
    refills: int = 0
    rebuilds: int = 0
    repaired_entries: int = 0
    changed: int = 0
    fenced: int = 0
    foreign_entries: int = 0
    foreign_tops: int = 0
    refused: int = 0  # repairs Redis refused (OOM, ACL): retried at the next check
    findings: list[Finding] = field(default_factory=list)


def compare(
    engine: Engine, client: redis.Redis, prefix: str, stream: str, partition: int, delivered: int
) -> Finding:
    """Compare one stream with what the outbox delivered to it; say why it is behind."""
    key = keys.stream_key(prefix, stream, partition)
    state = streams.stream_state(client, key)
    # Even with nothing above the trim floor: a stream trimmed to nothing and then lost must
    # get its last id back before anything newer is appended.
    newest = repair_store.newest_delivered_id(engine, stream, partition)
    reason = behind(delivered, newest, state)
    fence = keys.fence_key(prefix, stream, partition)
    dead = keys.dead_letter_key(prefix, stream, partition)
    return Finding(stream, partition, key, fence, delivered, newest, state, reason, dead)


def behind(delivered: int, newest: str | None, state: StreamState) -> str | None:
    """Why a stream is behind what the outbox delivered to it (``delivered`` rows at or
    above its floor, ``newest`` delivered id), or None: the one rule of :func:`compare` and
    :meth:`Repairer.screen`."""
    if delivered and not state.exists:
        return "stream_missing"
    if newest is not None and entry_ids.greater(newest, state.top):
        return "top_behind"
    if state.entries_added < delivered:
        return "entries_lost"
    return None


def repair(
    engine: Engine, client: redis.Redis, finding: Finding, *, epoch: int, maxlen: int = 0,
    chunk: int = CHUNK, signer: Signer | None = None,
) -> tuple[str, int]:
    """Bring one behind stream back in step as the owner of ``epoch``.

    Returns ``("refill" | "rebuild", entries put back)``, or ``("changed", n)`` when the stream
    changed during a rebuild (nothing replaced, ``n`` refilled before it; the next check starts
    over). Raises
    :class:`LeaseLostError`, having changed nothing since its last completed chunk, when a
    newer owner raised the fence. A refill that meets an id at or below the top (appended
    meanwhile) falls back to a rebuild.
    """
    top = finding.state.top
    above = repair_store.delivered_rows(engine, finding.stream, finding.partition, after=top)
    at_or_below = finding.delivered - len(above)
    present = finding.state.entries_added if maxlen else finding.state.length
    added = 0
    if present >= at_or_below:
        added = refill(client, finding, epoch, above, chunk, signer)
        if added == len(above):
            if not above and finding.newest is not None:  # all trimmed on purpose, then lost
                streams.raise_top(client, finding.key, finding.fence, epoch, finding.newest)
            return "refill", added
    rows = repair_store.delivered_rows(engine, finding.stream, finding.partition)
    restored = rebuild(client, finding, epoch, rows, maxlen, chunk, signer)
    if restored is None:
        return "changed", added
    log.warning("repair: rebuild %s (%s): %d entries appended back under their original ids",
                finding.key, finding.reason, restored)
    return "rebuild", added + restored


def refill(
    client: redis.Redis, finding: Finding, epoch: int, rows: Sequence[outgoing.OutboxRow],
    chunk: int = CHUNK, signer: Signer | None = None,
) -> int:
    """Append ``rows`` (above the top, in id order) in fenced chunks; how many landed.

    Stops at the first refused row: what landed is a prefix of ``rows``.
    """
    added = 0
    for start in range(0, len(rows), chunk):
        part = [(r.entry_id, _flat(r, signer)) for r in rows[start : start + chunk]]
        landed, refusal = streams.refill(client, finding.key, finding.fence, epoch, part)
        added += landed
        if landed:  # as each chunk lands: a relay killed before the end still says what it did
            log.warning("repair: refill %s (%s): %d entries appended back under their "
                        "original ids", finding.key, finding.reason, landed)
        if refusal:
            log.info("refill of %s stopped at %s: %s", finding.key, part[landed][0], refusal)
            break
    return added


def rebuild(
    client: redis.Redis, finding: Finding, epoch: int, rows: Sequence[outgoing.OutboxRow],
    maxlen: int = 0, chunk: int = CHUNK, signer: Signer | None = None, *,
    ceiling: str | None = None,
) -> int | None:
    """Rebuild the stream from ``rows`` (all delivered, in id order) and its own entries.

    Returns the entries restored (not in the stream before), or None when the stream changed
    before the swap. With ``maxlen`` only the newest ``maxlen`` entries are restored; no entry
    the stream holds is dropped, but for those above a ``ceiling`` (foreign, see
    :func:`settle_foreign`): the swap moves them to the dead-letter stream, and the stream's
    last id goes back to its own entries (never below the newest delivered id).
    """
    before = streams.begin_rebuild(client, finding.key, finding.fence, epoch)
    current = streams.read_entries(client, finding.key, before.top, chunk) if before.exists else []
    if ceiling is not None:
        current = [e for e in current if not entry_ids.greater(e.id, ceiling)]
    merged = merge(rows, current, signer)
    cut = len(merged) - maxlen if maxlen else 0
    keep = [e for i, e in enumerate(merged) if i >= cut or not e.restored]
    for start in range(0, len(keep), chunk):
        streams.add_to_rebuild(client, finding.key, finding.fence, epoch,
                               keep[start : start + chunk])
    first = next((i for i, e in enumerate(merged) if e.restored and i >= cut), None)
    top = max(before.top, keep[-1].id if keep else entry_ids.ZERO, key=entry_ids.parse)
    if ceiling is not None:  # foreign entries go: back to our own entries and delivered ids
        own = [keep[-1].id if keep else entry_ids.ZERO, finding.newest or entry_ids.ZERO]
        top = min(top, max(own, key=entry_ids.parse), key=entry_ids.parse)
    moved = streams.swap(
        client, finding.key, finding.fence, epoch, before,
        length=len(keep),
        top=top,
        entries_added=max(before.entries_added, len(merged)),
        first_restored="" if first is None else merged[first].id,
        rewind_to=merged[first - 1].id if first else entry_ids.ZERO,
        ceiling=ceiling or "", dead_key=finding.dead, now_ms=now_ms(),
    )
    if moved is None:
        log.warning("rebuild of %s dropped: the stream changed meanwhile", finding.key)
        return None
    log.info("rebuild of %s kept %d groups and %d pending entries", finding.key, *moved)
    return sum(1 for e in keep if e.restored)


def merge(rows: Iterable[outgoing.OutboxRow], current: Iterable[Entry],
          signer: Signer | None = None) -> list[Entry]:
    """Delivered ``rows`` and the stream's ``current`` entries (both in id order) as one list
    in id order, one entry per id: the stream's own copy wins over the outbox's."""
    restored = (Entry(r.entry_id, _flat(r, signer), restored=True) for r in rows)
    out: list[Entry] = []
    for entry in heapq.merge(current, restored, key=lambda e: entry_ids.parse(e.id)):
        if not out or out[-1].id != entry.id:
            out.append(entry)
    return out


def settle_foreign(
    engine: Engine, client: redis.Redis, finding: Finding, *, node_id: str, epoch: int,
    ttl_ms: int, maxlen: int = 0, chunk: int = CHUNK, signer: Signer | None = None,
) -> tuple[int, str] | None:
    """Settle a stream whose last id is above every id the relay assigned in its partition
    (``finding`` read the stream **before** this reads the lease row, so every entry the
    relay appended is at or below that id). Returns None when nothing is foreign, else
    ``(entries moved, "moved" | "adopted" | "changed")``.

    Entries above the ceiling (the last assigned id, or the greatest id above it an outbox
    row holds) and ahead of the clock (the relay's next ids could not pass them; one behind
    the clock halts nothing and is left to the consumers) are moved to the dead-letter stream
    by a :func:`rebuild` that leaves them out (the lease-fenced rebuild of lost data;
    "changed": the stream changed meanwhile, the next check starts over). A last id with no
    entry above the ceiling is adopted when within :data:`ADOPT_AHEAD_MS` of the clock, else
    set back the same way. Raises :class:`LeaseLostError` when the lease is gone."""
    state, partition = finding.state, finding.partition
    last = repair_store.last_assigned(engine, partition)
    if not entry_ids.greater(state.top, last):
        return None
    above = streams.entry_ids_above(client, finding.key, last)
    ours = repair_store.accounted_ids(engine, finding.stream, partition, above)
    ceiling = max([last, *ours], key=entry_ids.parse)
    if ceiling != last:  # ids an outbox row holds (an earlier relay version's): ours
        repair_store.raise_last_assigned(engine, partition, node_id, epoch, ttl_ms, ceiling)
    # Entries below the clock are passed by the relay's next ids (``<now ms>-<seq>``, relay/
    # entry_ids.py): they halt nothing and stay for the consumers (which dead-letter what is
    # invalid or unsigned). Only those the relay's ids cannot pass are moved.
    now = now_ms()
    passed = [i for i in above if entry_ids.parse(i)[0] < now]
    if passed and entry_ids.greater(passed[-1], ceiling):
        ceiling = passed[-1]
    foreign = [i for i in above if entry_ids.greater(i, ceiling)]
    if not foreign:
        if not entry_ids.greater(state.top, ceiling):
            return None
        if entry_ids.parse(state.top)[0] <= now + ADOPT_AHEAD_MS:
            repair_store.raise_last_assigned(engine, partition, node_id, epoch, ttl_ms, state.top)
            log.warning("repair: %s: its last id %s is above every id the relay assigned "
                        "(%s) but holds no entry there; the relay's ids continue above it",
                        finding.key, state.top, ceiling)
            return 0, "adopted"
    renew_lease(engine, partition, node_id, epoch, ttl_ms)
    rows = repair_store.delivered_rows(engine, finding.stream, partition)
    if rebuild(client, finding, epoch, rows, maxlen, chunk, signer, ceiling=ceiling) is None:
        log.warning("repair of %s (foreign_entry) starts over: the stream changed meanwhile",
                    finding.key)
        return 0, "changed"
    log.error("repair: %s held %d foreign entries above the relay's last id %s (its last id "
              "was %s): moved to %s as foreign_entry, groups that read past them set back; "
              "appends resume", finding.key, len(foreign), ceiling, state.top, finding.dead,
              extra={"stream": finding.stream, "partition": partition, "error": "foreign_entry",
                     "count": len(foreign)})
    return len(foreign), "moved"


def _ahead_of_us(top: str, last: str) -> bool:
    """A stream's last id above every id the relay assigned and ahead of the clock: what
    :func:`settle_foreign` acts on (a foreign top behind the clock halts nothing)."""
    return entry_ids.greater(top, last) and entry_ids.parse(top)[0] >= now_ms()


def _nothing() -> None:
    """No one to tell (a Repairer without a relay loop)."""


def _flat(row: outgoing.OutboxRow, signer: Signer | None = None) -> list[bytes | str]:
    """A row's fields as the relay appends them (signed with ``OUTBOX_SIGNING_KEY``)."""
    return [part for pair in append.to_fields(row, signer).items() for part in pair]

class Repairer:
    """Runs the check on the relay's own partitions: at start, then every ``interval_s``."""

    def __init__(
        self,
        settings: RelaySettings,
        engine: Engine,
        client: redis.Redis,
        node_id: str,
        interval_s: float = REPAIR_INTERVAL_S,
        lock: threading.Lock | None = None,
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.client = client
        self.node_id = node_id
        self.signer = Signer.from_setting(settings.signing_key.get_secret_value())
        self.interval_s = interval_s  # of the periodic screen (the relay's housekeeping)
        self.stats = RepairStats()
        # Held by every full check (it may rebuild a stream) and by the stream trim.
        self.lock = lock or threading.Lock()
        # Called when a check is wanted from another thread (the relay wakes its loop).
        self.on_wanted: Callable[[], None] = _nothing
        # Stream key -> the newest entry id the outbox says the stream holds: the relay's
        # append refuses to write above a stream whose last id is below it (Redis lost data;
        # appending first would let consumers read newer events before the refilled older
        # ones). Set by every check, raised by every append (relay/append.py).
        self.floors: dict[str, str] = {}
        self._next_check = 0.0  # monotonic; 0: the full check runs at the next round
        self._checked: dict[int, int] = {}
        # (stream, partition) of every known stream of our partitions at the last check (the
        # settles register them: outbox_stream_trims): the streams the relay trims.
        self.streams: set[tuple[str, int]] = set()
        self._asked: set[tuple[str, int]] = set()  # streams to check even if not known

    def check_soon(self, stream: tuple[str, int] | None = None) -> None:
        """Run the full check at the next round (an append found a stream behind its floor,
        or behind a top above its ids: ``stream``, checked even if it is not known yet; the
        screen found something). Any thread."""
        if stream is not None:
            self._asked.add(stream)
        self._next_check = 0.0
        self.on_wanted()

    def due(self, now: float) -> bool:
        """Whether the full check runs at the next round (at ``now``, monotonic)."""
        return now >= self._next_check

    def maybe_run(self, leases: dict[int, int]) -> int:
        """The full check (and repairs) of our partitions when asked for
        (:meth:`check_soon`), and at once for a partition newly leased (so its floors are
        known before its first append); returns entries appended back. The periodic check
        is :meth:`screen`, off the relay thread."""
        new = any(self._checked.get(p) != e for p, e in leases.items())
        if (time.monotonic() < self._next_check and not new) or not leases:
            return 0
        # Disarmed before the check: one asked for while it runs runs again next round; one
        # that fails (the database or Redis unavailable) is asked for again.
        self._next_check = math.inf
        try:
            added = self.run(leases)
        except BaseException:
            self._next_check = 0.0
            raise
        self._checked = dict(leases)
        return added

    def screen(self, leases: dict[int, int]) -> bool:
        """The periodic check, read only, while the relay appends (a background housekeeping
        task: see the module docstring); True when it asked for the full check.

        Reads per stream, in this order: what the outbox delivered (the count at or above
        the floor, the newest delivered id), then the stream, then the lease row's last
        assigned id. A relay appends to the stream before it marks the rows delivered and
        records the ids before it appends, so a stream in step read after the outbox holds
        at least what was delivered (:func:`behind` is None) and no id above the last
        assigned id read after it; a stream found behind or with a foreign top asks for
        :meth:`run` at the next round, which reads again on the relay thread and repairs.
        It writes nothing, floors included (the appends raise them, the full check sets them):
        a floor written from this thread could land below one an append just raised.

        A top above the last assigned id counts only when it is ahead of the clock: one behind
        it halts nothing (the relay's next ids pass it) and the full check would leave it, as
        :func:`settle_foreign` does, so asking for it would run that check every interval."""
        if not leases:
            return False
        self.stats.checks += 1  # as a full check: what operators count is "checked"
        counts = repair_store.delivered_counts(self.engine, sorted(leases))
        self.streams = set(counts)
        for (stream, partition), delivered in sorted(counts.items()):
            newest = repair_store.newest_delivered_id(self.engine, stream, partition)
            key = keys.stream_key(self.settings.key_prefix, stream, partition)
            state = streams.stream_state(self.client, key)
            last = repair_store.last_assigned(self.engine, partition)
            if behind(delivered, newest, state) is not None or _ahead_of_us(state.top, last):
                log.debug("repair check: %s needs a look on the relay thread", key)
                self.check_soon()
                return True
        return False

    def run(self, leases: dict[int, int]) -> int:
        """Check every stream of the given ``{partition: epoch}`` leases and repair what lags
        (holding :attr:`lock`: no stream trim meanwhile)."""
        with self.lock:
            return self._run(leases)

    def _run(self, leases: dict[int, int]) -> int:
        s = self.settings
        self.stats.checks += 1
        counts = repair_store.delivered_counts(self.engine, sorted(leases))
        self.streams = set(counts)
        asked = set(self._asked)  # forgotten once this check has run (not if it fails)
        for pair in asked:
            if pair[1] in leases:
                counts.setdefault(pair, 0)
        added = 0
        for partition in sorted(leases):
            self._reset_unreachable(partition, leases[partition])
        for (stream, partition), delivered in sorted(counts.items()):
            finding = compare(self.engine, self.client, s.key_prefix, stream, partition, delivered)
            try:
                if self._foreign(finding, leases[partition]):  # read again: it changed
                    finding = compare(self.engine, self.client, s.key_prefix, stream, partition,
                                      delivered)
            except LeaseLostError:
                self.stats.fenced += 1
                log.warning("repair of %s skipped: partition lease lost", finding.key)
                continue
            except redis.ResponseError as err:  # refused (OOM, ACL …): the next check retries
                log.warning("repair of %s (foreign_entry) refused by Redis: %s", finding.key,
                            append.error_code(err), extra={"error": append.error_code(err)})
                continue
            if finding.newest is not None:
                self.floors[finding.key] = finding.newest
            if finding.reason is None:
                continue
            added += self._repair_one(finding, leases[partition])
        self._asked -= asked
        return added

    def _repair_one(self, finding: Finding, epoch: int) -> int:
        """Repair one stream found behind, as the owner of ``epoch``; entries appended back.
        A lost lease, or Redis refusing the repair (OOM at maxmemory, an ACL without the
        repair's commands), is logged and left to the next check: nothing is appended to
        this stream above its hole meanwhile (its appends answer BEHIND), others go on."""
        s = self.settings
        try:
            renew_lease(self.engine, finding.partition, self.node_id, epoch,
                              s.lease_ttl_ms)
        except LeaseLostError:
            log.warning("repair of %s skipped: partition lease lost", finding.key)
            return 0
        try:
            how, n = repair(self.engine, self.client, finding, epoch=epoch,
                            maxlen=s.stream_maxlen_unsafe, signer=self.signer)
        except LeaseLostError:
            self.stats.fenced += 1
            log.warning("repair of %s stopped: a newer relay owns the stream", finding.key)
            return 0
        except redis.ResponseError as err:
            self.stats.refused += 1
            log.warning("repair of %s (%s) refused by Redis: %s; retried at the next check",
                        finding.key, finding.reason, append.error_code(err),
                        extra={"stream": finding.stream, "partition": finding.partition,
                               "error": append.error_code(err)})
            return 0
        self._record(finding, how, n)
        return n

    def _reset_unreachable(self, partition: int, epoch: int) -> None:
        """:func:`relay.repair_store.reset_unreachable_last`: a lease row an earlier version left
        out of reach (it adopted a foreign maximum id) gets a last id new batches can follow."""
        try:
            reset = repair_store.reset_unreachable_last(self.engine, partition, self.node_id, epoch,
                                                 self.settings.lease_ttl_ms)
        except LeaseLostError:
            return
        if reset is not None:
            log.error("repair: partition %s: its last assigned id %s was out of reach (a "
                      "foreign stream top adopted by an earlier version); set back to %s",
                      partition, *reset, extra={"partition": partition, "error": "foreign_entry"})

    def _foreign(self, finding: Finding, epoch: int) -> bool:
        """:func:`settle_foreign` on one stream; whether it changed the stream or the lease."""
        s = self.settings
        settled = settle_foreign(self.engine, self.client, finding, node_id=self.node_id,
                                 epoch=epoch, ttl_ms=s.lease_ttl_ms,
                                 maxlen=s.stream_maxlen_unsafe, signer=self.signer)
        if settled is None:
            return False
        moved, how = settled
        if how == "changed":
            self.stats.changed += 1
            self.check_soon()
            return False
        self.stats.foreign_tops += 1
        self.stats.foreign_entries += moved
        return True

    def _record(self, finding: Finding, how: str, n: int) -> None:
        self.stats.behind += 1
        self.stats.repaired_entries += n
        if how == "changed":
            self.stats.changed += 1
        elif how == "refill":
            self.stats.refills += 1
        else:
            self.stats.rebuilds += 1
        self.stats.findings.append(finding)
        del self.stats.findings[:-100]
        if how == "changed":  # refill() and repair() logged what landed, as it landed
            log.warning("repair of %s (%s) starts over: the stream changed during the rebuild",
                        finding.key, finding.reason)
