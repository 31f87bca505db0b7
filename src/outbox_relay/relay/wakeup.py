"""When to look for new rows, and where: ``LISTEN/NOTIFY`` on PostgreSQL, adaptive polling
everywhere.

Producers on PostgreSQL ``NOTIFY`` in their transaction, so the notification arrives only when
the rows are committed; its payload is the row's partition. The listener runs in a daemon thread
on its own psycopg connection, records the partition and sets an event; the relay waits on that
event with the poll interval as its timeout, and its next round visits only the partitions
named since the last one (:meth:`Wakeup.targets`), not all it holds: at a trickle of events one
partition's take instead of four. A poll timeout, a lost notification (listener reconnecting),
a payload that is not a partition, or :data:`FULL_ROUND_S` without a full round (rows waiting
for their retry time get no notification) make the next round visit every partition. SQLite
has no notifications: the interval starts short and doubles while the outbox stays empty.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from sqlalchemy.engine import make_url

from outbox_relay.shared.redaction import redact_url

log = logging.getLogger(__name__)

FULL_ROUND_S = 1.0
"""The longest a partition goes unvisited while notifications keep naming others: its rows
waiting for their retry time, or whose notification was lost, are taken within this."""


class Wakeup:
    """Adaptive wait between relay rounds, cut short by a notification or by ``stop``."""

    def __init__(self, min_ms: int, max_ms: int) -> None:
        self.min_s = min_ms / 1000
        self.max_s = max_ms / 1000
        self.interval = self.min_s
        self.event = threading.Event()
        self.stopping = threading.Event()
        self.listening = False
        self._lock = threading.Lock()
        self._named: set[int] = set()  # partitions notified since the last round
        self._everything = True  # the next round visits every partition
        self._last_full = 0.0

    def worked(self) -> None:
        """A round found work: poll again soon."""
        self.interval = self.min_s

    def wait(self) -> None:
        """Sleep until notified, stopped, or the current interval passes, then back off."""
        timeout = self.max_s if self.listening else self.interval
        if self.event.wait(timeout):
            self.event.clear()
            self.interval = self.min_s
        else:
            self.interval = min(self.interval * 2, self.max_s)
            self.visit_everything()

    def notify(self, partition: int | None = None) -> None:
        """Wake the relay now: a NOTIFY named ``partition`` (``None``: any partition may have
        rows, or a signal asks the relay to stop)."""
        with self._lock:
            if partition is None:
                self._everything = True
            else:
                self._named.add(partition)
        self.event.set()

    def targets(self) -> set[int] | None:
        """The partitions the next round must visit: those notified since the last call, or
        ``None`` for every partition (see the module docstring). Called once per round."""
        now = time.monotonic()
        with self._lock:
            everything = self._everything or not self.listening or (
                now - self._last_full >= FULL_ROUND_S)
            named, self._named, self._everything = self._named, set(), False
        if everything:
            self._last_full = now
            return None
        return named

    def visit_everything(self) -> None:
        """Make the next round visit every partition (a poll timeout, a failed round)."""
        with self._lock:
            self._everything = True

    def stop(self) -> None:
        """Stop the listener thread and wake any waiter."""
        self.stopping.set()
        self.event.set()

    def listen_postgres(self, database_url: str, channel: str) -> threading.Thread:
        """Start the ``LISTEN`` thread for a PostgreSQL URL."""
        thread = threading.Thread(
            target=self._listen, args=(database_url, channel), name="outbox-listen", daemon=True
        )
        self.listening = True
        thread.start()
        return thread

    def _listen(self, database_url: str, channel: str) -> None:
        import psycopg

        url = make_url(database_url).set(drivername="postgresql")
        dsn = url.render_as_string(hide_password=False)
        backoff = 0.1
        while not self.stopping.is_set():
            try:
                with psycopg.connect(dsn, autocommit=True, connect_timeout=10) as conn:
                    conn.execute(f'LISTEN "{channel}"')
                    self.listening, backoff = True, 0.1
                    self.notify()  # rows may have committed anywhere while we were away
                    self._drain(conn)
            except psycopg.Error as err:
                self.listening = False
                log.warning("LISTEN connection lost; polling until it is back")
                log.debug("listen error: %s", redact_url(str(err)))
                self.stopping.wait(backoff)
                backoff = min(backoff * 2, 5.0)

    def _drain(self, conn: Any) -> None:
        while not self.stopping.is_set():
            for note in conn.notifies(timeout=1.0, stop_after=1):
                payload = note.payload
                self.notify(int(payload) if payload.isdigit() else None)
