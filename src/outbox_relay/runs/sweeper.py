"""The sweeper: runs whose execution lease expired get a ``run.resume`` event.

A worker that crashed, hung or lost its connection stops heartbeating; its run stays in an
active status with an expired lease and no event that would wake anyone. One sweep finds such
runs and, for each, in its own short transaction and by compare-and-set on the revision it read:
clears the lease, adds one to ``attempts`` and enqueues ``run.resume`` through the outbox (so the
event commits with the state change, and the relay delivers it at least once). A run past
``run_max_attempts`` fails with ``attempts_exhausted`` instead. Several sweepers (every consumer
daemon runs one, plus ``outbox sweep``) may race: the compare-and-set lets exactly one win.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from sqlalchemy import Engine

from outbox_relay.runs import pipeline as rs
from outbox_relay.runs.errors import InvalidTransitionError
from outbox_relay.runs.settings import RunSettings
from outbox_relay.runs.store import RunStore
from outbox_relay.shared.db_errors import translate_errors
from outbox_relay.shared.errors import ConflictError, NotFoundError, OutboxError
from outbox_relay.shared.leases import db_now

log = logging.getLogger(__name__)


@dataclass
class SweepStats:
    """What one sweep (or all sweeps of a daemon) did."""

    resumed: int = 0
    failed: int = 0
    raced: int = 0


def sweep(engine: Engine, store: RunStore, *, max_attempts: int, limit: int = 100,
          now: int | None = None) -> SweepStats:
    """One pass over runs whose lease expired before ``now`` (default: the database's clock,
    the one every worker writes its lease expiries with, so a sweeper on a host whose clock runs
    ahead does not resume runs whose workers are alive)."""
    stats = SweepStats()
    with translate_errors(), engine.connect() as conn:
        now = db_now(conn) if now is None else now
        expired = store.expired(conn, now=now, limit=limit)
    for run_id, revision in expired:
        try:
            with translate_errors(), engine.begin() as conn:
                row = store.resume(conn, run_id, revision, max_attempts=max_attempts, now=now)
        except (ConflictError, NotFoundError, InvalidTransitionError):
            stats.raced += 1  # someone else resumed, finished or re-leased it first
            continue
        if row.status == rs.FAILED:
            stats.failed += 1
            log.warning("run %s failed: attempts_exhausted", run_id)
        else:
            stats.resumed += 1
            log.info("run %s resumed (attempt %d)", run_id, row.attempts)
    return stats


class Sweeper:
    """Sweeps every ``sweep_interval_ms`` on a daemon thread, inside a consumer daemon."""

    def __init__(self, engine: Engine, store: RunStore, settings: RunSettings) -> None:
        self.engine, self.store, self.settings = engine, store, settings
        self.total = SweepStats()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sweep_once(self) -> SweepStats:
        """One pass, added to :attr:`total`."""
        stats = sweep(self.engine, self.store, max_attempts=self.settings.run_max_attempts,
                      limit=self.settings.sweep_batch)
        self.total.resumed += stats.resumed
        self.total.failed += stats.failed
        self.total.raced += stats.raced
        return stats

    def start(self) -> None:
        """Sweep periodically until :meth:`stop`."""
        self._thread = threading.Thread(target=self._loop, name="run-sweeper", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop after the current pass."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _loop(self) -> None:
        while not self._stop.wait(self.settings.sweep_interval_ms / 1000):
            try:
                self.sweep_once()
            except OutboxError as err:
                log.warning("sweep failed: %s", err.code)
