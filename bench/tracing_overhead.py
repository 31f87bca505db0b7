"""``python -m bench.tracing_overhead``: what tracing adds to the hot paths, per call.

Three modes, each timed in this process with :mod:`timeit` (best of 5 repeats):

- ``absent``: as without the ``otel`` extra (shared/tracing.py sees no opentelemetry);
- ``api-noop``: opentelemetry-api installed, no SDK provider set (the default of an
  application that installs the extra but does not configure tracing);
- ``sdk``: an SDK ``TracerProvider`` set (no exporter: the cost of the spans themselves).

Measured: ``Producer.build`` (the CPU part of ``enqueue``; in ``sdk`` mode inside a recording
span, so the context is injected), entering and leaving the relay's ``publish_span`` for a
batch of 100 rows (each with a traceparent), and the consumer's ``process_span`` (per handler
call). No database or Redis is involved: these are the added costs to compare with the
per-event costs in bench/PERFORMANCE.md.
"""

from __future__ import annotations

import argparse
import json
import timeit
from collections.abc import Callable
from typing import Any

from outbox_relay.producer import Producer
from outbox_relay.shared import tracing

PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
BATCH = 100


def _per_call_ns(func: Callable[[], object], number: int) -> float:
    best = min(timeit.repeat(func, number=number, repeat=5))
    return best / number * 1e9


def _measure(number: int) -> dict[str, float]:
    producer = Producer(partitions=4)
    headers = [json.dumps({"traceparent": PARENT})] * BATCH
    keys = ["outbox:orders:0"]

    def build() -> None:
        producer.build(postgres=False, type="order.created", stream="orders",
                       data={"n": 1}, aggregate_type="order", aggregate_id="o-1", revision=3)

    def publish() -> None:
        with tracing.publish_span(keys, (h for h in headers), BATCH):
            pass

    def process() -> None:
        with tracing.process_span(PARENT, None, keys[0], "o-1:order.created:3",
                                  "order.created", "billing"):
            pass

    return {
        "build_ns": _per_call_ns(build, number),
        "publish_span_per_batch_ns": _per_call_ns(publish, max(number // 10, 1)),
        "process_span_ns": _per_call_ns(process, number),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--number", type=int, default=20_000, help="calls per repeat")
    args = parser.parse_args(argv)
    results: dict[str, dict[str, float]] = {}

    available, propagator = tracing.AVAILABLE, tracing._propagator
    tracing.AVAILABLE, tracing._propagator = False, None
    try:
        results["absent"] = _measure(args.number)
    finally:
        tracing.AVAILABLE, tracing._propagator = available, propagator
    if not tracing.AVAILABLE:
        print("opentelemetry-api is not installed: only the 'absent' mode was measured")
    else:
        results["api-noop"] = _measure(args.number)
        try:
            from opentelemetry import trace
            from opentelemetry.sdk.trace import TracerProvider
        except ImportError:
            print("opentelemetry-sdk is not installed: the 'sdk' mode was not measured")
        else:
            provider = TracerProvider()
            trace.set_tracer_provider(provider)
            span: Any = provider.get_tracer("bench").start_span("request")
            with trace.use_span(span, end_on_exit=True):
                results["sdk"] = _measure(args.number)
    names = list(next(iter(results.values())))
    print(f"{'mode':<10}" + "".join(f"{n:>28}" for n in names))
    for mode, row in results.items():
        print(f"{mode:<10}" + "".join(f"{row[n]:>28.0f}" for n in names))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
