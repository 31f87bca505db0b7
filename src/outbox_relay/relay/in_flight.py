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
from outbox_relay.shared.errors import StreamBehindError, UnavailableError

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
        code = "unknown_outcome"
        if isinstance(err, StreamBehindError):  # Redis lost data: refill before appending
            relay.repairer.check_soon()
            code = err.code  # what `outbox status` shows as the rows' last error
        relay.stats.unknown_outcomes += len(rows)
        if relay.metrics is not None:
            relay.metrics.append_failed(code, len(rows))
        store.record_unknown(relay.engine, rows[0].partition, [r.seq for r in rows], code)
        raise
    if not confirmed:
        log.warning("durability barrier not met; %d entries stay unmarked", len(rows))
        raise UnavailableError("replicas did not confirm the batch in time")
    faults.point("relay.after_xadd")
    return verdicts


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
