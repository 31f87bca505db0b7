"""Broker data-loss repair: refill a stream from the outbox under the original entry ids.

Redis can lose acknowledged writes: a restart without persistence (everything gone), an AOF
that had not reached the disk, a failover to a lagging replica. The outbox still knows every
delivered row and the entry id Redis accepted it under, so a stream is *behind* when:

* it is missing while the outbox delivered rows to it;
* its last generated id is older than the newest delivered id; or
* it has added fewer entries over its life (``XINFO STREAM`` ``entries-added``) than the outbox
  delivered to it: this catches a loss that was followed by newer appends.

Two repairs, both under the partition lease, and neither can create a duplicate:

* **refill** when nothing at or below the stream's top is missing: ``XADD`` every delivered row
  above the top, in entry id order, with its original id. Redis refuses any id that is not above
  the top, so a row cannot land twice; groups and their pending lists survive.
* **rebuild** otherwise (newer entries were appended after the loss): in one ``MULTI``/``EXEC``,
  ``DEL`` the stream and ``XADD`` every delivered row in id order, then ``XSETID … ENTRIESADDED``.
  Consumer groups go with the old stream; consumers recreate them from ``0`` on ``NOGROUP`` and
  their inboxes absorb what they had applied. A row that was appended but not yet marked is
  appended again by the relay later (its id is then behind the top: an ordering gap, republished
  at the top), never twice in the stream.

All of the repair's Redis commands are in this module; its SQL is in :mod:`relay.store`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import redis
from sqlalchemy import Engine

from relay import append, entry_ids, store
from shared import keys
from shared.db import now_ms
from shared.errors import LeaseLostError
from shared.redis_conn import translate_redis_errors
from shared.settings import RelaySettings

log = logging.getLogger(__name__)

REPAIR_INTERVAL_S = 5.0


@dataclass(frozen=True)
class StreamState:
    """What Redis says about one partition stream (all zero when the key is missing)."""

    exists: bool
    length: int = 0
    top: str = entry_ids.ZERO
    entries_added: int = 0


@dataclass(frozen=True)
class Finding:
    """One ``(stream, partition)`` compared with the outbox; ``reason`` is None when in step."""

    stream: str
    partition: int
    key: str
    delivered: int
    newest: str | None
    state: StreamState
    reason: str | None


@dataclass
class RepairStats:
    """Counters since start: checks, streams found behind, entries appended back."""

    checks: int = 0
    behind: int = 0
    refills: int = 0
    rebuilds: int = 0
    repaired_entries: int = 0
    findings: list[Finding] = field(default_factory=list)


def stream_state(client: redis.Redis, key: str) -> StreamState:
    """``XINFO STREAM`` reduced to what the comparison needs."""
    with translate_redis_errors():
        if not client.exists(key):
            return StreamState(exists=False)
        info: Any = client.xinfo_stream(key)
    top = info.get("last-generated-id", entry_ids.ZERO)
    return StreamState(
        exists=True,
        length=int(info.get("length", 0)),
        top=top.decode() if isinstance(top, bytes) else str(top),
        entries_added=int(info.get("entries-added", info.get("length", 0))),
    )


def compare(
    engine: Engine, client: redis.Redis, prefix: str, stream: str, partition: int, delivered: int
) -> Finding:
    """Compare one stream with what the outbox delivered to it; say why it is behind."""
    key = keys.stream_key(prefix, stream, partition)
    state = stream_state(client, key)
    newest = store.newest_delivered_id(engine, stream, partition) if delivered else None
    reason = None
    if delivered and not state.exists:
        reason = "stream_missing"
    elif newest is not None and entry_ids.greater(newest, state.top):
        reason = "top_behind"
    elif state.entries_added < delivered:
        reason = "entries_lost"
    return Finding(stream, partition, key, delivered, newest, state, reason)


def repair(
    engine: Engine, client: redis.Redis, finding: Finding, maxlen: int = 0
) -> tuple[str, int]:
    """Bring one behind stream back in step; returns ``("refill"|"rebuild", entries added)``.

    The caller holds the partition lease. A refill that meets an id at or below the top (a
    stale relay appended meanwhile) falls back to a rebuild.
    """
    top = finding.state.top
    above = store.delivered_rows(engine, finding.stream, finding.partition, after=top)
    at_or_below = finding.delivered - len(above)
    present = finding.state.entries_added if maxlen else finding.state.length
    if present >= at_or_below:
        added = _refill(client, finding.key, above)
        if added == len(above):
            return "refill", added
    rows = store.delivered_rows(engine, finding.stream, finding.partition)
    return "rebuild", _rebuild(client, finding.key, rows, maxlen)


def _refill(client: redis.Redis, key: str, rows: list[store.OutboxRow]) -> int:
    with translate_redis_errors():
        pipe = client.pipeline(transaction=False)
        for row in rows:
            pipe.xadd(key, append.to_fields(row), id=row.entry_id)  # type: ignore[arg-type]
        answers = pipe.execute(raise_on_error=False)
    for answer in answers:
        if isinstance(answer, redis.ConnectionError | redis.TimeoutError):
            raise answer
    return sum(1 for a in answers if not isinstance(a, Exception))


def _rebuild(client: redis.Redis, key: str, rows: list[store.OutboxRow], maxlen: int) -> int:
    keep = rows[-maxlen:] if maxlen else rows
    with translate_redis_errors():
        pipe = client.pipeline(transaction=True)
        pipe.delete(key)
        for row in keep:
            pipe.xadd(key, append.to_fields(row), id=row.entry_id)  # type: ignore[arg-type]
        if keep:
            pipe.execute_command(  # type: ignore[no-untyped-call]
                "XSETID", key, keep[-1].entry_id, "ENTRIESADDED", len(rows)
            )
        pipe.execute()
    return len(keep)


class Repairer:
    """Runs the check on the relay's own partitions: at start, then every ``interval_s``."""

    def __init__(
        self,
        settings: RelaySettings,
        engine: Engine,
        client: redis.Redis,
        node_id: str,
        interval_s: float = REPAIR_INTERVAL_S,
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.client = client
        self.node_id = node_id
        self.interval_s = interval_s
        self.stats = RepairStats()
        self._next_check = 0.0

    def maybe_run(self, leases: dict[int, int]) -> int:
        """Check (and repair) our partitions when due; returns entries appended back."""
        if time.monotonic() < self._next_check or not leases:
            return 0
        added = self.run(leases)
        self._next_check = time.monotonic() + self.interval_s
        return added

    def run(self, leases: dict[int, int]) -> int:
        """Check every stream of the given ``{partition: epoch}`` leases and repair what lags."""
        s = self.settings
        self.stats.checks += 1
        counts = store.delivered_counts(self.engine, sorted(leases))
        added = 0
        for (stream, partition), delivered in sorted(counts.items()):
            finding = compare(self.engine, self.client, s.key_prefix, stream, partition, delivered)
            if finding.reason is None:
                continue
            try:
                store.renew_lease(
                    self.engine, partition, self.node_id, leases[partition], s.lease_ttl_ms,
                    now_ms(),
                )
            except LeaseLostError:
                log.warning("repair of %s skipped: partition lease lost", finding.key)
                continue
            how, n = repair(self.engine, self.client, finding, s.stream_maxlen)
            self._record(finding, how, n)
            added += n
        return added

    def _record(self, finding: Finding, how: str, n: int) -> None:
        self.stats.behind += 1
        self.stats.repaired_entries += n
        if how == "refill":
            self.stats.refills += 1
        else:
            self.stats.rebuilds += 1
        self.stats.findings.append(finding)
        del self.stats.findings[:-100]
        log.warning(
            "repair: %s %s (%s): %d entries appended back under their original ids",
            how, finding.key, finding.reason, n,
        )
