"""One trace from ``enqueue`` to the handler (OpenTelemetry, the ``otel`` extra): the producer's
span context travels as the entry's ``traceparent``; the relay's ``outbox publish`` span links
to it; the handler runs in an ``outbox process`` span that is its child."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis
from sqlalchemy import Connection, Engine

pytest.importorskip(
    "opentelemetry.sdk.trace",
    reason="opentelemetry-sdk is not installed (it is in the dev extra: pip install -e '.[dev]')",
)

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
    InMemorySpanExporter,
)
from opentelemetry.trace import SpanKind, StatusCode
from opentelemetry.util._once import Once

from outbox_relay.consumer.daemon import Consumer
from outbox_relay.consumer.handlers import Handlers
from outbox_relay.producer import Producer
from outbox_relay.relay import append, store
from outbox_relay.relay.daemon import Relay
from outbox_relay.relay.leases import acquire_leases
from outbox_relay.shared import keys, tracing
from outbox_relay.shared.envelope import Event
from outbox_relay.shared.errors import LeaseLostError
from tests.helpers import (
    GROUP,
    PARTITIONS,
    STREAM,
    consumer_settings,
    enqueue_events,
    key_of,
    relay_settings,
    stream_entries,
    wait_until,
)

pytestmark = pytest.mark.integration

SECRET = "pa55word"


def _reset_global_provider() -> None:
    """The API lets a process set its tracer provider once; tests must leave none behind."""
    trace._TRACER_PROVIDER = None
    trace._TRACER_PROVIDER_SET_ONCE = Once()


@pytest.fixture(scope="module")
def provider() -> Iterator[TracerProvider]:
    _reset_global_provider()
    sdk = TracerProvider()
    trace.set_tracer_provider(sdk)
    yield sdk
    sdk.shutdown()
    _reset_global_provider()


@pytest.fixture
def exporter(provider: TracerProvider) -> Iterator[InMemorySpanExporter]:
    spans = InMemorySpanExporter()
    processor = SimpleSpanProcessor(spans)
    provider.add_span_processor(processor)
    yield spans
    processor.shutdown()  # a shut-down processor drops what later tests' spans send it


def spans_named(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.name == name]


def run_pipeline(
    engine: Engine, client: redis.Redis, prefix: str, handlers: Handlers, until: Any
) -> None:
    Relay(relay_settings(prefix), engine, client).run(until_idle=True)
    consumer = Consumer(consumer_settings(prefix), engine, client, handlers)
    wait_until(lambda: consumer.run_once() >= 0 and until(), what="the handler")


def test_one_trace_from_enqueue_to_handler(
    engine: Engine, redis_client: redis.Redis, key_prefix: str,
    exporter: InMemorySpanExporter, provider: TracerProvider,
) -> None:
    assert tracing.enabled()
    producer = Producer(source="tests", partitions=PARTITIONS, key_prefix=key_prefix)
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("checkout") as parent, engine.begin() as conn:
        traced = producer.enqueue(conn, type="thing.happened", stream=STREAM,
                                  aggregate_type="thing", aggregate_id="a1", revision=1)
    with engine.begin() as conn:  # no current span: the event carries no trace context
        untraced = producer.enqueue(conn, type="thing.happened", stream=STREAM,
                                    aggregate_type="thing", aggregate_id="a2", revision=1)
    origin = parent.get_span_context()

    seen: dict[str, trace.SpanContext] = {}
    handlers = Handlers()

    def handler(_conn: Connection, ev: Event) -> None:
        seen[ev.id] = trace.get_current_span().get_span_context()

    handlers.register("thing.happened", handler)
    run_pipeline(engine, redis_client, key_prefix, handlers, lambda: len(seen) == 2)

    # The wire: the CloudEvents tracing extension carries the producer's span context.
    fields = {f["id"]: f for _p, _id, f in stream_entries(redis_client, key_prefix)}
    assert fields[traced]["traceparent"] == (
        f"00-{origin.trace_id:032x}-{origin.span_id:016x}-{int(origin.trace_flags):02x}")
    assert "traceparent" not in fields[untraced]

    process = {s.attributes["messaging.message.id"]: s
               for s in spans_named(exporter, tracing.PROCESS_SPAN) if s.attributes}
    span = process[traced]
    assert span.kind == SpanKind.CONSUMER
    assert span.context.trace_id == origin.trace_id  # the same trace as the producer
    assert span.parent is not None and span.parent.span_id == origin.span_id
    assert span.parent.is_remote
    assert dict(span.attributes or {}) == {
        "messaging.system": "redis",
        "messaging.operation.type": "process",
        "messaging.operation.name": "process",
        "messaging.destination.name": key_of(key_prefix, "a1"),
        "messaging.message.id": traced,
        "messaging.consumer.group.name": GROUP,
        "cloudevents.event_id": traced,
        "cloudevents.event_type": "thing.happened",
    }
    assert seen[traced] == span.context  # current while the handler ran
    # An event without a trace context starts a trace of its own.
    assert process[untraced].parent is None
    assert process[untraced].context.trace_id != origin.trace_id

    publish = spans_named(exporter, tracing.PUBLISH_SPAN)
    assert publish and all(s.kind == SpanKind.PRODUCER for s in publish)
    linked = [s for s in publish
              if any(link.context.span_id == origin.span_id
                     and link.context.trace_id == origin.trace_id for link in s.links)]
    assert len(linked) == 1
    attributes = dict(linked[0].attributes or {})
    assert attributes["messaging.system"] == "redis"
    assert attributes["messaging.destination.name"] == key_of(key_prefix, "a1")
    assert attributes["messaging.batch.message_count"] >= 1


def test_the_trace_state_and_an_explicit_traceparent_travel_unchanged(
    engine: Engine, redis_client: redis.Redis, key_prefix: str,
    exporter: InMemorySpanExporter,
) -> None:
    producer = Producer(source="tests", partitions=PARTITIONS, key_prefix=key_prefix)
    remote = trace.SpanContext(
        trace_id=0x0AF7651916CD43DD8448EB211C80319C, span_id=0xB7AD6B7169203331,
        is_remote=True, trace_flags=trace.TraceFlags(1),
        trace_state=trace.TraceState([("vendor", "v1")]),
    )
    explicit = "00-11111111111111111111111111111111-2222222222222222-01"
    with trace.use_span(trace.NonRecordingSpan(remote)), engine.begin() as conn:
        stated = producer.enqueue(conn, type="thing.happened", stream=STREAM,
                                  aggregate_type="thing", aggregate_id="s1", revision=1)
        given = producer.enqueue(conn, type="thing.happened", stream=STREAM,
                                 aggregate_type="thing", aggregate_id="s2", revision=1,
                                 traceparent=explicit)
    handled: list[str] = []
    handlers = Handlers()
    handlers.register("thing.happened", lambda _c, ev: handled.append(ev.id))
    run_pipeline(engine, redis_client, key_prefix, handlers, lambda: len(handled) == 2)

    fields = {f["id"]: f for _p, _id, f in stream_entries(redis_client, key_prefix)}
    assert fields[stated]["tracestate"] == "vendor=v1"
    assert fields[given]["traceparent"] == explicit  # the caller's, not the current span's
    assert "tracestate" not in fields[given]
    process = {s.attributes["messaging.message.id"]: s
               for s in spans_named(exporter, tracing.PROCESS_SPAN) if s.attributes}
    parent = process[stated].parent
    assert parent is not None and parent.span_id == remote.span_id
    assert parent.trace_state.get("vendor") == "v1"
    assert process[given].context.trace_id == 0x11111111111111111111111111111111


def test_a_failing_handler_span_records_the_error_redacted(
    engine: Engine, redis_client: redis.Redis, key_prefix: str,
    exporter: InMemorySpanExporter, provider: TracerProvider,
) -> None:
    producer = Producer(source="tests", partitions=PARTITIONS, key_prefix=key_prefix)
    with provider.get_tracer("test").start_as_current_span("checkout"), \
            engine.begin() as conn:
        bad = producer.enqueue(conn, type="thing.happened", stream=STREAM,
                               aggregate_type="thing", aggregate_id="f1", revision=1)
    calls: list[str] = []
    handlers = Handlers()

    def handler(_conn: Connection, ev: Event) -> None:
        calls.append(ev.id)
        raise RuntimeError(f"cannot reach postgresql://app:{SECRET}@db/x")

    handlers.register("thing.happened", handler)
    run_pipeline(engine, redis_client, key_prefix, handlers, lambda: calls)
    (span, *_) = [s for s in spans_named(exporter, tracing.PROCESS_SPAN)
                  if s.attributes and s.attributes["messaging.message.id"] == bad]
    assert span.status.status_code == StatusCode.ERROR
    (exc,) = [e for e in span.events if e.name == "exception"]
    attributes = dict(exc.attributes or {})
    assert attributes["exception.type"] == "RuntimeError"
    assert "app:***@db" in str(attributes["exception.message"])
    assert SECRET not in str(attributes["exception.stacktrace"])
    assert "Traceback" in str(attributes["exception.stacktrace"])


def test_a_rounds_publish_spans_are_siblings_and_only_the_failed_batch_is_an_error(
    engine: Engine, redis_client: redis.Redis, key_prefix: str,
    exporter: InMemorySpanExporter,
) -> None:
    """A round appends two partitions' batches with one Redis round trip
    (``append.append_many``): each batch has its own ``outbox publish`` span, both children
    of the span current at the round (not one nested in the other), and a batch refused by
    its stream's fence (another relay's epoch there) is the only span with status ERROR."""
    enqueue_events(engine, 24, aggregates=8)
    held = acquire_leases(engine, "a", PARTITIONS, 10_000)
    batches = [(store.take_batch(engine, p, "a", held[p], 100, 10_000), held[p]) for p in (0, 1)]
    assert all(rows for rows, _epoch in batches)
    redis_client.set(keys.fence_key(key_prefix, STREAM, 1), held[1] + 1)  # taken over

    with trace.get_tracer("test").start_as_current_span("round") as round_span:
        outcomes = append.append_many(redis_client, key_prefix, batches)

    assert isinstance(outcomes[0], append.Verdicts) and outcomes[0].delivered
    assert isinstance(outcomes[1], LeaseLostError)
    published = spans_named(exporter, tracing.PUBLISH_SPAN)
    assert len(published) == 2
    parent = round_span.get_span_context().span_id
    assert all(s.parent is not None and s.parent.span_id == parent for s in published)
    status = {s.attributes["messaging.destination.name"]: s.status.status_code
              for s in published if s.attributes}
    assert status == {keys.stream_key(key_prefix, STREAM, 0): StatusCode.UNSET,
                      keys.stream_key(key_prefix, STREAM, 1): StatusCode.ERROR}
