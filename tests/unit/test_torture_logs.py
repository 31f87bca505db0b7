"""The torture reads counts from its daemons' logs (torture/procs.py): the lines it matches are
the ones the daemons write, formatted by our own log handler."""

from __future__ import annotations

import io
import logging
from datetime import UTC, datetime
from pathlib import Path

from outbox_relay.consumer import counters, inbox, ordering
from outbox_relay.shared.envelope import Event
from outbox_relay.shared.logs import make_handler
from torture.procs import Child


def _outcome(entry_id: str) -> inbox.Outcome:
    event = Event(id=f"e-{entry_id}", type="t", source="tests", time=datetime.now(UTC), data={})
    return inbox.Outcome(inbox.Delivery("p:{s:0}", entry_id, event, 1), inbox.RESURRECTED)


def test_resurrected_entries_are_counted_from_the_consumers_own_warning(tmp_path: Path) -> None:
    written = io.StringIO()
    handler = make_handler("text", written)
    logger = logging.getLogger("outbox_relay.consumer.daemon")
    logger.addHandler(handler)
    try:
        counters.warn_resurrected([_outcome("1-1"), _outcome("1-2"), _outcome("1-3")], "g")
        counters.warn_resurrected([_outcome("2-1")], "g")
        counters.warn_resurrected([], "g")  # nothing came back: nothing said
    finally:
        logger.removeHandler(handler)
    log = tmp_path / "consumer-0.00001.log"
    log.write_text(written.getvalue())
    child = Child("consumer-0", "consumer", [], {}, tmp_path, logs=[log])
    assert child.resurrected_entries() == 4


class _Injected(RuntimeError):
    """Stands in for the torture's TransientError."""


def test_failed_handler_calls_are_counted_from_the_consumers_own_warning(tmp_path: Path) -> None:
    written = io.StringIO()
    handler = make_handler("text", written)
    logger = logging.getLogger("outbox_relay.consumer.ordering")
    logger.addHandler(handler)
    delivery = _outcome("1-1").delivery
    try:
        for attempts in (1, 2):
            try:
                raise _Injected("injected")
            except _Injected as err:
                ordering._log_failure(delivery, "_Injected", err, "g", attempts, delay_ms=500)
        try:
            raise ValueError("other")
        except ValueError as err:  # another exception: not counted as the injected one
            ordering._log_failure(delivery, "ValueError", err, "g", dead="rejected")
    finally:
        logger.removeHandler(handler)
    log = tmp_path / "consumer-0.00001.log"
    log.write_text(written.getvalue())
    child = Child("consumer-0", "consumer", [], {}, tmp_path, logs=[log])
    assert child.handler_failures("_Injected") == 2
    assert child.handler_failures("ValueError") == 1
