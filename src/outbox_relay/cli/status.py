"""``outbox status``: what is waiting in the outbox and in each stream, for people and scripts."""

from __future__ import annotations

from collections import Counter
from typing import Any

import redis
from sqlalchemy import Engine, func, select

from outbox_relay.consumer import group_status, inbox, ownership
from outbox_relay.relay import backlog as relay_backlog
from outbox_relay.shared import keys, partition_counts
from outbox_relay.shared.db import now_ms
from outbox_relay.shared.db_errors import translate_errors
from outbox_relay.shared.redis_conn import node_of, translate_redis_errors
from outbox_relay.shared.schema import outbox, relay_leases, stream_groups, stream_trims


def collect(engine: Engine, client: redis.Redis, prefix: str) -> dict[str, Any]:
    """Outbox backlog, oldest undelivered age, per stream: length, groups (pending, lag, the
    consumer owning the partition stream and its epoch), dead letters; and every relay
    partition lease and consumer lease (owner ``None`` when free or expired); per consumer
    group, the entries waiting for a retry (:func:`retries`)."""
    with translate_errors(), engine.connect() as conn:
        backlog, oldest = conn.execute(
            select(func.count(), func.min(outbox.c.created_at_ms)).where(
                outbox.c.delivered_at_ms.is_(None)
            )
        ).one()
        delivered = conn.execute(
            select(func.count()).where(outbox.c.delivered_at_ms.is_not(None))
        ).scalar_one()
        errors: dict[str, int] = {
            code: count
            for code, count in conn.execute(
                select(outbox.c.last_error, func.count())
                .where(outbox.c.delivered_at_ms.is_(None), outbox.c.last_error.is_not(None))
                .group_by(outbox.c.last_error)
            ).all()
        }
        trims = {(r.stream, r.partition): r for r in conn.execute(select(stream_trims)).all()}
        missing: dict[tuple[str, int], list[str]] = {}
        for r in conn.execute(select(stream_groups).where(
                stream_groups.c.missing_since_ms.is_not(None))
                .order_by(stream_groups.c.group_name)).all():
            missing.setdefault((r.stream, r.partition), []).append(r.group_name)
    consumer_leases = ownership.owners(engine)
    streams = _streams(client, prefix, partition_counts.known_partitions(engine))
    for st in streams:  # relay/trim.py: everything below the floor was acknowledged and trimmed
        trim = trims.get((st["stream"], st["partition"]))
        st["trim_floor"] = trim.floor_entry_id if trim and trim.trimmed else None
        st["trimmed"] = trim.trimmed if trim else 0
        # Known groups the last trim found gone: the stream is not trimmed until they are back.
        st["missing_groups"] = missing.get((st["stream"], st["partition"]), [])
    owner_of = {(o["group"], o["stream"], o["partition"]): o for o in consumer_leases}
    for st in streams:
        for g in st["groups"]:
            lease = owner_of.get((g["name"], st["stream"], st["partition"]))
            g["owner"] = lease["owner"] if lease else None
            g["epoch"] = lease["epoch"] if lease else None
    return {
        "outbox": {
            "undelivered": backlog,
            "delivered": delivered,
            "oldest_undelivered_age_s": round((now_ms() - oldest) / 1000, 3) if oldest else None,
            "errors": errors,
        },
        "streams": streams,
        "relay_leases": _relay_leases(engine),
        "relay_refused": relay_backlog.refused(engine),  # streams backing off (relay/refusals.py)
        "consumer_leases": consumer_leases,
        "retries": retries(engine),
    }


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


def _relay_leases(engine: Engine) -> list[dict[str, Any]]:
    """Each relay partition's owner (``None`` when free or expired) and fencing epoch."""
    with translate_errors(), engine.connect() as conn:
        rows = conn.execute(select(relay_leases.c.partition, relay_leases.c.owner,
                                   relay_leases.c.epoch, relay_leases.c.expires_at_ms)
                            .order_by(relay_leases.c.partition)).all()
    now = now_ms()
    return [
        {"partition": r.partition,
         "owner": r.owner if r.owner is not None and r.expires_at_ms > now else None,
         "epoch": r.epoch,
         "expires_in_ms": max(r.expires_at_ms - now, 0) if r.owner is not None else None}
        for r in rows
    ]


