"""Log output: one redacted JSON object per line (``OUTBOX_LOG_FORMAT=json``), or redacted text."""

from __future__ import annotations

import io
import json
import logging
import re
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from outbox_relay.shared import logs, redaction

SECRET = "hunter2"
URL = f"postgresql://app:{SECRET}@db.internal:5432/orders"


@pytest.fixture
def capture() -> Iterator[tuple[logging.Logger, io.StringIO, list[logging.Handler]]]:
    """A private logger (not propagating to the root) and the stream its handler writes."""
    stream = io.StringIO()
    logger = logging.getLogger(f"test.logs.{id(stream)}")
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    handlers: list[logging.Handler] = []
    yield logger, stream, handlers
    for handler in handlers:
        logger.removeHandler(handler)


def use(
    capture: tuple[logging.Logger, io.StringIO, list[logging.Handler]], fmt: str
) -> tuple[logging.Logger, io.StringIO]:
    logger, stream, handlers = capture
    handler = logs.make_handler(fmt, stream)
    logger.addHandler(handler)
    handlers.append(handler)
    return logger, stream


def records(stream: io.StringIO) -> list[dict[str, Any]]:
    lines = stream.getvalue().splitlines()
    assert lines, "nothing was logged"
    return [json.loads(line) for line in lines]  # each line is a whole JSON object


def test_json_has_time_level_logger_message_and_one_object_per_line(capture: Any) -> None:
    logger, stream = use(capture, "json")
    logger.info("first %s", "record")
    logger.warning("second\nrecord with a newline")
    first, second = records(stream)
    assert set(first) == {"time", "level", "logger", "message"}
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", first["time"])
    assert (first["level"], first["logger"], first["message"]) == (
        "INFO", logger.name, "first record")
    assert second["level"] == "WARNING"
    assert second["message"] == "second\nrecord with a newline"


def test_json_carries_extra_fields_with_their_types(capture: Any) -> None:
    logger, stream = use(capture, "json")
    logger.warning("lost the lease", extra={
        "event_id": "order-1:created:3", "event_type": "order.created", "stream": "orders",
        "partition": 2, "group": "billing", "epoch": 7, "consumer": "c1", "node": "relay-a",
        "stream_keys": ["outbox:orders:0", "outbox:orders:1"], "ok": False, "nothing": None,
    })
    (rec,) = records(stream)
    assert rec["event_id"] == "order-1:created:3"
    assert rec["event_type"] == "order.created"
    assert (rec["partition"], rec["epoch"], rec["ok"], rec["nothing"]) == (2, 7, False, None)
    assert (rec["group"], rec["consumer"], rec["node"]) == ("billing", "c1", "relay-a")
    assert rec["stream_keys"] == ["outbox:orders:0", "outbox:orders:1"]
    assert "exc" not in rec


def test_json_renders_other_values_as_text_and_keeps_its_own_keys(capture: Any) -> None:
    logger, stream = use(capture, "json")
    logger.info("hello", extra={"time": "not mine", "level": "no", "where": object()})
    (rec,) = records(stream)
    assert rec["level"] == "INFO"
    assert rec["time"] != "not mine"
    assert rec["where"].startswith("<object object")


def test_json_redacts_a_url_password_in_message_fields_and_traceback(capture: Any) -> None:
    logger, stream = use(capture, "json")
    try:
        raise ConnectionError(f"could not connect to {URL}")
    except ConnectionError:
        logger.warning("database %s is unavailable", URL, exc_info=True,
                       extra={"url": URL, "urls": [URL]})
    text = stream.getvalue()
    assert SECRET not in text
    (rec,) = records(stream)
    assert rec["message"] == "database postgresql://app:***@db.internal:5432/orders is unavailable"
    assert rec["url"] == rec["urls"][0] == "postgresql://app:***@db.internal:5432/orders"
    assert rec["exc"].startswith("Traceback (most recent call last):")
    assert "ConnectionError: could not connect to postgresql://app:***@db.internal" in rec["exc"]


def test_json_includes_stack_info(capture: Any) -> None:
    logger, stream = use(capture, "json")
    logger.warning("where am I", stack_info=True)
    (rec,) = records(stream)
    assert "Stack (most recent call last)" in rec["exc"]


def test_text_redacts_the_traceback_too(capture: Any) -> None:
    logger, stream = use(capture, "text")
    try:
        raise ValueError(f"bad {URL}")
    except ValueError:
        logger.exception("failed on %s", URL)
    text = stream.getvalue()
    assert SECRET not in text
    assert "ERROR" in text and "Traceback" in text
    assert "ValueError: bad postgresql://app:***@db.internal" in text


def test_an_unknown_format_is_refused() -> None:
    with pytest.raises(ValueError, match="log format"):
        logs.make_handler("xml")


@pytest.mark.parametrize("configure", [logs.configure_logging, redaction.configure_logging])
def test_configure_logging_installs_one_root_handler_of_the_format(configure: Any) -> None:
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        configure("warning", "json")
        assert len(root.handlers) == 1
        assert isinstance(root.handlers[0].formatter, logs.JsonFormatter)
        assert root.level == logging.WARNING
        configure("DEBUG")
        assert isinstance(root.handlers[0].formatter, logs.TextFormatter)
        assert logging.getLogger("alembic").level == logging.WARNING
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)
        logging.getLogger("alembic").setLevel(logging.NOTSET)


def test_records_go_to_the_current_stderr_not_a_replaced_and_closed_one(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """A daemon configured while ``sys.stderr`` was another stream (a test's capture, an
    embedding app's redirect) that is closed since: records still reach stderr, and no
    "Logging error" traceback is printed."""
    saved_handlers, saved_stderr = logging.getLogger().handlers[:], sys.stderr
    temporary = io.StringIO()
    sys.stderr = temporary
    try:
        logs.configure_logging("INFO")
    finally:
        sys.stderr = saved_stderr
    temporary.close()
    try:
        logging.getLogger("outbox_relay.test").warning("after the redirect ended")
    finally:
        logging.getLogger().handlers[:] = saved_handlers
    err = capfd.readouterr().err
    assert "after the redirect ended" in err and "Logging error" not in err
