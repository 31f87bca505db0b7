"""One batch in flight: its Redis side (append script, durability barrier) and its outcome.

The relay overlaps database and Redis work (:meth:`relay.daemon.Relay.relay_partition`): a
batch's append runs inline or on the relay's one append thread (:class:`InFlight`) while the
relay thread settles the batch before it and takes the one after. :func:`finish` waits for
it; an outcome Redis never told (the relay cannot know whether the entries landed) is recorded
on the rows (:func:`relay.store.record_unknown`) and re-raised, so nothing is marked.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING

from outbox_relay.relay import append, outgoing, store
from outbox_relay.shared import faults, keys
from outbox_relay.shared.errors import OutboxError, StreamBehindError, UnavailableError

if TYPE_CHECKING:
    from outbox_relay.relay.daemon import Relay

# The relay daemon's logger, which these records always had: operators filter on it.
log = logging.getLogger("outbox_relay.relay.daemon")


def append_batch(
    relay: Relay, rows: list[outgoing.OutboxRow], epoch: int
) -> tuple[append.Verdicts, bool]:
    """The Redis side of a batch: the append script, then the optional durability barrier."""
    s = relay.settings
    started = time.perf_counter()
    verdicts = append.append(relay.client, s.key_prefix, rows, epoch, s.stream_maxlen_unsafe,
                             relay.repairer.floors, relay.repairer.signer)
    if relay.metrics is not None:
        relay.metrics.appended(len(rows), verdicts, time.perf_counter() - started)
    if not verdicts.delivered or not (s.wait_replicas > 0 or s.wait_aof):
        return verdicts, True  # no barrier asked: the keys are not even looked at
    streams = {(r.stream, r.partition) for r in rows}
    written = sorted(keys.stream_key(s.key_prefix, stream, p) for stream, p in streams)
    confirmed = append.durability_barrier(
        relay.client, s.wait_replicas, s.wait_timeout_ms, s.wait_aof, written)
    return verdicts, confirmed


def finish(relay: Relay, flight: InFlight, rows: list[outgoing.OutboxRow]) -> append.Verdicts:
    """Wait for a batch's append; an unknown outcome is recorded and re-raised."""
    try:
        verdicts, confirmed = flight.result()
    except UnavailableError as err:
        _unknown(relay, rows, err)
        raise
    if not confirmed:
        log.warning("durability barrier not met; %d entries stay unmarked", len(rows))
        raise UnavailableError("replicas did not confirm the batch in time")
    faults.point("relay.after_xadd")
    return verdicts


def finish_round(
    relay: Relay, batches: list[tuple[list[outgoing.OutboxRow], int]]
) -> list[append.Verdicts | OutboxError]:
    """The appends of a round's batches ``(rows, epoch)``, one per partition
    (:meth:`relay.daemon.Relay._relay_round`), with one Redis round trip
    (:func:`relay.append.append_many`), each judged as :func:`finish` judges one, in order:
    its verdicts, or its error returned, not raised (the other batches' outcomes stand). An
    unknown outcome is recorded on its rows; with a durability barrier asked, one barrier
    covers every batch that landed, and when it is not met none of them is marked."""
    s = relay.settings
    started = time.perf_counter()
    try:
        outcomes = append.append_many(relay.client, s.key_prefix, batches,
                                      s.stream_maxlen_unsafe, relay.repairer.floors,
                                      relay.repairer.signer)
    except UnavailableError as err:
        outcomes = [err for _ in batches]
    if relay.metrics is not None:
        elapsed = time.perf_counter() - started
        for (rows, _epoch), outcome in zip(batches, outcomes, strict=True):
            if isinstance(outcome, append.Verdicts):
                relay.metrics.appended(len(rows), outcome, elapsed)
    if s.wait_replicas > 0 or s.wait_aof:
        _barrier(relay, batches, outcomes)
    for (rows, _epoch), outcome in zip(batches, outcomes, strict=True):
        if isinstance(outcome, UnavailableError) and not isinstance(outcome, _NotConfirmed):
            _unknown(relay, rows, outcome)
    if any(isinstance(o, append.Verdicts) for o in outcomes):
        faults.point("relay.after_xadd")
    return outcomes


def _barrier(relay: Relay, batches: list[tuple[list[outgoing.OutboxRow], int]],
             outcomes: list[append.Verdicts | OutboxError]) -> None:
    """One durability barrier over every batch of the round that landed; when it is not
    met (or its outcome is unknown) each of them becomes that error in ``outcomes``."""
    s = relay.settings
    landed = [i for i, o in enumerate(outcomes) if isinstance(o, append.Verdicts) and o.delivered]
    if not landed:
        return
    written = sorted({keys.stream_key(s.key_prefix, r.stream, r.partition)
                      for i in landed for r in batches[i][0]})
    try:
        confirmed = append.durability_barrier(relay.client, s.wait_replicas,
                                              s.wait_timeout_ms, s.wait_aof, written)
    except UnavailableError as err:
        for i in landed:
            outcomes[i] = err
        return
    if not confirmed:
        log.warning("durability barrier not met; %d entries stay unmarked",
                    sum(len(batches[i][0]) for i in landed))
        for i in landed:
            outcomes[i] = _NotConfirmed("replicas did not confirm the batch in time")


class _NotConfirmed(UnavailableError):
    """The durability barrier was not met: the batch landed, and is not marked (not an
    unknown outcome: nothing is recorded on its rows)."""


def _unknown(relay: Relay, rows: list[outgoing.OutboxRow], err: UnavailableError) -> None:
    """A batch whose outcome Redis never told: counted, and recorded on its rows (its next
    attempt is a retry by id); Redis found behind asks for the repair check first."""
    code = "unknown_outcome"
    if isinstance(err, StreamBehindError):  # Redis lost data: refill before appending
        relay.repairer.check_soon()
        code = err.code  # what `outbox status` shows as the rows' last error
    relay.stats.unknown_outcomes += len(rows)
    if relay.metrics is not None:
        relay.metrics.append_failed(code, len(rows))
    store.record_unknown(relay.engine, rows[0].partition, [r.seq for r in rows], code)


class InFlight:
    """One batch's append, inline (``result`` runs it) or on the relay's append thread (``start``).

    The append thread is long-lived: starting a thread per batch made the relay thread wait
    for the new thread to be scheduled (≈6 ms per batch on a loaded 2-core machine, 12% of a
    backlog drain). Still one batch in flight at a time: ``start`` follows the previous
    batch's ``result``.
    """

    def __init__(self, relay: Relay, rows: list[outgoing.OutboxRow], epoch: int) -> None:
        self._relay, self._rows, self._epoch = relay, rows, epoch
        self._future: Future[None] | None = None
        self._outcome: tuple[append.Verdicts, bool] | None = None
        self._error: BaseException | None = None

    def start(self) -> InFlight:
        self._future = self._relay.append_thread().submit(self._run)
        return self

    def _run(self) -> None:
        try:
            self._outcome = append_batch(self._relay, self._rows, self._epoch)
        except BaseException as err:  # handed to the relay thread by result()
            self._error = err

    def result(self) -> tuple[append.Verdicts, bool]:
        if self._future is None:
            self._run()
        else:
            self._future.result()  # _run keeps its own error
        if self._error is not None:
            raise self._error
        assert self._outcome is not None
        return self._outcome

    def wait_quietly(self) -> None:
        """Let an in-flight append finish; its rows stay unmarked and are retried by id."""
        if self._future is not None:
            self._future.result()
        if self._error is not None:
            log.debug("in-flight append failed during an error", exc_info=self._error)
