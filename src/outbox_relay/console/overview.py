"""What the console shows besides dead letters: backlog, partition owners, groups and lag.

Nothing here queries anything itself. The backlog per partition is :func:`relay.backlog.backlog`
(the relay's gauges read it); owners, groups and lag come from the ``outbox status`` report,
which ``outbox serve`` passes in (the CLI owns that report; the console only reshapes it), so
the console and ``outbox status`` can never disagree.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sqlalchemy import Engine

from outbox_relay.relay import backlog as relay_backlog

StatusReport = Callable[[], dict[str, Any]]
"""``outbox status --json``'s report, taken when called."""


def backlog(engine: Engine) -> dict[str, Any]:
    """Undelivered rows per stream partition and how long the oldest deliverable one has
    waited (from its ``available_at_ms``: a delayed event is not late before it is due), by
    the database's clock."""
    parts = sorted(relay_backlog.backlog(engine), key=lambda p: (p.stream, p.partition))
    rows: list[dict[str, Any]] = [
        {"stream": p.stream, "partition": p.partition, "undelivered": p.rows,
         "oldest_age_s": round(p.waited_ms / 1000, 3)}
        for p in parts]
    return {"undelivered": sum(p.rows for p in parts),
            "oldest_undelivered_age_s": max(
                (float(r["oldest_age_s"]) for r in rows), default=None),
            "partitions": rows}


def partitions(report: dict[str, Any]) -> dict[str, Any]:
    """Who holds each relay partition, and each group's partition streams (owner ``None``:
    free or expired)."""
    return {"relay": report.get("relay_leases", []),
            "consumers": report.get("consumer_leases", [])}


def groups(report: dict[str, Any]) -> dict[str, Any]:
    """Each group on each partition stream (pending, lag, consumers, owner), each group's
    totals, and the dead letters of each partition stream."""
    rows: list[dict[str, Any]] = []
    streams = []
    for s in report.get("streams", []):
        streams.append({"key": s["key"], "stream": s["stream"], "partition": s["partition"],
                        "length": s["length"], "dead_letters": s["dead_letters"]})
        rows += [{"group": g["name"], "stream": s["stream"], "partition": s["partition"],
                  "pending": g["pending"], "lag": g["lag"], "consumers": g["consumers"],
                  "owner": g.get("owner"), "last_delivered_id": g["last_delivered_id"]}
                 for g in s["groups"]]
    totals: dict[str, dict[str, Any]] = {}
    for r in rows:
        t = totals.setdefault(r["group"], {"group": r["group"], "pending": 0, "lag": 0,
                                           "unknown_lag": False})
        t["pending"] += r["pending"]
        if r["lag"] is None:  # Redis could not tell (group_status.unread): say so, do not guess 0
            t["unknown_lag"] = True
        else:
            t["lag"] += r["lag"]
    return {"groups": sorted(totals.values(), key=lambda t: t["group"]),
            "partition_streams": rows, "streams": streams}
