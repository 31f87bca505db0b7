"""Who holds each relay partition, as ``outbox status`` shows it.

A read of ``outbox_relay_leases`` with nothing taken or renewed (the leases themselves are
:mod:`relay.leases`). A lease is compared with the database's clock
(:func:`shared.db.db_now_ms`), the clock that wrote its ``expires_at_ms``, so the host that
runs ``outbox status`` shows the same owners and the same time left whatever its own clock
says.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine, select

from outbox_relay.shared.db import db_now_ms, is_postgres
from outbox_relay.shared.db_errors import translate_errors
from outbox_relay.shared.schema import relay_leases


def leases(engine: Engine) -> list[dict[str, Any]]:
    """Each relay partition's owner (``None`` when free or expired), fencing epoch, and how
    long its lease has left (``expires_in_ms``, ``None`` when free)."""
    r = relay_leases.c
    with translate_errors(), engine.connect() as conn:
        rows = conn.execute(select(r.partition, r.owner, r.epoch, r.expires_at_ms)
                            .order_by(r.partition)).all()
        now = int(conn.execute(select(db_now_ms(is_postgres(conn)))).scalar_one())
    return [
        {"partition": row.partition,
         "owner": row.owner if row.owner is not None and row.expires_at_ms > now else None,
         "epoch": row.epoch,
         "expires_in_ms": max(row.expires_at_ms - now, 0) if row.owner is not None else None}
        for row in rows
    ]
