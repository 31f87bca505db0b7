"""When to look for new rows: ``LISTEN/NOTIFY`` on PostgreSQL, adaptive polling everywhere.

Producers on PostgreSQL ``NOTIFY`` in their transaction, so the notification arrives only when
the rows are committed. The listener runs in a daemon thread on its own psycopg connection and
sets an event; the relay waits on that event with the poll interval as its timeout, so a lost
notification (listener reconnecting) costs at most one poll interval. SQLite has no
notifications: the interval starts short and doubles while the outbox stays empty.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from sqlalchemy.engine import make_url

from outbox_relay.shared.redaction import redact_url

log = logging.getLogger(__name__)


class Wakeup:
    """Adaptive wait between relay rounds, cut short by a notification or by ``stop``."""

    def __init__(self, min_ms: int, max_ms: int) -> None:
        self.min_s = min_ms / 1000
        self.max_s = max_ms / 1000
        self.interval = self.min_s
        self.event = threading.Event()
        self.stopping = threading.Event()
        self.listening = False

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

    def notify(self) -> None:
        """Wake the relay now (a NOTIFY arrived, or a signal asks it to stop)."""
        self.event.set()

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
                    self.event.set()  # rows may have committed while we were away
                    self._drain(conn)
            except psycopg.Error as err:
                self.listening = False
                log.warning("LISTEN connection lost; polling until it is back")
                log.debug("listen error: %s", redact_url(str(err)))
                self.stopping.wait(backoff)
                backoff = min(backoff * 2, 5.0)

    def _drain(self, conn: Any) -> None:
        while not self.stopping.is_set():
            for _ in conn.notifies(timeout=1.0, stop_after=1):
                self.event.set()
