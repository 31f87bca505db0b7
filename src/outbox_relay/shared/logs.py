"""Log output of every daemon: text for people, or one JSON object per line for collectors.

``OUTBOX_LOG_FORMAT=text`` (the default) writes ``<time> <LEVEL> <logger> <message>`` and the
traceback, if any, below it. ``OUTBOX_LOG_FORMAT=json`` writes one object per record::

    {"time": "2025-01-31T12:00:00.123Z", "level": "WARNING",
     "logger": "outbox_relay.consumer.ordering", "message": "...", "event_id": "...",
     "event_type": "...", "exc": "Traceback ..."}

``time`` is ISO 8601 in UTC (milliseconds); ``exc`` (the formatted traceback) is present only
when the record carries an exception. Every other key is a structured field the call site
passed with ``extra=`` (``event_id``, ``event_type``, ``stream``, ``partition``, ``group``,
``epoch``, ``consumer``, ``node``, ``error`` ...): a collector can filter on them without
parsing the message. Guarantee: in both formats the whole output (message, fields, traceback)
goes through :func:`shared.redaction.redact_url`, so no URL password reaches a log.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any, Literal, TextIO

from outbox_relay.shared.redaction import RedactingFilter, redact_url

LogFormat = Literal["text", "json"]
LOG_FORMATS: tuple[LogFormat, ...] = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"

# The attributes every LogRecord has: anything else on a record came from ``extra=``.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message", "asctime", "taskName",
}
_BASE_KEYS = ("time", "level", "logger", "message", "exc")


class TextFormatter(logging.Formatter):
    """The classic one-line format; the formatted line and traceback are redacted."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        return redact_url(super().format(record))


class JsonFormatter(logging.Formatter):
    """One JSON object per record (see the module docstring for its keys)."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": _iso_utc(record.created),
            "level": record.levelname,
            "logger": record.name,
            "message": redact_url(record.getMessage()),
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD and key not in _BASE_KEYS and not key.startswith("_"):
                out[key] = _field(value)
        exc = self._exc_text(record)
        if exc:
            out["exc"] = redact_url(exc)
        return json.dumps(out, ensure_ascii=False, default=lambda v: redact_url(str(v)))

    def _exc_text(self, record: logging.LogRecord) -> str:
        parts = []
        if record.exc_info and record.exc_info[0] is not None:
            parts.append(self.formatException(record.exc_info))
        elif record.exc_text:
            parts.append(record.exc_text)
        if record.stack_info:
            parts.append(self.formatStack(record.stack_info))
        return "\n".join(parts)


def _iso_utc(created: float) -> str:
    stamp = datetime.fromtimestamp(created, UTC).isoformat(timespec="milliseconds")
    return stamp.replace("+00:00", "Z")


def _field(value: Any) -> Any:
    """A structured field as JSON: numbers, booleans and null as they are, the rest as
    redacted text."""
    if value is None or isinstance(value, bool | int | float):
        return value
    if isinstance(value, list | tuple):
        return [_field(v) for v in value]
    return redact_url(value if isinstance(value, str) else str(value))


class _CurrentStderr(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes each record to ``sys.stderr`` as it is *then*, not as it was when logging was
    configured: a stream replaced since (a test's capture, an embedding application's
    redirect) and closed would otherwise turn every later record into a "Logging error"
    traceback."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, _value: TextIO) -> None:
        pass  # always the current sys.stderr


def make_handler(fmt: str = "text", stream: TextIO | None = None) -> logging.Handler:
    """A handler writing ``fmt`` (``text`` or ``json``) to ``stream`` (default stderr),
    with the message of each record redacted before any formatter or filter sees it."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, not {fmt!r}")
    handler = logging.StreamHandler(stream) if stream is not None else _CurrentStderr()
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(RedactingFilter())
    return handler


def configure_logging(level: str, fmt: str = "text") -> None:
    """Root logging for a daemon: one line per record in ``fmt``, credentials redacted."""
    root = logging.getLogger()
    root.handlers[:] = [make_handler(fmt)]
    root.setLevel(level.upper())
    # Alembic reports every schema check at INFO; that is noise in a daemon's log.
    logging.getLogger("alembic").setLevel(max(root.level, logging.WARNING))
