"""``outbox status``: what is waiting in the outbox and in each stream, for people and scripts.

This module only wires and renders: every read is a component's. The relay's side is
:func:`relay.backlog.summary` and :func:`relay.backlog.refused` (the outbox),
:func:`relay.stream_book.trim_report` (trims) and :func:`relay.leases.holders` (partition
owners); the consumers' is :func:`consumer.status.streams` (streams and groups, in Redis),
:func:`consumer.ownership.owners` (partition stream owners) and :func:`consumer.status.retries`.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import redis
from sqlalchemy import Engine

from outbox_relay.consumer import ownership
from outbox_relay.consumer import status as consumer_status
from outbox_relay.relay import backlog as relay_backlog
from outbox_relay.relay import leases as relay_leases
from outbox_relay.relay import stream_book
from outbox_relay.shared import partition_counts


def collect(engine: Engine, client: redis.Redis, prefix: str) -> dict[str, Any]:
    """Outbox backlog, oldest undelivered age, per stream: length, groups (pending, lag, the
    consumer owning the partition stream and its epoch), dead letters; and every relay
    partition lease and consumer lease (owner ``None`` when free or expired); per consumer
    group, the entries waiting for a retry (:func:`consumer.status.retries`)."""
    outbox = relay_backlog.summary(engine)
    trims = stream_book.trim_report(engine)
    consumer_leases = ownership.owners(engine)
    streams = consumer_status.streams(client, prefix, partition_counts.known_partitions(engine),
                                      consumer_leases)
    for st in streams:  # relay/trim.py: everything below the floor was acknowledged and trimmed
        trim = trims.get((st["stream"], st["partition"]), {})
        st["trim_floor"] = trim.get("trim_floor")
        st["trimmed"] = trim.get("trimmed", 0)
        # Known groups the last trim found gone: the stream is not trimmed until they are back.
        st["missing_groups"] = trim.get("missing_groups", [])
    return {
        "outbox": outbox,
        "streams": streams,
        "relay_leases": relay_leases.holders(engine),
        "relay_refused": relay_backlog.refused(engine),  # streams backing off (relay/refusals.py)
        "consumer_leases": consumer_leases,
        "retries": consumer_status.retries(engine),
    }


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
