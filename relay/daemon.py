"""The relay loop: own partitions, claim → append → settle, repeat.

One round per owned partition: :func:`relay.store.claim` (one short transaction) →
:func:`relay.append.append` (one pipeline, no transaction open) → optional durability barrier →
:func:`relay.store.settle` (one short transaction, fenced by the lease epoch). Failures of Redis
or the database back off exponentially with jitter; nothing is marked while the outcome is
unknown. ``SIGTERM``/``SIGINT`` let the in-flight round finish, release the leases, exit 0.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import socket
import threading
import time
from dataclasses import dataclass
from types import FrameType

import redis
from sqlalchemy import Engine

from relay import append, store
from relay.wakeup import Wakeup
from shared import keys
from shared.db import is_postgres, now_ms
from shared.errors import LeaseLostError, UnavailableError
from shared.settings import RelaySettings

log = logging.getLogger(__name__)


@dataclass
class RelayStats:
    """Counters since start (logged at shutdown, read by tests and benchmarks)."""

    rounds: int = 0
    delivered: int = 0
    already_present: int = 0
    ordering_gaps: int = 0
    failed: int = 0
    unknown_outcomes: int = 0
    lease_losses: int = 0


class Relay:
    """A relay process's state: its node id, leases, clients and counters."""

    def __init__(self, settings: RelaySettings, engine: Engine, client: redis.Redis) -> None:
        self.settings = settings
        self.engine = engine
        self.client = client
        self.node_id = settings.node_id or f"{socket.gethostname()}:{os.getpid()}"
        self.leases: dict[int, int] = {}
        self.stats = RelayStats()
        self.wakeup = Wakeup(settings.poll_min_ms, settings.poll_max_ms)
        self._stop = threading.Event()
        self._next_lease_check = 0.0
        self._backoff = 0.0

    def stop(self) -> None:
        """Ask the loop to finish its round and return (safe from a signal handler)."""
        self._stop.set()
        self.wakeup.stop()

    def install_signal_handlers(self) -> None:
        """SIGTERM and SIGINT stop the loop gracefully."""

        def handler(signum: int, _frame: FrameType | None) -> None:
            log.info("signal %s: finishing the current round", signum)
            self.stop()

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)

    def run(self, *, until_idle: bool = False) -> RelayStats:
        """Relay until stopped (or, with ``until_idle``, until a round finds nothing to do)."""
        if is_postgres(self.engine) and not until_idle:
            self.wakeup.listen_postgres(
                self.engine.url.render_as_string(hide_password=False),
                keys.notify_channel(self.settings.key_prefix),
            )
        log.info("relay %s started", self.node_id)
        try:
            while not self._stop.is_set():
                try:
                    busy = self.run_once()
                    self._backoff = 0.0
                except UnavailableError as err:
                    self._sleep_backoff(err)
                    continue
                if busy:
                    self.wakeup.worked()
                elif until_idle:
                    break
                else:
                    self.wakeup.wait()
        finally:
            self._release()
        log.info("relay %s stopped: %s", self.node_id, self.stats)
        return self.stats

    def run_once(self) -> bool:
        """One round over our partitions; True if any partition had a full batch or errors."""
        self.stats.rounds += 1
        self._refresh_leases()
        busy = False
        for partition, epoch in list(self.leases.items()):
            if self._stop.is_set():
                break
            try:
                busy |= self.relay_partition(partition, epoch)
            except LeaseLostError:
                self.stats.lease_losses += 1
                log.warning("lost the lease of partition %s", partition)
                self.leases.pop(partition, None)
        return busy

    def relay_partition(self, partition: int, epoch: int) -> bool:
        """Claim, append and settle one batch of one partition; True if there may be more."""
        s = self.settings
        rows = store.claim(
            self.engine, partition, self.node_id, epoch, s.batch_size, s.lease_ttl_ms, now_ms()
        )
        if not rows:
            return False
        try:
            verdicts = append.append(self.client, s.key_prefix, rows, s.stream_maxlen)
        except UnavailableError:
            self.stats.unknown_outcomes += len(rows)
            store.record_unknown(self.engine, [r.seq for r in rows], "unknown_outcome")
            raise
        if verdicts.delivered and not append.durability_barrier(
            self.client, s.wait_replicas, s.wait_timeout_ms, s.wait_aof
        ):
            log.warning("durability barrier not met; %d entries stay unmarked", len(rows))
            raise UnavailableError("replicas did not confirm the batch in time")
        store.settle(
            self.engine, partition, self.node_id, epoch, s.lease_ttl_ms, now_ms(),
            delivered=verdicts.delivered, gaps=verdicts.gaps, failed=verdicts.failed,
        )
        self.stats.delivered += len(verdicts.delivered)
        self.stats.already_present += verdicts.already
        self.stats.ordering_gaps += len(verdicts.gaps)
        self.stats.failed += len(verdicts.failed)
        return len(rows) == s.batch_size or bool(verdicts.gaps)

    def _refresh_leases(self) -> None:
        now = time.monotonic()
        if now < self._next_lease_check:
            return
        s = self.settings
        self.leases = store.acquire_leases(
            self.engine, self.node_id, s.partitions, s.lease_ttl_ms, now_ms()
        )
        self._next_lease_check = now + s.lease_ttl_ms / 3000

    def _sleep_backoff(self, err: UnavailableError) -> None:
        self._backoff = min(max(self._backoff * 2, 0.05), 5.0)
        delay = random.uniform(self._backoff / 2, self._backoff)
        log.warning("%s; retrying in %.2fs", err.message, delay)
        self._next_lease_check = 0.0
        self._stop.wait(delay)

    def _release(self) -> None:
        if not self.leases:
            return
        try:
            store.release_leases(self.engine, self.node_id, self.leases)
        except UnavailableError:
            log.warning("could not release leases; they expire by themselves")
        self.leases = {}
