"""OpenTelemetry tracing, optional: ``pip install 'outbox-relay[otel]'`` (``opentelemetry-api``).

One trace from ``enqueue`` to the handler, per the OpenTelemetry messaging semantic conventions:

- the producer (:func:`carrier`): ``enqueue`` called with no ``traceparent`` stores the current
  span context (W3C ``traceparent`` and ``tracestate``) with the outbox row; it travels as the
  CloudEvents distributed tracing extension fields of the stream entry (shared/envelope.py);
- the relay (:func:`publish_span`, :func:`publish_spans` for a round's batches appended
  together): each append of a batch runs in a span ``outbox publish``
  (kind PRODUCER) *linked* to the context of each row (a batch has many parents; at most
  :data:`MAX_LINKS` links);
- the consumer (:func:`process_span`): each handler call runs in a span ``outbox process``
  (kind CONSUMER) whose *parent* is the producer context carried by the event, current while
  the handler runs (so the handler's own spans, and the events it enqueues, nest under it).

Guarantees: this module imports and every function works without ``opentelemetry`` installed;
until the application installs an SDK tracer provider (``trace.set_tracer_provider``), the
API's no-op provider is detected once per call and nothing else is done (no parsing, no span
objects): the hot paths stay as cheap as without tracing (bench/tracing_overhead.py). The
exception recorded on a failed span is redacted like the logs (shared/redaction.py).
"""

from __future__ import annotations

import contextlib
import json
import re
import traceback
from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any

from outbox_relay.shared.redaction import redact_url

try:
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError:  # pragma: no cover - exercised by the test that hides opentelemetry
    AVAILABLE = False
else:
    AVAILABLE = True

TRACER_NAME = "outbox-relay"
MAX_LINKS = 32  # links of one relay span (a batch of 500 rows would be 500 links)
PUBLISH_SPAN = "outbox publish"
PROCESS_SPAN = "outbox process"
MESSAGING_SYSTEM = "redis"

_TRACEPARENT = re.compile(
    r"^(?P<version>[0-9a-f]{2})-(?P<trace>[0-9a-f]{32})-(?P<span>[0-9a-f]{16})-"
    r"(?P<flags>[0-9a-f]{2})(?:-.*)?$"
)
_NULL: AbstractContextManager[None] = contextlib.nullcontext()
_propagator = TraceContextTextMapPropagator() if AVAILABLE else None
_cached: tuple[Any, Any] | None = None  # (tracer provider, our tracer from it)


def enabled() -> bool:
    """Whether spans are recorded: opentelemetry is installed and an SDK provider is set."""
    return _tracer() is not None


def _tracer() -> Any:
    """Our tracer, or None while opentelemetry is absent or its provider is the no-op one."""
    global _cached
    if not AVAILABLE:
        return None
    provider = trace.get_tracer_provider()
    if isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider):
        return None
    cached = _cached
    if cached is None or cached[0] is not provider:
        cached = _cached = (provider, provider.get_tracer(TRACER_NAME))
    return cached[1]


def carrier() -> dict[str, str]:
    """The current span context as W3C headers: ``{"traceparent": …}`` plus ``tracestate``
    when it has one; empty when there is no valid current span (or no opentelemetry)."""
    if _propagator is None:
        return {}
    if not trace.get_current_span().get_span_context().is_valid:
        return {}
    headers: dict[str, str] = {}
    _propagator.inject(headers)
    return {k: v for k, v in headers.items() if k in ("traceparent", "tracestate") and v}


def publish_span(
    destinations: Sequence[str], headers: Iterable[str | None], count: int
) -> AbstractContextManager[Any]:
    """The relay's span around the append of one batch of ``count`` rows to ``destinations``
    (stream keys); ``headers``: the rows' outbox ``headers`` JSON, read only when tracing is
    on (each row's ``traceparent`` becomes a link, at most :data:`MAX_LINKS`)."""
    tracer = _tracer()
    if tracer is None:
        return _NULL
    attributes, links = _publish(destinations, headers, count)
    return _span(tracer, PUBLISH_SPAN, trace.SpanKind.PRODUCER, None, attributes, links)


Batch = tuple[Sequence[str], Iterable[str | None], int]
"""One batch of :func:`publish_spans`: what :func:`publish_span` is given."""


