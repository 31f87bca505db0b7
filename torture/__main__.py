"""``python -m torture [--database sqlite|postgresql|both] [--duration S] [--kills N]
[--quick] [--run-worker] [--no-retention] [--redis single|cluster|sentinel]
[--wait-replicas N] [--outage-s S]``: run the harness, print the table, write the JSON
report. ``python -m torture --soak [--quick] [--duration S] [--rate N]``: the soak instead
(:mod:`torture.soak`)."""

from __future__ import annotations

import json
import logging
import random
import sys
from typing import Any

from torture import soak
from torture.harness import parse_args, run_one

COLUMNS = (
    ("database", "database"), ("redis", "redis"), ("wait_replicas", "wait"),
    ("fault_seconds", "fault s"), ("settle_seconds", "settle s"),
    ("total_kills", "kills"), ("failovers", "failovers"),
    ("lacked_after_failover", "lacked at failover"), ("events", "events"),
    ("strict_events", "strict"),
    ("handler_failures", "handler fails"), ("pauses_past_lease", "long pauses"),
    ("outage_failures", "outage fails"), ("chained_events", "chained"), ("runs", "runs"),
    ("runs_not_terminal", "open runs"), ("lost", "lost"),
    ("duplicate_entries", "dup entries"), ("duplicate_effects", "dup effects"),
    ("order_violations", "order viol"), ("stream_order_violations", "stream order"),
    ("out_of_order", "out of order"), ("skipped", "skipped"),
    ("superseded_latest", "superseded"),
    ("repaired_entries", "repaired"), ("undelivered", "undelivered"), ("pending", "pending"),
    ("rows_pruned", "rows pruned"), ("receipts_pruned", "receipts pruned"),
    ("entries_trimmed", "trimmed"),
)


def render(reports: list[dict[str, Any]]) -> str:
    """The report as a plain-text table, then kills per fault point and infra faults."""
    widths = [max(len(h), *(len(str(r.get(k))) for r in reports)) for k, h in COLUMNS]
    lines = ["  ".join(h.rjust(w) for (_, h), w in zip(COLUMNS, widths, strict=True))]
    for r in reports:
        lines.append("  ".join(str(r.get(k)).rjust(w)
                               for (k, _), w in zip(COLUMNS, widths, strict=True)))
    for r in reports:
        lines.append(f"\n{r['database']}: kills per fault point")
        lines += [f"  {name:<28} {n:>6}" for name, n in r["kills"].items()]
        lines += [f"  {name:<28} {n:>6}" for name, n in r["infra_faults"].items()]
        lines.append(f"  pauses {r['pauses']} ({r['pauses_past_lease']} past the lease, "
                     f"{r['pauses_short']} shorter, {r['pauses_killed']} killed while stopped;"
                     f" {r['paused_by_kind']}); downstream down {r['outage_seconds']} s, "
                     f"{r['outage_failures']} calls failed; chain: {r['chain_sources']} sources"
                     f" applied, {r['chained_events']} chained events, {r['chained_applied']} "
                     "applied by the second group")
        if r.get("refused_per_fault"):
            lines.append("  writes refused (OOM) per refuse_appends fault: "
                         + ", ".join(map(str, r["refused_per_fault"]))
                         + f"; relay refusal lines (backoff started): {r['append_refusals']}")
        if r.get("destroyed_per_empty_restart"):
            lines.append("  marked entries destroyed per empty restart: "
                         + ", ".join(map(str, r["destroyed_per_empty_restart"])))
        lines += [f"  exit.unavailable.{kind:<11} {n:>6}"
                  for kind, n in r.get("unavailable_exits", {}).items()]
        lines.append(retention_line(r))
        verdict = "OK" if not r["violations"] else "VIOLATIONS: " + ", ".join(r["violations"])
        lines.append(f"  verdict: {verdict}")
    return "\n".join(lines)


def retention_line(r: dict[str, Any]) -> str:
    """What retention removed during one run, from the ledger next to the tables."""
    x = r["retention"]
    on = x["settings"].get("OUTBOX_STREAM_TRIM") == "true"
    return (
        f"  retention {'on' if on else 'off'}: outbox rows {x['outbox_rows_pruned']} of "
        f"{x['ledger_events']} pruned ({x['outbox_rows']} left); receipts "
        f"{x['receipts_pruned']} of {x['ledger_receipts']} pruned ({x['inbox_receipts']} left);"
        f" heads {x['heads_pruned']} pruned ({x['inbox_heads']} left); stream entries "
        f"{x['trimmed_recorded']} trimmed by the relay's count, {r['entries_trimmed']} events "
        f"below the floors ({x['trim_floors']} floors), {x['stream_entries']} entries left; "
        f"consumers {x['consumers']}; redeliveries {r['redeliveries']}"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s",
                        stream=sys.stderr)
    if args.soak:
        return soak.main(args)
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    kinds = ["sqlite", "postgresql"] if args.database == "both" else [args.database]
    reports = [run_one(kind, args, seed) for kind in kinds]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"seed": seed, "quick": args.quick, "runs": reports},
                                   indent=2) + "\n")
    print(render(reports))
    print(f"\nreport written to {args.out}")
    return 1 if any(r["violations"] for r in reports) else 0


if __name__ == "__main__":
    sys.exit(main())
