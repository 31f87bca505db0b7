"""Whether the PostgreSQL server's lock table holds what this group's claims may take at once.

Why: a claim holds one transaction-scoped advisory lock per distinct aggregate of its batch
until it commits (consumer/inbox.py), and PostgreSQL keeps every lock of every transaction in
one shared table of about ``max_locks_per_transaction * (max_connections +
max_prepared_transactions)`` entries. While it is full, *every* transaction on that server
that needs a lock fails with ``out of shared memory`` — the applications' too (measured on
PostgreSQL 15 with its defaults: 25 concurrent transactions of 500 advisory locks fit, the
26th failed; docs/operations.md). A consumer cannot know how many others claim at once, so it
says, once at start, when only a few claims of its batch size would fill the table.
"""

from __future__ import annotations

import logging

from sqlalchemy import Cast, Engine, Integer, cast, func, select
from sqlalchemy.exc import SQLAlchemyError

from outbox_relay.shared.db import is_postgres
from outbox_relay.shared.errors import OutboxError

log = logging.getLogger(__name__)

FEW_CLAIMS = 8
"""Below this many claims of ``batch_size`` locks fitting in the table, the start warns."""


def size(engine: Engine) -> int | None:
    """The server's lock table in entries (None: not PostgreSQL, or it could not be read)."""
    if not is_postgres(engine):
        return None

    def setting(name: str) -> Cast[int]:
        return cast(func.current_setting(name), Integer)

    query = select(setting("max_locks_per_transaction") * (
        setting("max_connections") + setting("max_prepared_transactions")))
    try:
        with engine.connect() as conn:
            return int(conn.execute(query).scalar_one())
    except (SQLAlchemyError, OutboxError):
        # Down or unreachable at start (the connect's errors are ours: UnavailableError,
        # CannotConnectError): the daemon's own loop waits for it and says so; this check
        # is advice and never stops a start.
        log.debug("could not read the lock table's size", exc_info=True)
        return None


def warn_if_few_claims_fit(engine: Engine, batch_size: int, group: str) -> int | None:
    """Log a WARNING when fewer than :data:`FEW_CLAIMS` claims of ``batch_size`` aggregates
    fit in the server's lock table; return how many fit (None: not known)."""
    table = size(engine)
    if table is None:
        return None
    fits = table // batch_size
    if fits < FEW_CLAIMS:
        log.warning(
            "group %s: a claim holds up to %d advisory locks (one per aggregate of a batch of "
            "OUTBOX_BATCH_SIZE=%d) and this PostgreSQL server's lock table holds about %d: %d "
            "claims at once fill it, and then every transaction on the server that needs a "
            "lock fails with 'out of shared memory'; raise max_locks_per_transaction or lower "
            "OUTBOX_BATCH_SIZE (docs/operations.md)", group, batch_size, batch_size, table,
            fits, extra={"group": group, "lock_table": table, "claims_that_fit": fits})
    return fits
