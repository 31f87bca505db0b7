"""The consumer's counters: what each batch's outcomes add to them, and the warning when
Redis brought back trimmed entries (the torture counts those from it, torture/procs.py).

:class:`ConsumerStats` is what :meth:`consumer.daemon.Consumer.run` returns and the metrics
(consumer/metrics.py) read.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from outbox_relay.consumer import inbox

# The consumer daemon's logger, which these records always had: operators and the torture
# (torture/procs.py) filter on it.
log = logging.getLogger("outbox_relay.consumer.daemon")


@dataclass
class ConsumerStats:
    """Counters since start."""

    read: int = 0
    applied: int = 0
    duplicates: int = 0
    superseded: int = 0  # latest-ordered events older than the applied revision
    dead: int = 0
    out_of_order: int = 0  # strict events older than the applied revision (also in ``dead``)
    failed: int = 0
    waiting: int = 0  # strict events held behind an earlier failing/waiting one (not acked)
    invalid: int = 0
    autoclaimed: int = 0  # pending entries re-read by a pending pass (retries, takeovers)
    taken_over: int = 0  # pending entries moved to us from another consumer of the group
    lease_losses: int = 0  # claims refused because a partition stream was taken over
    lost: int = 0  # entries that vanished from the stream while pending (receipt ``lost``)
    resurrected: int = 0  # trimmed entries Redis brought back (acked, not applied again)
    retried: int = 0  # failures given a later attempt (consumer/retry.py; also in ``failed``)
    conflicting: int = 0  # redelivered ids carrying other data (also in ``dead``)


def warn_resurrected(outcomes: list[inbox.Outcome], group: str) -> None:
    """Say so when Redis brought back entries that were trimmed (``resurrected``: acked, not
    applied): a failover without ``WAIT`` or a restored old snapshot; never silent."""
    back = [o.delivery for o in outcomes if o.outcome == inbox.RESURRECTED]
    if back:
        log.warning("%d entries below their streams' trim floor were delivered again (Redis "
                    "brought back trimmed entries: a failover without WAIT, or an old snapshot)"
                    "; acknowledged without applying them", len(back),
                    extra={"group": group, "stream_key": back[0].key,
                           "entry_id": back[0].entry_id, "resurrected": len(back)})


def count(stats: ConsumerStats, o: inbox.Outcome) -> None:
    """Count one claim outcome in ``stats``."""
    attr = {"duplicate": "duplicates"}.get(o.outcome, o.outcome)
    setattr(stats, attr, getattr(stats, attr) + 1)
    if o.outcome == inbox.DEAD and o.error == inbox.OUT_OF_ORDER:
        stats.out_of_order += 1
    elif o.outcome == inbox.DEAD and o.error == inbox.CONFLICTING_DUPLICATE:
        stats.conflicting += 1
    elif o.outcome == inbox.FAILED and o.retry_at_ms is not None:
        stats.retried += 1