def _streams(
    client: redis.Redis, prefix: str, known: set[tuple[str, int]]
) -> list[dict[str, Any]]:
    """Each partition stream the database knows (:func:`partition_counts.known_partitions`),
    wherever it lives (on Redis Cluster, on its slot's master), and any other stream under
    ``prefix`` that a ``SCAN`` of the Redis we are connected to finds (written by hand)."""
    out = []
    with translate_redis_errors():
        found = sorted({keys.stream_key(prefix, s, p) for s, p in known} | {
            k.decode() for k in client.scan_iter(match=keys.stream_key_pattern(prefix), count=1000)
        })
        for key in found:
            parsed = keys.parse_stream_key(prefix, key)
            if parsed is None or client.type(key) != b"stream":
                continue
            try:  # the newest entry: a group that read it has no lag (group_status.unread)
                newest: Any = client.xrevrange(key, count=1)
            except redis.exceptions.NoPermissionError:  # an older ACL (docs/security.md) lacks it
                newest = None
            groups = [
                {
                    "name": g["name"].decode(),
                    "consumers": g["consumers"],
                    "pending": g["pending"],
                    "lag": group_status.unread(g, newest),
                    "last_delivered_id": g["last-delivered-id"].decode(),
                }
                for g in client.xinfo_groups(key)
            ]
            out.append(
                {
                    "key": key,
                    "stream": parsed[0],
                    "partition": parsed[1],
                    "length": client.xlen(key),
                    "groups": groups,
                    "dead_letters": client.xlen(keys.dead_letter_key(prefix, *parsed)),
                    # On Redis Cluster, the master holding the stream's slot (None elsewhere).
                    "node": getattr(node_of(client, key), "name", None),
                }
            )
    return out


def render(report: dict[str, Any]) -> str:
    """A plain-text table of :func:`collect`'s report."""
    o = report["outbox"]
    age = "-" if o["oldest_undelivered_age_s"] is None else f"{o['oldest_undelivered_age_s']}s"
    lines = [
        f"outbox: {o['undelivered']} undelivered (oldest {age}), {o['delivered']} delivered",
    ]
    for code, count in sorted(o["errors"].items()):
        lines.append(f"  last error {code}: {count} rows")
    width = max([len("stream key"), *(len(s["key"]) for s in report["streams"])])
    lines.append(f"{'stream key':<{width}} {'length':>8} {'trimmed':>8} {'dead':>6}  "
                 "groups (pending/lag)")
    for s in report["streams"]:
        groups = ", ".join(f"{g['name']} ({g['pending']}/{g['lag']})" for g in s["groups"]) or "-"
        lines.append(f"{s['key']:<{width}} {s['length']:>8} {s.get('trimmed', 0):>8} "
                     f"{s['dead_letters']:>6}  {groups}")
        if s.get("missing_groups"):
            gone = ", ".join(s["missing_groups"])
            lines.append(f"  trimming held: known group(s) missing: {gone} "
                         "(`outbox groups forget GROUP` if deleted on purpose)")
    if not report["streams"]:
        lines.append("(no streams yet)")
    by_node = Counter(s["node"] for s in report["streams"] if s.get("node"))
    if by_node:  # Redis Cluster: how the partition streams spread over the masters
        lines.append("streams per cluster master: " + ", ".join(
            f"{node} {n}" for node, n in sorted(by_node.items())))
    lines += _render_retries(report.get("retries"))
    lines += relay_backlog.refused_lines(report.get("relay_refused"))
    relays = report.get("relay_leases") or []
    if relays:
        lines.append("relay partitions: " + ", ".join(
            f"{r['partition']} {r['owner'] or '(free)'} (epoch {r['epoch']})" for r in relays))
    leases = report.get("consumer_leases") or []
    if leases:
        lines.append("consumer partition streams (group stream:partition owner):")
        lines += [f"  {o['group']} {o['stream']}:{o['partition']} {o['owner'] or '(free)'} "
                  f"(epoch {o['epoch']})" for o in leases]
    return "\n".join(lines)


def _render_retries(groups: list[dict[str, Any]] | None) -> list[str]:
    """One line per group with entries waiting for a retry (None: an older report)."""
    if groups is None:
        return []
    if not groups:
        return ["retrying: none (no handler failure waiting for its next attempt)"]
    lines = ["retrying (entries of a failing handler waiting for their next attempt):"]
    for g in groups:
        due = g["next_attempt_in_s"]
        when = f"next attempt in {due}s" if due >= 0 else f"next attempt overdue by {-due}s"
        errors = ", ".join(f"{e} {n}" for e, n in sorted(g["errors"].items()))
        lines.append(f"  {g['group']}: {g['entries']} entries, oldest first failure "
                     f"{g['oldest_first_failure_age_s']}s ago, {when}, up to "
                     f"{g['max_attempts']} attempts ({errors})")
    return lines
