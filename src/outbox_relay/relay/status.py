"""Who holds each relay partition, as ``outbox status`` shows it.

A read of ``outbox_relay_leases`` with nothing taken or renewed (the leases themselves are
:mod:`relay.leases`), through the listing every lease kind shares
(:func:`shared.leases.holders`): compared with the database's clock, the clock that wrote
``expires_at_ms``, so the host that runs ``outbox status`` shows the same owners and the same
time left whatever its own clock says.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine

from outbox_relay.relay.leases import RELAY_LEASES
from outbox_relay.shared.leases import holders


def leases(engine: Engine) -> list[dict[str, Any]]:
    """Each relay partition's owner (``None`` when free or expired), fencing epoch, and how
    long its lease has left (``expires_in_ms``, ``None`` when free)."""
    return holders(engine, RELAY_LEASES)
