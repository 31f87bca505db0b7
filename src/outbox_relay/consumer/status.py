"""What ``outbox status`` shows of the consumers: their streams and groups, and their retries.

Nothing here sends a command or a statement itself: the streams are read by
:func:`consumer.group_status.stream_report` (Redis), who owns each partition stream by
:func:`consumer.ownership.owners` (database, compared with the database's clock), the retry
rows by :func:`consumer.inbox.retrying` (database). Retry times were written with the
consumer host's clock (consumer/retry.py), so their ages are read with this host's.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import redis
from sqlalchemy import Engine

from outbox_relay.consumer import group_status, inbox
from outbox_relay.shared.db import now_ms


def streams(
    client: redis.Redis, prefix: str, known: set[tuple[str, int]],
    owners: list[dict[str, Any]],
) -> list[dict[str, Any]]:
    """:func:`consumer.group_status.stream_report`, with each group's ``owner`` and ``epoch``
    on each partition stream filled in from ``owners`` (:func:`consumer.ownership.owners`;
    ``None`` when free, expired or never taken)."""
    report = group_status.stream_report(client, prefix, known)
    owner_of = {(o["group"], o["stream"], o["partition"]): o for o in owners}
    for st in report:
        for g in st["groups"]:
            lease = owner_of.get((g["name"], st["stream"], st["partition"]))
            g["owner"] = lease["owner"] if lease else None
            g["epoch"] = lease["epoch"] if lease else None
    return report


def retries(engine: Engine) -> list[dict[str, Any]]:
    """Per consumer group, its entries waiting for a retry (a failing handler's, with a
    durable next attempt: consumer/retry.py): how many, how long ago the oldest first failed,
    how soon the next attempt is due (negative: overdue, e.g. no consumer of the group is
    running), the most attempts any has had, and how many by last error and by stream key."""
    now = now_ms()
    groups: dict[str, dict[str, Any]] = {}
    for row in inbox.retrying(engine):
        g = groups.setdefault(row["group"], {
            "group": row["group"], "entries": 0, "oldest_first_failed_ms": row[
                "oldest_first_failed_ms"], "next_attempt_ms": row["next_attempt_ms"],
            "max_attempts": 0, "errors": Counter(), "streams": Counter()})
        g["entries"] += row["count"]
        g["oldest_first_failed_ms"] = min(g["oldest_first_failed_ms"],
                                          row["oldest_first_failed_ms"])
        g["next_attempt_ms"] = min(g["next_attempt_ms"], row["next_attempt_ms"])
        g["max_attempts"] = max(g["max_attempts"], row["max_attempts"])
        g["errors"][row["last_error"] or "?"] += row["count"]
        g["streams"][row["stream_key"]] += row["count"]
    return [{"group": g["group"], "entries": g["entries"],
             "oldest_first_failure_age_s": round((now - g["oldest_first_failed_ms"]) / 1000, 3),
             "next_attempt_in_s": round((g["next_attempt_ms"] - now) / 1000, 3),
             "max_attempts": g["max_attempts"], "errors": dict(g["errors"]),
             "streams": dict(sorted(g["streams"].items()))}
            for g in groups.values()]
