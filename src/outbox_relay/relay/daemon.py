"""The relay loop: own partitions, take → append → settle, repeat.

A round visits the partitions we hold (on PostgreSQL, those notified since the last round):
:func:`relay.store.take_batches` takes a batch from each in one short transaction →
:func:`relay.append.append` per partition (one script call per stream, fenced by the lease
epoch in Redis, no transaction open) → optional durability barrier →
:func:`relay.store.settle_batches` marks them all in one short transaction, fenced per
partition, and takes each clean partition's next rows for the next round (those committed
while the round appended go out without a take transaction of their own: a steady trickle is
one transaction per round). A partition whose batch came back full has a backlog: it goes on
in a chain of its own (:meth:`Relay.relay_partition`), where :func:`relay.store.settle`
settles a batch and takes the one after the batch in flight in the same transaction.
A batch that does not land whole (a gap, a refusal) ends the partition's round: the batch
taken after it is never appended, and the next round takes again from the lowest pending
row, so no row of an aggregate overtakes an earlier one. Failures of Redis or the database back
off exponentially with jitter; nothing is marked while the outcome is unknown. A stream whose
append Redis refuses (OOM, ACL …) backs off alone, its rows not taken until its next attempt
(relay/refusals.py); a gap has the repair check look at its stream, whose top may be a foreign
entry (relay/repair.py).
``SIGTERM``/``SIGINT`` let the in-flight round finish, release the leases, exit 0.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import redis
from sqlalchemy import Engine

from outbox_relay.relay import (
    append,
    backlog,
    counters,
    in_flight,
    outgoing,
    refusals,
    repair,
    store,
    trim,
)
from outbox_relay.relay.leases import acquire_leases, release_leases
from outbox_relay.relay.prune import PruneStats
from outbox_relay.relay.wakeup import Wakeup
from outbox_relay.shared import faults, keys, partition_counts
from outbox_relay.shared.daemon_control import Backoff, stop_on_signals
from outbox_relay.shared.db import is_postgres
from outbox_relay.shared.errors import LeaseLostError, OutboxError, UnavailableError
from outbox_relay.shared.periodic import Periodic, run_due
from outbox_relay.shared.periodic import shutdown as shutdown_periodic
from outbox_relay.shared.progress import Progress, age_text
from outbox_relay.shared.settings import RelaySettings

if TYPE_CHECKING:
    from outbox_relay.relay.metrics import RelayMetrics

log = logging.getLogger(__name__)

# The relay thread and the append thread take turns on the GIL. With CPython's default 5 ms
# switch interval, a database reply that arrives while the append thread builds a pipeline
# waits up to 5 ms for its turn: the fence statement of a settle took 5.5 ms instead of 2,
# and a backlog drained ~15% slower (bench/PERFORMANCE.md). Set while ``run`` runs.
SWITCH_INTERVAL_S = 0.0002


class Relay:
    """A relay process's state: its node id, leases, clients and counters."""

    def __init__(self, settings: RelaySettings, engine: Engine, client: redis.Redis) -> None:
        self.settings = settings
        self.engine = engine
        self.client = client
        self.node_id = settings.node_id or f"{socket.gethostname()}:{os.getpid()}"
        self.leases: dict[int, int] = {}
        self.stats = counters.RelayStats()
        self.wakeup = Wakeup(settings.poll_min_ms, settings.poll_max_ms)
        self.repairer = repair.Repairer(settings, engine, client, self.node_id)
        self.repairer.on_wanted = self.wakeup.notify  # a check asked for: the next round runs it
        # Streams whose append Redis refused wait with backoff, alone (relay/refusals.py).
        self.refusals = refusals.StreamBackoff(settings.refusal_first_delay_s,
                                               settings.refusal_max_delay_s)
        self._waiting: dict[int, frozenset[str]] = {}  # this round's backing-off streams
        self._stop = threading.Event()
        self._next_lease_check = 0.0
        self._backoff = Backoff()
        self._found_rows = False
        self._found_in: set[int] = set()  # partitions with rows new to the round
        self._append_thread: ThreadPoolExecutor | None = None
        self._busy: set[int] = set()  # partitions whose last visit said there may be more
        # Batches a round's settle took for the next round (store.settle_batches ``take``):
        # partition -> (epoch, rows), recorded on the lease row, not yet appended.
        self._pretaken: dict[int, tuple[int, list[outgoing.OutboxRow]]] = {}
        # Observation (relay/metrics.py, cli/observe.py): hooks when metrics are on, the
        # liveness heartbeat and the last successful lease round (monotonic seconds).
        self.metrics: RelayMetrics | None = None
        self.last_loop = self.leases_tried_at = time.monotonic()
        self.trimmer = trim.Trimmer(settings, engine, client, lock=self.repairer.lock)
        self._streams_seen: set[tuple[str, int]] = set()  # delivered to by this process
        self.prune_stats: PruneStats | None = None  # set by cli/prune.py (retention task)
        # Housekeeping between rounds (trimming, retention): see shared/periodic.py. The
        # trim and the repair check run on threads of their own (their modules say why it is
        # safe), with copies of the leases and streams taken on this thread.
        self.periodic: list[Periodic] = [
            # The streams the repair check found and those delivered to since: a stream is
            # trimmed (and its groups become known, so a Redis loss cannot trim what a group
            # not yet back never read) from its first delivery, not from the next check.
            Periodic("stream trim", settings.trim_interval_s, self.trimmer.run, background=True,
                     inputs=lambda: (dict(self.leases),
                                     self.repairer.streams | self._streams_seen)),
            # The check first runs on this thread when the partitions are won
            # (Repairer.maybe_run), so the screen's first run is one interval later.
            Periodic("repair check", self.repairer.interval_s, self.repairer.screen,
                     background=True, inputs=lambda: (dict(self.leases),),
                     next_at=time.monotonic() + self.repairer.interval_s),
            # A stream first written with another partition count would be stranded in part:
            # refuse to run (invalid_config), at the first round and every 30 s.
            Periodic("partition count check", partition_counts.CHECK_INTERVAL_S,
                     lambda: partition_counts.check(engine, settings.partitions, "this relay")),
        ]
        self._progress = Progress()
        if settings.progress_interval_s:  # the first line after one interval, not at start
            self.periodic.append(Periodic(
                "progress", settings.progress_interval_s, self.log_progress,
                next_at=time.monotonic() + settings.progress_interval_s))

    def log_progress(self) -> str:
        """Log (INFO) and return the progress line (shared/progress.py): events delivered
        since the last line and their rate, the total, the partitions held, and the backlog
        of every partition (undelivered rows, the longest a deliverable one has waited)."""
        done, rate = self._progress.since_last(self.stats.delivered)
        rows = backlog.backlog(self.engine)
        waiting = sum(r.rows for r in rows)
        # By the database's clock, which wrote available_at_ms (relay/backlog.py).
        waited = max((r.waited_ms for r in rows), default=None)
        age = None if waited is None else waited / 1000
        line = (f"relay {self.node_id}: delivered {done:,} events ({rate:,.1f}/s, "
                f"{self.stats.delivered:,} since start); partitions held "
                f"{','.join(map(str, sorted(self.leases))) or 'none'}; backlog {waiting:,} rows, "
                f"oldest waiting {age_text(age)}")
        log.info("%s", line, extra={"node": self.node_id, "delivered": done,
                                    "backlog": waiting})
        return line

    def append_thread(self) -> ThreadPoolExecutor:
        """The one thread that runs in-flight appends (created on first use)."""
        if self._append_thread is None:
            self._append_thread = ThreadPoolExecutor(1, thread_name_prefix="outbox-append")
        return self._append_thread

    def stop(self) -> None:
        """Ask the loop to finish its round and return (safe from a signal handler)."""
        self._stop.set()
        self.wakeup.stop()

    def install_signal_handlers(self) -> None:
        """SIGTERM and SIGINT stop the loop gracefully."""
        stop_on_signals(self.stop, log, "round")

    def run(self, *, until_idle: bool = False) -> counters.RelayStats:
        """Relay until stopped (or, with ``until_idle``, until a round finds nothing to do here
        and no other relay holds rows to send, or after ``startup_timeout_s`` of rounds that all
        failed ``unavailable``)."""
        if is_postgres(self.engine) and not until_idle:
            self.wakeup.listen_postgres(
                self.engine.url.render_as_string(hide_password=False),
                keys.notify_channel(self.settings.key_prefix),
            )
        log.info("relay %s started", self.node_id, extra={"node": self.node_id})
        switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        failing_since: float | None = None
        try:
            while not self._stop.is_set():
                self.last_loop = time.monotonic()
                try:
                    busy = self.run_once()
                    others = until_idle and not busy and self._others_have_work()
                    self._backoff.reset()
                    failing_since = None
                except UnavailableError as err:
                    # A daemon waits for Redis or the database as long as it takes; a script's
                    # `--until-idle` run gives up after startup_timeout_s of nothing but errors
                    # instead of hanging its CI job.
                    self.wakeup.visit_everything()  # the round may have left rows anywhere
                    failing_since = failing_since or self.last_loop
                    if until_idle and (self.last_loop - failing_since
                                       >= self.settings.startup_timeout_s):
                        raise
                    self._sleep_backoff(err)
                    continue
                if busy:
                    self.wakeup.worked(self._found_in)
                elif until_idle:
                    if not others:
                        break
                    self.wakeup.wait()
                else:
                    if self._found_rows:  # a trickle of work: keep polling at the short interval
                        self.wakeup.worked(self._found_in)
                    self.wakeup.wait()
            self._send_pretaken()
        finally:
            sys.setswitchinterval(switch_interval)
            shutdown_periodic(self.periodic)
            self._release()
            if self._append_thread is not None:
                self._append_thread.shutdown(wait=True)
                self._append_thread = None
        log.info("relay %s stopped: %s", self.node_id, self.stats, extra={"node": self.node_id})
        return self.stats

    def _others_have_work(self) -> bool:
        """``--until-idle`` with nothing left in our partitions: is the outbox idle, or do
        partitions we do not hold still have rows to send? Relays started together must split
        the partitions, not leave them all to the first one: while another relay holds rows to
        send, this one stays, checks leases every round and takes its share as soon as the
        other gives it up (at its next lease round) or stops (or its lease expires)."""
        waiting = store.sendable_elsewhere(self.engine, self.settings.partitions,
                                           set(self.leases))
        if waiting:
            self._next_lease_check = 0.0
            log.debug("waiting for partitions %s held by another relay", waiting,
                      extra={"node": self.node_id})
        return bool(waiting)

    def run_once(self) -> bool:
        """One round over our partitions (on PostgreSQL, those notified since the last round,
        see relay/wakeup.py); True if any partition had a full batch or errors, or the
        round's settle took the next round's rows."""
        self.stats.rounds += 1
        self._found_rows = False
        targets = self.wakeup.targets()
        held = set(self.leases)
        self._refresh_leases()
        self.repairer.maybe_run(self.leases)
        run_due(self.periodic)
        pretaken = self._held_pretaken()
        if targets is not None:  # notified partitions, the busy ones, and any newly leased
            targets |= self._busy | (set(self.leases) - held) | set(self._pretaken)
        known, self._busy = self._busy, set()
        self._found_in = set()
        epochs = {p: e for p, e in self.leases.items() if targets is None or p in targets}
        if not epochs or self._stop.is_set():
            return False  # what was taken stays for _send_pretaken
        self._pretaken = {}
        s = self.settings
        self._waiting = self.refusals.waiting()
        to_take = {p: e for p, e in epochs.items() if p not in pretaken}
        taken, lost = store.take_batches(
            self.engine, self.node_id, to_take, s.batch_size, s.lease_ttl_ms, self._waiting
        ) if to_take else ({}, [])
        for partition in lost:
            self._lease_lost(partition, epochs[partition])
        if taken:
            faults.point("relay.after_take")
        taken.update(pretaken)
        # Where the round has rows that no earlier round said were coming (Wakeup.worked):
        # its own take's, and the last settle's (rows a notification named, or not).
        self._found_in = set(taken) - known
        if not taken:
            return False
        self._found_rows = True
        full = {p: rows for p, rows in taken.items() if len(rows) >= s.batch_size}
        self._busy = self._relay_round(
            {p: rows for p, rows in taken.items() if p not in full}, epochs, take_next=True,
            chained=set(full))
        for partition, rows in full.items():  # a backlog: the chain of overlapped batches
            try:
                if self.relay_partition(partition, epochs[partition], rows):
                    self._busy.add(partition)
            except LeaseLostError:
                self._lease_lost(partition, epochs[partition])
        return bool(self._busy or self._pretaken)

    def _held_pretaken(self) -> dict[int, list[outgoing.OutboxRow]]:
        """What the last round's settle took, under a lease we still hold by the same epoch
        (any other stays recorded on its lease row: its next take retries it by id)."""
        return {p: rows for p, (e, rows) in self._pretaken.items() if self.leases.get(p) == e}

    def _chores_due(self) -> bool:
        """Whether the next round starts with housekeeping on this thread (a lease round, the
        repair check, a periodic task): rows taken for it now would wait behind that work, so
        that round takes its own after it, as before."""
        now = time.monotonic()
        return (now >= self._next_lease_check or self.repairer.due(now)
                or any(now >= t.next_at for t in self.periodic if not t.background))

    def _send_pretaken(self) -> None:
        """On the way out, append and settle what the last round's settle took (nothing is
        taken again), so a stopped relay leaves no batch recorded for its successor to retry.
        Failing that, the rows stay recorded and the next owner retries them by id."""
        pretaken = self._held_pretaken()
        self._pretaken = {}
        if not pretaken:
            return
        try:
            self._relay_round(pretaken, dict(self.leases), take_next=False)
        except UnavailableError:
            log.warning("could not send the last taken batches; the next owner retries them",
                        extra={"node": self.node_id})

    def _lease_lost(self, partition: int, epoch: int) -> None:
        self.stats.lease_losses += 1
        log.warning("lost the lease of partition %s", partition,
                    extra={"node": self.node_id, "partition": partition, "epoch": epoch})
        self.leases.pop(partition, None)
        self.refusals.forget_partition(partition)

    def _relay_round(
        self, taken: dict[int, list[outgoing.OutboxRow]], epochs: dict[int, int], *,
        take_next: bool, chained: set[int] | None = None,
    ) -> set[int]:
        """Append the partial batches of a round (one Redis round trip for all), and settle
        them all in **one** transaction; returns the partitions that may have more.

        With ``take_next``, that transaction also takes the next batch of each partition
        whose batch landed whole (:func:`store.settle_batches`), for the next round: the rows
        committed while this round appended go out without a take transaction of their own
        and without waiting for a notification. Not after a gap, a refusal or a retry (their
        rows follow the round's usual rules: a refused stream backs off). It also takes the
        next batch of the partitions notified while the round ran (:meth:`_settle_all`), but
        not of those in ``chained`` (their full batch goes on to the backlog chain).

        At a trickle a round takes a few rows in each notified partition: one take and one
        settle transaction for all of them, instead of two per partition, and their appends
        in one Redis round trip (:func:`relay.in_flight.finish_round`), is what keeps the time
        from commit to ``XADD`` short. A partition whose append has an unknown outcome (its
        rows are recorded as such) is not settled and the round raises once the batches that
        landed are settled; its batch stays recorded on its lease row and is retried under the
        same ids by the next round.
        """
        landed: list[tuple[list[outgoing.OutboxRow], append.Verdicts]] = []
        error: OutboxError | None = None
        outcomes = in_flight.finish_round(self, [(rows, epochs[p]) for p, rows in taken.items()])
        for (partition, rows), outcome in zip(taken.items(), outcomes, strict=True):
            if isinstance(outcome, append.Verdicts):
                landed.append((rows, outcome))
            elif isinstance(outcome, LeaseLostError):
                self._lease_lost(partition, epochs[partition])
            else:
                error = error or outcome
        if landed:
            self._settle_all(landed, epochs, take_next=take_next and error is None,
                             chained=chained or set())
        if error is not None:
            raise error
        return {rows[0].partition for rows, verdicts in landed if self._more(rows, verdicts)}

    def _settle_all(
        self, landed: list[tuple[list[outgoing.OutboxRow], append.Verdicts]],
        epochs: dict[int, int], *, take_next: bool, chained: set[int],
    ) -> None:
        """Settle several partitions' batches in one transaction (:func:`store.settle_batches`);
        with ``take_next``, keep what it took for the next round (:meth:`_relay_round`), unless
        the relay is stopping or the next round starts with housekeeping
        (:meth:`_chores_due`).

        What it takes: the next batch of each partition it settles whole, and of each other
        partition we hold that a notification named while the round ran (``also``; none in
        ``chained``). At a trickle over several partitions the rows committed during a round
        are mostly in partitions the round did not settle: taken here, they go out with the
        next round's append instead of after a take transaction of their own (on PostgreSQL;
        SQLite has no notifications)."""
        s = self.settings
        take_next = take_next and not (self._stop.is_set() or self._chores_due())
        settled = {rows[0].partition for rows, _v in landed}
        also = {p: e for p in self.wakeup.named_now() - settled - chained
                if (e := self.leases.get(p)) is not None} if take_next else {}
        outcomes, news, clean = [], {}, set()
        for rows, v in landed:
            partition = rows[0].partition
            news[partition] = {(r.stream, r.partition) for r in rows} - self._streams_seen
            outcomes.append(store.Settlement(
                partition, epochs[partition], v.delivered, v.gaps, v.failed, v.stream_top,
                news[partition] if v.delivered else set(), drop_recorded=not v.complete))
            if take_next and v.complete and not rows[0].retry:
                clean.add(partition)
        lost, taken = store.settle_batches(
            self.engine, self.node_id, s.lease_ttl_ms, outcomes, take=frozenset(clean),
            batch_size=s.batch_size, waiting=self._waiting, also=also)
        faults.point("relay.after_mark")
        if taken:
            faults.point("relay.after_take")
            self._pretaken = {p: (also[p] if p in also else epochs[p], rows)
                             for p, rows in taken.items()}
        for partition in lost:
            self._lease_lost(partition, epochs[partition])
        for rows, v in landed:
            if rows[0].partition not in lost:
                self._count(v, news[rows[0].partition])
                self._note_streams(rows, v)

    def relay_partition(
        self, partition: int, epoch: int, first: list[outgoing.OutboxRow] | None = None
    ) -> bool:
        """Take (or start with ``first``, taken by the round), append and settle batches of one
        partition; True if there may be more.

        Database and Redis work overlap, and the steady state is one transaction per batch:
        while batch N+1's append script is in flight (on the append thread), one
        transaction settles batch N and takes batch N+2 (rows after N+1's last seq, under
        ids above N+1's). At most one batch of a partition is in flight, so entries reach the
        stream in id order; no transaction is open during a Redis call; every take and settle
        is fenced by the epoch; taken batches are recorded on the lease row before their
        ``XADD``, so any retry uses the same ids. The chain stops taking after a short time
        budget so the other partitions get their round.

        Order per aggregate: a take holds back any row with an earlier undelivered row of its
        aggregate outside the batch in flight (:func:`relay.store.take_batch`), and the batch after
        one that did not land whole is never appended (it was taken assuming the one in
        flight would land): that batch's settle forgets it and ends the round.
        """
        s = self.settings
        current = first if first is not None else self._take(partition, epoch, None)
        if not current:
            return False
        self._found_rows = True
        deadline = time.monotonic() + min(1.0, s.lease_ttl_ms / 10_000)

        def chained(rows: list[outgoing.OutboxRow]) -> bool:
            """Whether to take the batch after ``rows`` while ``rows`` is in flight."""
            return (
                len(rows) >= s.batch_size
                and time.monotonic() < deadline
                and not self._stop.is_set()
            )

        if not chained(current):  # nothing to overlap with: append inline
            verdicts = in_flight.finish(self, in_flight.InFlight(self, current, epoch), current)
            self._settle(partition, epoch, current, verdicts, None)
            return self._more(current, verdicts)
        flight: in_flight.InFlight | None = in_flight.InFlight(self, current, epoch).start()
        following = self._take(partition, epoch, _last_seq(current), inflight=current)
        try:
            while True:
                assert flight is not None
                verdicts = in_flight.finish(self, flight, current)
                flight = None
                if not verdicts.complete:  # `following` must not overtake what is left behind
                    self._settle(partition, epoch, current, verdicts, None)
                    return self._more(current, verdicts)
                flight = in_flight.InFlight(self, following, epoch).start() if following else None
                after = _last_seq(following) if following and chained(following) else None
                taken = self._settle(partition, epoch, current, verdicts, after, following)
                more = self._more(current, verdicts)
                if flight is None:
                    return more
                current, following = following, taken
        finally:
            if flight is not None:  # an error while the next batch was in flight
                flight.wait_quietly()

    def _more(self, rows: list[outgoing.OutboxRow], verdicts: append.Verdicts) -> bool:
        """Whether the partition may have more work right away after this batch (not after a
        refusal: Redis refusing now, OOM or ACL, would refuse a hot retry too)."""
        if verdicts.failed:
            return False
        return (
            len(rows) >= self.settings.batch_size
            or bool(verdicts.gaps or verdicts.not_appended)
            or rows[0].retry
        )

    def _take(
        self,
        partition: int,
        epoch: int,
        after_seq: int | None,
        inflight: list[outgoing.OutboxRow] | None = None,
    ) -> list[outgoing.OutboxRow]:
        s = self.settings
        rows = store.take_batch(
            self.engine, partition, self.node_id, epoch, s.batch_size, s.lease_ttl_ms,
            after_seq=after_seq, inflight=[r.seq for r in inflight or ()],
            waiting=self._waiting.get(partition, frozenset()),
        )
        if rows:
            faults.point("relay.after_take")
        return rows

    def _settle(
        self,
        partition: int,
        epoch: int,
        rows: list[outgoing.OutboxRow],
        verdicts: append.Verdicts,
        take_after: int | None,
        inflight: list[outgoing.OutboxRow] | None = None,
    ) -> list[outgoing.OutboxRow]:
        """Settle a batch; with ``take_after``, take the next one in the same transaction
        (``inflight``: the batch appended meanwhile). A batch that did not land whole drops
        every recorded batch (the one taken after it was never appended)."""
        s = self.settings
        new_streams = {(stream, partition) for stream in {r.stream for r in rows}}
        new_streams -= self._streams_seen
        taken = store.settle(
            self.engine, partition, self.node_id, epoch, s.lease_ttl_ms,
            delivered=verdicts.delivered, gaps=verdicts.gaps, failed=verdicts.failed,
            stream_top=verdicts.stream_top, take_after=take_after, batch_size=s.batch_size,
            inflight=[r.seq for r in inflight or ()], drop_recorded=not verdicts.complete,
            register=new_streams if verdicts.delivered else set(),
            waiting=self._waiting.get(partition, frozenset()),
        )
        faults.point("relay.after_mark")
        self._count(verdicts, new_streams)
        self._note_streams(rows, verdicts)
        if taken:
            faults.point("relay.after_take")
        return taken

    def _count(self, verdicts: append.Verdicts, new_streams: set[tuple[str, int]]) -> None:
        """Count a settled batch; its streams are now known to hold delivered rows."""
        if verdicts.delivered:
            self._streams_seen |= new_streams
        self.stats.delivered += len(verdicts.delivered)
        self.stats.already_present += verdicts.already
        self.stats.ordering_gaps += len(verdicts.gaps)
        self.stats.failed += len(verdicts.failed)
        self.stats.not_appended += len(verdicts.not_appended)

    def _note_streams(self, rows: list[outgoing.OutboxRow], verdicts: append.Verdicts) -> None:
        """A settled batch's news per stream: a refusal starts or continues its backoff, an
        append that landed whole ends it (relay/refusals.py); a gap asks the repair check to
        look at the stream (its top may be foreign, relay/repair.py)."""
        if not (verdicts.failed or verdicts.gaps or self.refusals.refused):
            return  # the common case: nothing refused, now or before (the hot path stays flat)
        by_seq = {r.seq: r for r in rows}
        refused: dict[tuple[str, int], str] = {}
        for seq, code in verdicts.failed:
            row = by_seq[seq]
            refused[(row.stream, row.partition)] = code
        for seq in verdicts.gaps:
            row = by_seq[seq]
            self.repairer.check_soon((row.stream, row.partition))
        landed = {(by_seq[seq].stream, by_seq[seq].partition) for seq, _ in verdicts.delivered}
        for stream, code in refused.items():
            self.refusals.outcome(stream, code)
        for stream in landed - set(refused):
            self.refusals.outcome(stream, None)

    def _refresh_leases(self) -> None:
        now = time.monotonic()
        if now < self._next_lease_check:
            return
        s = self.settings
        leases = acquire_leases(self.engine, self.node_id, s.partitions, s.lease_ttl_ms)
        self.leases_tried_at = now  # a lease round that succeeded (readiness)
        self.stats.lease_acquisitions += sum(self.leases.get(p) != e for p, e in leases.items())
        self.leases = leases
        self._next_lease_check = now + s.lease_ttl_ms / 3000

    def _sleep_backoff(self, err: UnavailableError) -> None:
        self._next_lease_check = 0.0
        self._backoff.sleep(err, self._stop, log)

    def _release(self) -> None:
        if not self.leases:
            return
        try:
            release_leases(self.engine, self.node_id, self.leases)
        except UnavailableError:
            log.warning("could not release leases; they expire by themselves")
        self.leases = {}
        self._next_lease_check = 0.0  # a later run() leases again at once


def _last_seq(rows: list[outgoing.OutboxRow]) -> int:
    """The greatest seq of a batch (rows are in id order, which is seq order but for rows an
    earlier relay version took)."""
    return max(r.seq for r in rows)
