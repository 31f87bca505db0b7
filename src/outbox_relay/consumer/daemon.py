"""The consumer loop: read → validate → claim (one transaction) → ACK.

Order of a batch, and why:

1. Entries that do not parse are copied to the dead-letter stream with their reason, then
   acknowledged: they can never succeed, and a record exists before the ACK
   (:mod:`consumer.triage`).
2. Everything else is claimed in one transaction (:func:`consumer.inbox.claim`), which also
   decides the order per aggregate (``waiting``, ``out_of_order``, ``superseded``).
3. After that commit and before the ACK: dead outcomes (unknown type, more than
   ``max_deliveries`` deliveries, ``out_of_order``) are copied to the dead-letter stream.
4. ``XACK`` every entry except the ``failed`` and ``waiting`` ones: those stay pending and are
   retried in id order (a waiting entry's delivery counter is put back first).
5. Then the callbacks handlers scheduled with ``Handlers.after_commit`` for applied events
   (post-commit work such as run stages); a rolled-back claim drops them.

A crash between 3 and 4 redelivers the entries; the inbox finds them and they are acknowledged
as duplicates. After a restart the consumer first re-reads its own pending entries.

Ownership (:mod:`consumer.ownership`): the consumers of a group lease the partition streams, one
owner each, and read only their own; every claim re-checks the lease epoch, so a fenced-out
consumer's late commit is refused. The read rule (:mod:`consumer.read_states`): a stream is
read with ``XREADGROUP >`` only once a pending pass has processed every pending entry of it in
the group (taken over from the previous owner, or left by this consumer under an earlier
epoch) under the epoch it still holds; every (re)acquisition puts it back behind such a pass.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import redis
from sqlalchemy import Connection, Engine

from outbox_relay.consumer import (
    async_handlers,
    counters,
    doorbell,
    group_status,
    inbox,
    letters,
    lock_table,
    streams,
    triage,
)
from outbox_relay.consumer import ownership as ownership_
from outbox_relay.consumer.handlers import Handlers
from outbox_relay.consumer.hygiene import HygieneStats
from outbox_relay.consumer.prune import PruneStats
from outbox_relay.consumer.read_states import DRAINING, READABLE, ReadStates
from outbox_relay.consumer.retry import Retry
from outbox_relay.consumer.streams import Entry
from outbox_relay.shared import faults, keys, partition_counts
from outbox_relay.shared.daemon_control import Backoff, stop_on_signals
from outbox_relay.shared.db import is_postgres, now_ms
from outbox_relay.shared.errors import UnavailableError
from outbox_relay.shared.periodic import Periodic, run_due
from outbox_relay.shared.periodic import shutdown as shutdown_periodic
from outbox_relay.shared.progress import Progress
from outbox_relay.shared.redis_conn import refused_for_now
from outbox_relay.shared.settings import ConsumerSettings
from outbox_relay.shared.signing import Signer

if TYPE_CHECKING:
    from outbox_relay.consumer.metrics import ConsumerMetrics

log = logging.getLogger(__name__)


class Consumer:
    """One consumer of one group, reading the partition streams it owns.

    With ``ownership`` (what ``outbox consume`` runs), the consumers of a group lease the
    partition streams (:mod:`consumer.ownership`): each key is read by one consumer, which
    takes over the previous owner's pending entries and processes them, in id order, before
    anything new; every claim re-checks the lease's epoch. Without it (tests, benchmarks that
    build one consumer by hand) this consumer reads every key, unfenced: never run two of
    those in one group.
    """

    def __init__(
        self,
        settings: ConsumerSettings,
        engine: Engine,
        client: redis.Redis,
        handlers: Handlers,
        *,
        after_batch: Callable[[], None] | None = None,
        ownership: bool = False,
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.client = client
        self.handlers = handlers
        self.name = settings.consumer or f"{socket.gethostname()}:{os.getpid()}"
        # Entries above this are refused unread (consumer/streams.py); None: plain reads.
        self._entry_limit = (streams.entry_limit(settings.max_data_bytes)
                             if settings.bounded_reads else None)
        # Bounded reads poll; the relay's doorbell wakes them (plain reads block in Redis).
        # Not on SQLite, a precaution: woken by the relay's append, every consumer of the
        # streams asks for the one write lock as the relay settles that append; polling
        # spreads them out, as before the doorbell. (Suspected, not shown: the full torture's
        # SQLite refuse_appends finding, docs/guarantees.md "Open", stayed without it.)
        self.bell = (doorbell.Doorbell(client)
                     if settings.bounded_reads and settings.doorbell and is_postgres(engine)
                     else None)
        ids = {keys.stream_key(settings.key_prefix, s, p): (s, p)
               for s in settings.stream_names() for p in range(settings.partitions)}
        self.keys = list(ids)
        self.leases = ownership_.Leases(engine, settings.group, self.name, ids,
                                        settings.lease_ttl_ms, enabled=ownership)
        # Strict aggregates with an earlier entry failing or waiting (consumer/inbox.py):
        # rebuilt by each pending pass, grown by every claim in between.
        self.blocked: set[tuple[str, str]] = set()
        self.stats = counters.ConsumerStats()
        self.after_batch = after_batch
        self._stop = threading.Event()
        # Each owned stream draining (a pending pass due before anything new) or readable.
        self.reads = ReadStates()
        self._next_pending_check = 0.0
        # The group's default retry policy, and when (monotonic s) the earliest retry of an
        # entry we hold is due: a pending pass runs then (consumer/retry.py).
        self.retry = Retry.from_settings(settings)
        self._retry_due: float | None = None
        self.signer = Signer.from_setting(settings.signing_key.get_secret_value())
        self._groups_ready = False
        self._backoff = Backoff()
        # Housekeeping between batches (retention, group hygiene): see shared/periodic.py.
        self.periodic: list[Periodic] = [
            # Entries on partitions this consumer does not read would never be handled:
            # refuse to run (invalid_config) if a stream records another count.
            Periodic("partition count check", partition_counts.CHECK_INTERVAL_S,
                     lambda: partition_counts.check(engine, settings.partitions,
                                                    "this consumer", settings.stream_names())),
        ]
        self._progress = Progress()
        if settings.progress_interval_s:  # the first line after one interval, not at start
            self.periodic.append(Periodic(
                "progress", settings.progress_interval_s, self.log_progress,
                next_at=time.monotonic() + settings.progress_interval_s))
        # Observation (consumer/metrics.py, cli/observe.py): hooks when metrics are on, and
        # the liveness heartbeat (monotonic seconds at the start of the last iteration).
        self.metrics: ConsumerMetrics | None = None
        self.last_loop = time.monotonic()
        self.hygiene_stats: HygieneStats | None = None  # set by consumer.hygiene.install
        self.prune_stats: PruneStats | None = None  # set by cli/prune.py (retention task)

    def log_progress(self) -> str:
        """Log (INFO) and return the progress line (shared/progress.py): events applied since
        the last line and their rate, the total, retries and dead letters since start, the
        streams held, and the group's pending and unread entries on them."""
        st = self.stats
        done, rate = self._progress.since_last(st.applied)
        held = sorted(self.leases.held)
        pending, behind = group_status.outstanding(self.client, held, self.settings.group)
        line = (f"consumer {self.name} of group {self.settings.group}: applied {done:,} events "
                f"({rate:,.1f}/s, {st.applied:,} since start; {st.retried:,} retried, "
                f"{st.dead:,} dead letters); {len(held)} streams held, {pending:,} pending, "
                f"{'?' if behind is None else f'{behind:,}'} unread")
        log.info("%s", line, extra={"consumer": self.name, "group": self.settings.group,
                                    "applied": done, "pending": pending})
        return line

    def stop(self) -> None:
        """Finish the current batch, then return from :meth:`run`."""
        self._stop.set()

    def install_signal_handlers(self) -> None:
        """SIGTERM and SIGINT stop the loop after the current batch."""
        stop_on_signals(self.stop, log, "batch")

    def run(self, *, until_idle: bool = False) -> counters.ConsumerStats:
        """Consume until stopped, then give the leases back (so others need not wait for them
        to expire). ``until_idle`` (``outbox consume --until-idle``): also stop after a round
        that handled nothing when the group has nothing pending (entries waiting for a retry
        included) and nothing unread on any of its partition streams (:meth:`idle`)."""
        log.info("consumer %s of group %s started", self.name, self.settings.group,
                 extra={"consumer": self.name, "group": self.settings.group})
        lock_table.warn_if_few_claims_fit(self.engine, self.settings.batch_size,
                                          self.settings.group)
        try:
            while not self._stop.is_set():
                self.last_loop = time.monotonic()
                try:
                    handled = self.run_once(block_ms=min(self.settings.block_ms, 200)
                                            if until_idle else None)
                    self._backoff.reset()
                    if until_idle and not handled and self.idle():
                        log.info("consumer %s: group %s has nothing pending or unread; "
                                 "exiting (--until-idle)", self.name, self.settings.group)
                        break
                except UnavailableError as err:
                    self._groups_ready = False
                    self._sleep_backoff(err)
                except redis.ResponseError as err:
                    # Redis at maxmemory (OOM on creating a group or writing a dead letter),
                    # a replica during a failover: wait it out like an outage. The batch in
                    # hand was drained as after a crash (its entries stay pending).
                    waiting = refused_for_now(err)
                    if waiting is None:
                        raise
                    self._groups_ready = False
                    self._sleep_backoff(waiting)
        finally:
            shutdown_periodic(self.periodic)
            self._release_leases()  # first: other consumers take the partitions at once
            self.handlers.stop()  # the app's stop hooks (the run worker's), after the last batch
            async_handlers.close()  # this thread's async engine, when handlers are async
            if self.bell is not None:
                self.bell.close()
        log.info("consumer %s stopped: %s", self.name, self.stats,
                 extra={"consumer": self.name, "group": self.settings.group})
        return self.stats

    def idle(self) -> bool:
        """Whether the group is done with every partition stream this consumer reads: nothing
        pending for any consumer of the group, nothing unread (:func:`group_status.group_idle`)."""
        return group_status.group_idle(self.client, self.keys, self.settings.group)

    def run_once(self, block_ms: int | None = None) -> int:
        """Renew leases when due; a pending pass when due; then one ``XREADGROUP >`` of the
        owned streams that are readable. Returns entries handled.

        A consumer that owns nothing (more consumers than partition streams, or leases not
        renewable) waits until its next renewal instead of reading: scale-out is by
        partitions.
        """
        self._ensure_groups()
        self._renew_leases()
        run_due(self.periodic)
        if self.handlers.paused():  # backpressure: leave new entries in the stream
            self._stop.wait(min(self.settings.block_ms, 50) / 1000)
            return 0
        if not self.leases.readable():
            self._stop.wait(self.leases.idle_wait_s())
            return 0
        handled = 0
        if self._pending_due():
            handled += self.drain_pending()
            if self._stop.is_set():
                return handled
        return handled + self._read_new(block_ms, handled)

    def _read_new(self, block_ms: int | None, handled: int) -> int:
        """The loop's one ``XREADGROUP >``, and the one place the read rule is enforced: it
        names only the streams that are ``readable`` (:mod:`consumer.read_states`), decided
        here, after this iteration's last renewal and pending pass, with no renewal between
        the decision and the read. A stream still draining (its pass did not complete, or a
        renewal during the pass gave it back) waits for the next iteration's pass."""
        ready = self.reads.readable(self.leases.readable(), self.leases.held)
        if not ready:
            if not handled:  # a pass is due at once; do not spin on it
                self._stop.wait(0.01)
            return 0
        if self.bell is not None:
            self.bell.listen(ready)
        try:
            entries = streams.read(
                self.client, dict.fromkeys(ready, ">"), self.settings.group, self.name,
                count=self.settings.batch_size,
                block_ms=self.settings.block_ms if block_ms is None else block_ms,
                max_entry_bytes=self._entry_limit, bell=self.bell,
            )
        except UnavailableError:
            self._drain(ready, "read of unknown outcome")  # entries may have come to us
            raise
        return self._process_owned(self._behind_foreign(entries))

    def _behind_foreign(self, entries: list[Entry], also: Iterable[str] = ()) -> list[Entry]:
        """Entries just read, of keys on which another consumer holds pending entries, wait:
        they stay pending for us (their delivery counted back: they were not attempted), the
        stream is draining again, and its next pending pass takes the others over and
        applies everything in id order (see :func:`consumer.group_status.foreign_pending`).
        ``also``: keys to ask about even if the read brought nothing of them (a pending
        pass's, so a key whose entries were all moved away does not count as drained).

        Asked after every read, new (``>``) or pending: a consumer that lost its lease
        without noticing (paused after its lease check) can still have a read or an
        ``XCLAIM`` of its own pending pass executed by Redis after the takeover. Its read
        leaves older entries in its pending list; its ``XCLAIM`` moves entries out of ours,
        after our pass took the key over and cleared the blocked aggregates it rebuilds (the
        torture's ``out_of_order`` finding, docs/guarantees.md). Either way the entries are
        in its pending list when we ask, after our read: nothing newer is applied before
        them."""
        if not self.leases.enabled:
            return entries
        asked = sorted({e.key for e in entries}.union(also))
        if not asked:
            return entries
        foreign = group_status.foreign_pending(self.client, asked, self.settings.group,
                                               self.name)
        if not foreign:
            return entries
        self._drain(foreign, "another consumer's pending entries")
        self._uncount([e for e in entries if e.key in foreign])
        return [e for e in entries if e.key not in foreign]

    def drain_pending(self) -> int:
        """The pending pass: take over, then re-read in id order, every pending entry of the
        group on the keys this consumer may read now; returns entries handled.

        First every pending entry of another consumer on an owned key is moved to us (the
        previous owner's, whatever its idle time: :func:`consumer.streams.take_over`). Then
        ``self.blocked`` is cleared and our pending entries are re-read from id 0, page by
        page, each page processed before the next and before anything new is read: failed
        and waiting entries are retried in id order, which is how strict order holds across
        batches. Runs while any owned stream is draining (at start, when a stream is newly
        owned or owned under a new epoch), and every ``claim_interval_ms`` while the group
        has pending entries on our keys. The streams it covers are draining until it
        completes; each becomes readable once every pending entry of it was processed, if
        its epoch did not change meanwhile.
        """
        self._ensure_groups()
        self._renew_leases()
        readable = self.leases.readable()
        if not readable:
            return 0  # nothing we may read now: the pass stays due
        self._next_pending_check = time.monotonic() + self.settings.claim_interval_ms / 1000
        return self._pending_pass(readable)

    def _pending_pass(self, readable: list[str]) -> int:
        s = self.settings
        started = self.reads.begin_pass(readable, self.leases.held)
        trimmed: list[Entry] = []
        for key in readable:
            moved, gone = streams.take_over(self.client, key, s.group, self.name,
                                            count=s.batch_size)
            self.stats.taken_over += moved
            trimmed += gone
        self.blocked.clear()
        handled = self._process_owned(trimmed)  # letters for entries trimmed while pending
        cursors = dict.fromkeys(readable, "0")
        drained: list[str] = []
        while cursors and not self._stop.is_set():
            entries = self._behind_foreign(
                streams.read(self.client, cursors, s.group, self.name, count=s.batch_size,
                             block_ms=None, max_entry_bytes=self._entry_limit), cursors)
            for e in entries:
                cursors[e.key] = e.entry_id
            self.stats.autoclaimed += len(entries)
            handled += self._process_owned(entries)
            seen = {e.key for e in entries}
            drained += [k for k in cursors if k not in seen]  # every pending entry processed
            self._renew_leases()  # a long pass must not outlive its leases
            still = set(self.leases.readable())
            # A stream whose epoch changed, or whose batch did not complete, needs a pass of
            # its own from the start (take over again, re-read from 0): stop following it.
            cursors = {k: v for k, v in cursors.items() if k in seen and k in still
                       and self.reads.covers(started, k, self.leases.held)}
        self.reads.move(drained, READABLE, self.leases.held, started=started,
                        why="pending pass completed")
        return handled

    def recheck_pending(self) -> None:
        """Put every owned stream back to draining: the next iteration re-reads every pending
        entry before anything new (after the pending list was changed from outside)."""
        self._drain(self.keys, "asked")

    def _drain(self, stream_keys: Iterable[str], why: str) -> None:
        self.reads.move(stream_keys, DRAINING, self.leases.held, why=why)

    def _renew_leases(self) -> None:
        """Renew (and rebalance) the leases when due; a stream newly owned, or owned under a
        new epoch, is draining (its pending entries may not all be processed in this epoch:
        our own from before we gave it up, the previous owner's)."""
        if self.leases.due():
            self._drain(self.leases.renew(), "acquired")

    def _pending_due(self) -> bool:
        """Whether a pending pass is due: while any owned stream is draining, and every
        ``claim_interval_ms`` while the group has pending entries on our keys (our failed or
        waiting ones; or entries a fenced-out consumer read late)."""
        readable = self.leases.readable()
        if self.reads.draining(readable, self.leases.held):
            return True
        if self._retry_due is not None and time.monotonic() >= self._retry_due:
            self._retry_due = None  # the pass's claims schedule the next one
            return True
        if time.monotonic() < self._next_pending_check:
            return False
        self._next_pending_check = time.monotonic() + self.settings.claim_interval_ms / 1000
        pending = group_status.group_pending(self.client, readable, self.settings.group)
        return any(pending.values())

    def _fence_check(self, stream_keys: list[str]) -> Callable[[Connection], None] | None:
        """The ownership fence :meth:`process` passes to the claim (None without ownership):
        it raises :class:`consumer.ownership.PartitionLostError` unless this consumer still
        owns every key of the batch at the epoch it read them under."""
        return self.leases.fence(stream_keys)

    def _process_owned(self, entries: list[Entry]) -> int:
        """:meth:`process`, dropping the keys whose lease turns out to be lost: nothing of the
        batch is acknowledged, its entries stay pending for the new owner to take over.

        Whenever a batch did not complete (lease lost, database or Redis unavailable), its
        entries of keys we still own stay pending; a pending pass re-reads them before
        anything newer is read, so a rolled-back batch cannot be overtaken by later entries.
        """
        batch_keys = sorted({e.key for e in entries})
        try:
            return self.process(entries)
        except ownership_.PartitionLostError as err:
            self._drain(batch_keys, "batch not committed: lease lost")
            dropped = self.leases.drop(err.keys)
            self.stats.lease_losses += 1
            log.warning("consumer %s lost %s to another consumer of group %s; "
                        "its batch was not committed", self.name, dropped, self.settings.group,
                        extra={"consumer": self.name, "group": self.settings.group,
                               "stream_keys": dropped})
            return 0
        except UnavailableError:
            self._drain(batch_keys, "batch not committed: unavailable")
            self._uncount(entries)
            raise
        except BaseException:
            self._drain(batch_keys, "batch not completed")
            raise

    def _uncount(self, entries: list[Entry]) -> None:
        """Put back the delivery counters of a batch whose claim failed before deciding
        anything (database or Redis unavailable): no handler ran, so the re-reads that retry
        it must not count toward ``max_deliveries`` (else a short outage dead-letters every
        pending event). Best effort: with Redis down too, the counters stay as they are."""
        try:
            streams.restore_delivery_count(self.client, self.settings.group, self.name,
                                           [e for e in entries if e.fields is not None])
        except UnavailableError:
            log.debug("could not restore delivery counters", exc_info=True)

    def _release_leases(self) -> None:
        try:
            self.leases.release()
        except UnavailableError as err:
            log.warning("could not release the leases (%s); they expire on their own",
                        err.message)

    def process(self, entries: list[Entry]) -> int:
        """Validate, claim, dead-letter and acknowledge one batch of entries.

        Letters of entries that never parse or were trimmed while pending are written first.
        Letters of dead outcomes (``unknown_type``, ``max_deliveries``, ``out_of_order``, and
        a redelivered entry whose receipt is already ``dead``) are written after the claim
        committed and before the ``XACK``: a crash in between redelivers the entry, the claim
        finds its dead receipt and the letter is written again (a second copy, never none).
        ``failed`` and ``waiting`` entries are not acknowledged; a waiting entry's delivery
        counter is put back, so waiting never counts toward ``max_deliveries``.
        """
        if not entries:
            return 0
        self.stats.read += len(entries)
        s = self.settings
        to_ack, invalid, batch = triage.split(entries, s, self.signer, self.handlers, self.stats)
        to_ack += triage.record_lost(self.engine, s, [e for e in entries if e.fields is None],
                                     invalid, self._fence_check, self.stats)
        streams.dead_letter(self.client, s.key_prefix, invalid, s.group, self.name)
        check = self._fence_check(sorted({d.key for d in batch})) if batch else None
        started = time.perf_counter()
        try:
            outcomes = inbox.claim(self.engine, s.group, batch, self.handlers,
                                   blocked=self.blocked, check=check, retry=self.retry)
        except BaseException:
            self.handlers.take_after_commit(set())  # rolled back: drop scheduled work
            raise
        if self.metrics is not None:
            self.metrics.claimed(outcomes, time.perf_counter() - started)
        faults.point("consumer.after_commit")
        by_id = {(e.key, e.entry_id): e for e in entries}
        counters.warn_resurrected(outcomes, s.group)
        self._schedule_retry(inbox.next_attempt_ms(outcomes))
        dead, waiting = [], []
        for o in outcomes:
            entry = by_id[(o.delivery.key, o.delivery.entry_id)]
            counters.count(self.stats, o)
            if o.outcome == inbox.WAITING:
                waiting.append(entry)
            elif o.outcome != inbox.FAILED:
                to_ack.append(entry)
                if o.error is not None and o.outcome in (inbox.DEAD, inbox.DUPLICATE):
                    dead.append(letters.of(entry, o))
        streams.dead_letter(self.client, s.key_prefix, dead, s.group, self.name)
        streams.restore_delivery_count(self.client, s.group, self.name, waiting)
        streams.ack(self.client, s.group, to_ack)
        faults.point("consumer.after_ack")
        self._run_after_commit({o.delivery.event.id for o in outcomes
                                if o.outcome == inbox.APPLIED})
        if self.after_batch is not None:
            self.after_batch()
        return len(entries)

    def _run_after_commit(self, applied: set[str]) -> None:
        for event_id, callback in self.handlers.take_scheduled(applied):
            try:
                callback()
            except Exception as err:  # post-commit work must not stop the loop
                log.warning("after-commit callback of %s failed: %s", event_id,
                            type(err).__name__, exc_info=True,
                            extra={"event_id": event_id, "group": self.settings.group,
                                   "consumer": self.name, "error": type(err).__name__})

    def _schedule_retry(self, at_ms: int | None) -> None:
        """A pending pass when the earliest retry of the batch is due (if before the one
        already scheduled), not at a fixed interval. A retry due at once (a policy without
        delay) waits for the next ``claim_interval_ms`` pass instead: never a hot loop."""
        wait_ms = None if at_ms is None else at_ms - now_ms()
        if wait_ms is None or wait_ms <= 0:
            return
        due = time.monotonic() + wait_ms / 1000
        if self._retry_due is None or due < self._retry_due:
            self._retry_due = due

    def _ensure_groups(self) -> None:
        if not self._groups_ready:
            streams.ensure_groups(self.client, self.keys, self.settings.group)
            self._groups_ready = True

    def _sleep_backoff(self, err: UnavailableError) -> None:
        self._backoff.sleep(err, self._stop, log)
