"""Tracing is optional: without opentelemetry, or with only its API and no SDK provider set,
everything imports and works and the tracing helpers do nothing (not even read their input)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import pytest

from outbox_relay.producer import Producer
from outbox_relay.shared import tracing
from tests.helpers import ROOT

WITHOUT_OTEL = """
import sys
sys.modules["opentelemetry"] = None  # as if the otel extra were not installed
import outbox_relay.shared.tracing as tracing
assert not tracing.AVAILABLE and not tracing.enabled()
import outbox_relay.cli.main, outbox_relay.consumer.daemon, outbox_relay.relay.daemon
from outbox_relay import producer
assert tracing.carrier() == {}
with tracing.publish_span(["k"], iter(["{}"]), 1), tracing.process_span(
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", None, "k", "id", "t", "g"):
    pass
event_id, row = producer.Producer(partitions=2).build(postgres=False, type="t", stream="s")
assert row["headers"] == "{}", row["headers"]
print("ok")
"""


def test_everything_works_without_opentelemetry() -> None:
    result = subprocess.run([sys.executable, "-c", WITHOUT_OTEL], cwd=ROOT, capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def never_read() -> Iterator[str]:
    raise AssertionError("the headers of a batch were read with tracing off")
    yield ""  # pragma: no cover


@pytest.mark.skipif(not tracing.AVAILABLE, reason="opentelemetry-api is not installed")
def test_without_an_sdk_provider_the_helpers_do_nothing() -> None:
    from opentelemetry import trace

    assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
    assert not tracing.enabled()
    assert tracing.publish_span(["k"], never_read(), 1) is tracing._NULL
    assert tracing.process_span(None, None, "k", "id", "t", "g") is tracing._NULL
    # A current span context (from elsewhere) is still carried: it costs one lookup.
    remote = trace.SpanContext(0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331,
                               is_remote=True, trace_flags=trace.TraceFlags(1))
    assert tracing.carrier() == {}
    with trace.use_span(trace.NonRecordingSpan(remote)):
        headers = tracing.carrier()
        _id, row = Producer().build(postgres=False, type="t", stream="s")
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    assert headers == {"traceparent": parent}
    assert json.loads(row["headers"]) == {"traceparent": parent}


def test_an_explicit_tracestate_needs_a_traceparent_and_w3c_text() -> None:
    from outbox_relay.shared.errors import InvalidEventError

    producer = Producer()
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    _id, row = producer.build(postgres=False, type="t", stream="s", traceparent=parent,
                              tracestate="congo=t61rcWkgMzE")
    assert json.loads(row["headers"]) == {"traceparent": parent, "tracestate": "congo=t61rcWkgMzE"}
    for bad in [{"tracestate": "a=b"}, {"traceparent": parent, "tracestate": "x" * 513},
                {"traceparent": parent, "tracestate": "a=\x00"}]:
        with pytest.raises(InvalidEventError) as err:
            producer.build(postgres=False, type="t", stream="s", **bad)
        assert err.value.code == "bad_field"