@contextlib.contextmanager
def publish_spans(batches: Sequence[Batch]) -> Iterator[list[Any]]:
    """:func:`publish_span` of several batches appended together (a relay round's, one Redis
    round trip): one ``outbox publish`` span each, siblings (children of the current
    context, none of them current), all around the block. Yields one handle per batch (None
    while tracing is off) for :func:`failed`; an exception leaving the block is recorded on
    every span."""
    tracer = _tracer()
    if tracer is None:
        yield [None] * len(batches)
        return
    spans = []
    for destinations, headers, count in batches:
        attributes, links = _publish(destinations, headers, count)
        spans.append(tracer.start_span(PUBLISH_SPAN, kind=trace.SpanKind.PRODUCER,
                                       attributes=attributes, links=links,
                                       record_exception=False,
                                       set_status_on_exception=False))
    try:
        yield spans
    except BaseException as exc:
        for span in spans:
            _record(span, exc)
        raise
    finally:
        for span in spans:
            span.end()


def failed(span: Any, exc: BaseException) -> None:
    """Record a batch's failure on its :func:`publish_spans` handle (None: tracing is off)."""
    if span is not None:
        _record(span, exc)


def _publish(destinations: Sequence[str], headers: Iterable[str | None],
             count: int) -> tuple[dict[str, Any], list[Any]]:
    """A publish span's attributes and links (:func:`publish_span`)."""
    links: list[Any] = []
    seen: set[str] = set()  # the events of one request share their context: one link
    for text in headers:
        if len(links) >= MAX_LINKS:
            break
        if not text or text == "{}" or text in seen:
            continue
        seen.add(text)
        context = _span_context(_parse_headers(text))
        if context is not None:
            links.append(trace.Link(context))
    attributes: dict[str, Any] = {
        "messaging.system": MESSAGING_SYSTEM,
        "messaging.operation.type": "send",
        "messaging.operation.name": "publish",
        "messaging.batch.message_count": count,
    }
    if len(destinations) == 1:
        attributes["messaging.destination.name"] = destinations[0]
    return attributes, links


def process_span(
    traceparent: str | None,
    tracestate: str | None,
    destination: str,
    message_id: str,
    event_type: str,
    group: str,
) -> AbstractContextManager[Any]:
    """The consumer's span around one handler call: a child of the producer context carried
    by the event (a new trace when the event carries none)."""
    tracer = _tracer()
    if tracer is None:
        return _NULL
    parent = None
    if traceparent and _propagator is not None:
        headers = {"traceparent": traceparent}
        if tracestate:
            headers["tracestate"] = tracestate
        parent = _propagator.extract(headers)
    attributes = {
        "messaging.system": MESSAGING_SYSTEM,
        "messaging.operation.type": "process",
        "messaging.operation.name": "process",
        "messaging.destination.name": destination,
        "messaging.message.id": message_id,
        "messaging.consumer.group.name": group,
        "cloudevents.event_id": message_id,
        "cloudevents.event_type": event_type,
    }
    return _span(tracer, PROCESS_SPAN, trace.SpanKind.CONSUMER, parent, attributes, None)


@contextlib.contextmanager
def _span(
    tracer: Any, name: str, kind: Any, parent: Any, attributes: dict[str, Any], links: Any
) -> Iterator[Any]:
    """A current span; an exception leaving it is recorded (redacted) and sets status ERROR."""
    with tracer.start_as_current_span(
        name, context=parent, kind=kind, attributes=attributes, links=links,
        record_exception=False, set_status_on_exception=False,
    ) as span:
        try:
            yield span
        except BaseException as exc:
            _record(span, exc)
            raise


def _record(span: Any, exc: BaseException) -> None:
    stack = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    span.record_exception(exc, attributes={
        "exception.message": redact_url(str(exc)),
        "exception.stacktrace": redact_url(stack),
    }, escaped=True)
    span.set_status(trace.Status(trace.StatusCode.ERROR, type(exc).__name__))


def _parse_headers(text: str | None) -> dict[str, str]:
    if not text or text == "{}":
        return {}
    try:
        value = json.loads(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _span_context(headers: dict[str, str]) -> Any:
    """The valid span context of W3C ``headers``, else None (parsed here: the propagator's
    ``extract`` cost 4.5 µs a link, most of a relay span's cost)."""
    match = _TRACEPARENT.match(headers.get("traceparent") or "")
    if match is None or match["version"] == "ff":
        return None
    trace_id, span_id = int(match["trace"], 16), int(match["span"], 16)
    if not trace_id or not span_id:
        return None
    state = headers.get("tracestate")
    return trace.SpanContext(
        trace_id, span_id, is_remote=True, trace_flags=trace.TraceFlags(int(match["flags"], 16)),
        trace_state=trace.TraceState.from_header([state]) if state else None,
    )
