"""The consumer loop: read → validate → claim (one transaction) → ACK.

Order of a batch, and why:

1. Entries that do not parse are copied to the dead-letter stream with their reason, then
   acknowledged: they can never succeed, and a record exists before the ACK.
2. Entries of an unknown type, or delivered more than ``max_deliveries`` times, are copied to
   the dead-letter stream *before* the claim transaction records a ``dead`` receipt.
3. Everything else is claimed in one transaction (:func:`consumer.inbox.claim`).
4. Only after that commit: ``XACK`` every entry except those whose handler failed; those stay
   pending and come back through ``XAUTOCLAIM`` once idle for ``claim_idle_ms``.
5. Then the callbacks handlers scheduled with ``Handlers.after_commit`` for applied events
   (post-commit work such as run stages); a rolled-back claim drops them.

A crash between 3 and 4 redelivers the entries; the inbox finds them and they are acknowledged
as duplicates. After a restart the consumer first re-reads its own pending entries.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType

import redis
from sqlalchemy import Engine

from consumer import inbox, streams
from consumer.handlers import Handlers
from consumer.streams import Entry
from shared import faults
from shared.envelope import Event
from shared.errors import InvalidEventError, UnavailableError
from shared.settings import ConsumerSettings

log = logging.getLogger(__name__)


@dataclass
class ConsumerStats:
    """Counters since start."""

    read: int = 0
    applied: int = 0
    duplicates: int = 0
    stale: int = 0
    dead: int = 0
    failed: int = 0
    invalid: int = 0
    autoclaimed: int = 0


class Consumer:
    """One consumer of one group, reading every partition of its streams."""

    def __init__(
        self,
        settings: ConsumerSettings,
        engine: Engine,
        client: redis.Redis,
        handlers: Handlers,
        *,
        after_batch: Callable[[], None] | None = None,
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.client = client
        self.handlers = handlers
        self.name = settings.consumer or f"{socket.gethostname()}:{os.getpid()}"
        self.keys = streams.partition_keys(
            settings.key_prefix, settings.stream_names(), settings.partitions
        )
        self.stats = ConsumerStats()
        self.after_batch = after_batch
        self._stop = threading.Event()
        self._next_autoclaim = 0.0
        self._groups_ready = False
        self._backoff = 0.0

    def stop(self) -> None:
        """Finish the current batch, then return from :meth:`run`."""
        self._stop.set()

    def install_signal_handlers(self) -> None:
        """SIGTERM and SIGINT stop the loop after the current batch."""

        def handler(signum: int, _frame: FrameType | None) -> None:
            log.info("signal %s: finishing the current batch", signum)
            self.stop()

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)

    def run(self) -> ConsumerStats:
        """Consume until stopped: own pending entries first, then new ones."""
        log.info("consumer %s of group %s started", self.name, self.settings.group)
        pending_done = False
        while not self._stop.is_set():
            try:
                if not pending_done:
                    self.drain_pending()
                    pending_done = True
                self.run_once()
                self._backoff = 0.0
            except UnavailableError as err:
                self._groups_ready = False
                self._sleep_backoff(err)
        log.info("consumer %s stopped: %s", self.name, self.stats)
        return self.stats

    def run_once(self, block_ms: int | None = None) -> int:
        """Autoclaim when due, then one ``XREADGROUP >``; returns entries handled."""
        if self.handlers.paused():  # backpressure: let other consumers take the new entries
            self._stop.wait(min(self.settings.block_ms, 50) / 1000)
            return 0
        self._ensure_groups()
        handled = 0
        if time.monotonic() >= self._next_autoclaim:
            taken = streams.autoclaim(
                self.client, self.keys, self.settings.group, self.name,
                min_idle_ms=self.settings.claim_idle_ms, count=self.settings.batch_size,
            )
            self.stats.autoclaimed += len(taken)
            handled += self.process(taken)
            self._next_autoclaim = time.monotonic() + self.settings.claim_interval_ms / 1000
        entries = streams.read(
            self.client, dict.fromkeys(self.keys, ">"), self.settings.group, self.name,
            count=self.settings.batch_size,
            block_ms=self.settings.block_ms if block_ms is None else block_ms,
        )
        return handled + self.process(entries)

    def drain_pending(self) -> int:
        """Re-read every entry still pending for this consumer (after a crash or restart)."""
        self._ensure_groups()
        cursors = dict.fromkeys(self.keys, "0")
        handled = 0
        while cursors and not self._stop.is_set():
            entries = streams.read(
                self.client, cursors, self.settings.group, self.name,
                count=self.settings.batch_size, block_ms=None,
            )
            seen = {e.key for e in entries}
            for e in entries:
                cursors[e.key] = e.entry_id
            cursors = {k: v for k, v in cursors.items() if k in seen}
            handled += self.process(entries)
        return handled

    def process(self, entries: list[Entry]) -> int:
        """Validate, dead-letter, claim and acknowledge one batch of entries."""
        if not entries:
            return 0
        self.stats.read += len(entries)
        s = self.settings
        to_ack: list[Entry] = []
        letters: list[tuple[Entry, str, str]] = []
        batch: list[inbox.Delivery] = []
        for entry in entries:
            if entry.fields is None:  # trimmed while pending: nothing left to handle
                to_ack.append(entry)
                continue
            try:
                event = Event.from_fields(entry.fields, max_data_bytes=s.max_data_bytes)
            except InvalidEventError as err:
                letters.append((entry, err.code, err.message))
                to_ack.append(entry)
                self.stats.invalid += 1
                continue
            reason = None
            if self.handlers.get(event.type) is None:
                reason = "unknown_type"
            elif entry.deliveries > s.max_deliveries:
                reason = "max_deliveries"
            if reason is not None:
                letters.append((entry, reason, f"dead-lettered: {reason}"))
            batch.append(inbox.Delivery(entry.key, entry.entry_id, event, entry.deliveries, reason))
        streams.dead_letter(self.client, s.key_prefix, letters, s.group, self.name)
        try:
            outcomes = inbox.claim(self.engine, s.group, batch, self.handlers)
        except BaseException:
            self.handlers.take_after_commit(set())  # rolled back: drop scheduled work
            raise
        faults.point("consumer.after_commit")
        by_id = {(e.key, e.entry_id): e for e in entries}
        for o in outcomes:
            self._count(o.outcome)
            if o.outcome != inbox.FAILED:
                to_ack.append(by_id[(o.delivery.key, o.delivery.entry_id)])
        streams.ack(self.client, s.group, to_ack)
        faults.point("consumer.after_ack")
        self._run_after_commit({o.delivery.event.id for o in outcomes
                                if o.outcome == inbox.APPLIED})
        if self.after_batch is not None:
            self.after_batch()
        return len(entries)

    def _run_after_commit(self, applied: set[str]) -> None:
        for callback in self.handlers.take_after_commit(applied):
            try:
                callback()
            except Exception as err:  # post-commit work must not stop the loop
                log.warning("after-commit callback failed: %s", type(err).__name__)
                log.debug("after-commit error", exc_info=True)

    def _count(self, outcome: str) -> None:
        attr = {"duplicate": "duplicates"}.get(outcome, outcome)
        setattr(self.stats, attr, getattr(self.stats, attr) + 1)

    def _ensure_groups(self) -> None:
        if not self._groups_ready:
            streams.ensure_groups(self.client, self.keys, self.settings.group)
            self._groups_ready = True

    def _sleep_backoff(self, err: UnavailableError) -> None:
        self._backoff = min(max(self._backoff * 2, 0.05), 5.0)
        delay = random.uniform(self._backoff / 2, self._backoff)
        log.warning("%s; retrying in %.2fs", err.message, delay)
        self._stop.wait(delay)
