"""``python -m bench.compare A.json B.json [...]``: the spread of every figure between runs.

For two (or more) ``results.json`` files of separate ``python -m bench`` runs with the same
options, prints each figure (every median, the relay ratios to the strong baseline, the
cluster's 3-masters/1-master ratios) with its value in each file and the spread
``(max - min) / min``, and flags a spread above 15 %: a figure a rerun does not reproduce
within 15 % is not to be published. Exit status 1 when any figure is over. ``make bench``
does the same within one invocation (``--passes 2``); this is for runs made apart.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.report import SPREAD_LIMIT_PCT, spread_rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.compare", description=__doc__)
    p.add_argument("results", nargs="+", type=Path, help="results.json files (two or more)")
    p.add_argument("--all", action="store_true", help="print every figure, not only the over")
    args = p.parse_args(argv)
    if len(args.results) < 2:
        p.error("give two or more results.json files")
    runs = [json.loads(path.read_text())["databases"] for path in args.results]
    rows = spread_rows(runs)
    over = [r for r in rows if r["over"]]
    width = max((len(r["figure"]) for r in rows), default=10)
    for r in rows if args.all else over:
        values = " / ".join(f"{v:>12,.2f}" for v in r["passes"])
        flag = f"  OVER {SPREAD_LIMIT_PCT:.0f}%" if r["over"] else ""
        print(f"{r['figure']:<{width}}  {values}  {r['spread_pct']:6.1f}%{flag}")
    print(f"{len(rows) - len(over)} of {len(rows)} figures within {SPREAD_LIMIT_PCT:.0f}% "
          f"across {len(runs)} runs")
    return 1 if over else 0


if __name__ == "__main__":
    raise SystemExit(main())
