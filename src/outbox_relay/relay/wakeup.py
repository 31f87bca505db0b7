"""When to look for new rows, and where: ``LISTEN/NOTIFY`` on PostgreSQL, adaptive polling
everywhere.

Producers on PostgreSQL ``NOTIFY`` in their transaction (unless made with ``notify=False``), so
the notification arrives only when the rows are committed; its payload is the row's partition.
The listener runs in a daemon thread on its own psycopg connection, records the partition and
sets an event; a notified round visits only the partitions named since the last one
(:meth:`Wakeup.targets`), not all it holds: at a trickle of events one partition's take
instead of four.

Besides, the relay **polls**: a full round (every partition) at least every poll interval,
whether or not notifications keep cutting the waits short. The interval is ``poll_min_ms``
after a full round that found rows no notification had named, and doubles after each full
round that found nothing, or only rows notifications had named, up to ``poll_max_ms``. So
rows nobody announced are taken within the current interval (at most ``poll_max_ms``): those
of producers that do not notify (many concurrent writers: a notifying commit takes a global
lock, see ``Producer``), a lost notification (listener reconnecting), rows waiting for their
retry time, a payload that is not a partition. A relay with no traffic, or with only
notified traffic, settles at one full round per ``poll_max_ms``; rows whose notification
names them are taken at once, as before; notified rows do not shorten the interval (the
notifications serve them). Without a listener (SQLite, or the ``LISTEN`` connection down)
every round is a full round.
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
"""The longest a partition goes unvisited while notifications keep naming others, whatever the
poll interval (``poll_max_ms`` may be set longer than this)."""


class Wakeup:
    """Adaptive wait between relay rounds, cut short by a notification or by ``stop``.

    The relay calls :meth:`targets` at the start of each round, :meth:`worked` when the round
    found rows, and :meth:`wait` before the next round when it has no backlog to chain.
    """

    def __init__(self, min_ms: int, max_ms: int) -> None:
        self.min_s = min_ms / 1000
        self.max_s = max_ms / 1000
        self.interval = self.min_s  # the poll interval: from one full round to the next
        self.event = threading.Event()
        self.stopping = threading.Event()
        self.listening = False
        self._lock = threading.Lock()
        self._named: set[int] = set()  # partitions notified since the last round
        self._everything = True  # the next round visits every partition
        self._last_full = 0.0  # monotonic start of the last full round
        self._empty_full = False  # the current round is a full round that found nothing (yet)
        self._polled = False  # the current round is a full round no notification named
        self._round_named: set[int] = set()  # the partitions named for the current round

    def worked(self, found: set[int]) -> None:
        """The round found rows; ``found``: the partitions where it had rows no earlier round
        said were coming (its take's, its last settle's; relay/daemon.py).

        Without a listener every round is a poll: one that found rows makes the next come
        after ``poll_min_ms``. While listening, a full round decides by ``found``: if a
        notification named each of them (before the round or while it ran: a commit's
        ``NOTIFY`` lands a little after the commit), the poll found nothing the
        notifications would not have brought, and the interval doubles as after an empty
        poll, even while the relay stays busy; else (rows written without ``NOTIFY``) the
        next poll comes after ``poll_min_ms``. Without this, a steady notified trickle kept
        the interval at ``poll_min_ms`` for good (full rounds always find rows), and two
        rounds in three took every partition (1,000 ev/s, 4 partitions)."""
        full, self._empty_full = self._empty_full, False
        if not self.listening:
            if self._polled:
                self.interval = self.min_s
            return
        if not full:
            return
        with self._lock:
            announced = self._round_named | self._named
        if found - announced:
            self.interval = self.min_s
        else:
            self.interval = min(self.interval * 2, self.max_s)

    def wait(self) -> None:
        """Sleep until notified, stopped, or the next full round is due (the poll interval
        after the start of the last one; doubled first if that round found nothing)."""
        if self._empty_full:  # a full round found nothing: back off
            self.interval = min(self.interval * 2, self.max_s)
            self._empty_full = False
        timeout = max(0.0, self._last_full + self.interval - time.monotonic())
        if self.event.wait(timeout):
            self.event.clear()
        else:
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
                now - self._last_full >= min(self.interval, FULL_ROUND_S))
            named, self._named, self._everything = self._named, set(), False
        self._empty_full, self._polled = everything, everything and not named
        self._round_named = named
        if everything:
            self._last_full = now
            return None
        return named

    def named_now(self) -> set[int]:
        """The partitions notified since the last :meth:`targets`, without taking them: the
        round's settle may take their rows early (relay/daemon.py), and the next round still
        visits them (their rows taken, it appends them; else it takes its own)."""
        with self._lock:
            return set(self._named)

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
