"""The event envelope: one frozen model, flat CloudEvents 1.0 string fields on the wire.

A stream entry is a flat map of strings so that any Redis client in any language can read it::

    specversion=1.0  id=<event id>  source=<service>  type=<kind>  time=<RFC 3339>
    subject=<aggregate id>  datacontenttype=application/json  data=<JSON text>
    aggregatetype=<type>  aggregateid=<id>  revision=<int>  [traceparent=<W3C>]
    [tracestate=<W3C>]

``traceparent``/``tracestate`` are the CloudEvents distributed tracing extension (W3C Trace
Context): the producer's span context, which the consumer's handler span continues.

The ``id`` is the idempotency key: consumers record it in their inbox, together with the
event's :func:`fingerprint` (so a re-used id carrying other data is told from a duplicate).
With a signing key the relay adds ``signature`` (shared/signing.py) over :func:`canonical`.

JSON ``data`` must hold finite numbers only: ``NaN``, ``Infinity`` and numbers too large for a
double (``1e999``) are refused (``non_finite_number``): other JSON readers refuse or change them.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from datetime import UTC, datetime
from json.encoder import c_make_encoder, encode_basestring  # type: ignore[attr-defined]
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from outbox_relay.shared.errors import InvalidEventError

SPECVERSION = "1.0"
JSON_CONTENT_TYPE = "application/json"
REQUIRED_FIELDS = ("specversion", "id", "source", "type", "time")
MAX_ID_LENGTH = 512
MAX_REVISION = 2**63 - 1  # the inbox stores revisions as BIGINT
DEFAULT_MAX_DATA_BYTES = 1_048_576


def encode_fields(
    *,
    event_id: str,
    source: str,
    type: str,
    time: datetime,
    data_json: str,
    datacontenttype: str = JSON_CONTENT_TYPE,
    subject: str | None = None,
    aggregatetype: str | None = None,
    aggregateid: str | None = None,
    revision: int | None = None,
    traceparent: str | None = None,
    tracestate: str | None = None,
) -> dict[str, str]:
    """The one wire encoder: the flat string fields of an entry (absent optional attributes
    left out). :meth:`Event.to_fields` and the relay (relay/append.py, straight from a row,
    without building the model) both call it, so the two can never disagree.
    ``data_json`` is the data as JSON text, sent as is."""
    fields = {
        "specversion": SPECVERSION,
        "id": event_id,
        "source": source,
        "type": type,
        "time": time.astimezone(UTC).isoformat().replace("+00:00", "Z"),
        "datacontenttype": datacontenttype,
        "data": data_json,
    }
    if subject is not None:
        fields["subject"] = subject
    if aggregatetype is not None:
        fields["aggregatetype"] = aggregatetype
    if aggregateid is not None:
        fields["aggregateid"] = aggregateid
    if revision is not None:
        fields["revision"] = str(revision)
    if traceparent is not None:
        fields["traceparent"] = traceparent
    if tracestate is not None:
        fields["tracestate"] = tracestate
    return fields


class Event(BaseModel):
    """An event as it travels: built by the relay from an outbox row, parsed by consumers."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str = Field(min_length=1, max_length=MAX_ID_LENGTH)
    source: str = Field(min_length=1, max_length=256)
    type: str = Field(min_length=1, max_length=256)
    time: datetime
    subject: str | None = None
    datacontenttype: str = JSON_CONTENT_TYPE
    data: Any = None
    aggregatetype: str | None = Field(default=None, max_length=128)  # inbox column sizes
    aggregateid: str | None = Field(default=None, max_length=256)
    revision: int | None = Field(default=None, ge=0, le=MAX_REVISION)
    traceparent: str | None = None
    tracestate: str | None = None

    def to_fields(self) -> dict[str, str]:
        """Flat string fields for ``XADD`` (absent optional attributes are left out)."""
        return encode_fields(
            event_id=self.id,
            source=self.source,
            type=self.type,
            time=self.time,
            data_json=json.dumps(self.data, separators=(",", ":"), ensure_ascii=False),
            datacontenttype=self.datacontenttype,
            subject=self.subject,
            aggregatetype=self.aggregatetype,
            aggregateid=self.aggregateid,
            revision=self.revision,
            traceparent=self.traceparent,
            tracestate=self.tracestate,
        )

    @classmethod
    def from_fields(
        cls,
        raw: Mapping[bytes, bytes] | Mapping[str, str],
        *,
        max_data_bytes: int = DEFAULT_MAX_DATA_BYTES,
    ) -> Event:
        """Parse and validate a stream entry; raise :class:`InvalidEventError` with a reason."""
        fields = _decode(raw)
        if not fields:
            raise InvalidEventError("the entry has no fields", code="empty_entry")
        for name in REQUIRED_FIELDS:
            if not fields.get(name):
                raise InvalidEventError(f"field {name!r} is missing", code="missing_field")
        if fields["specversion"] != SPECVERSION:
            raise InvalidEventError("specversion must be 1.0", code="bad_specversion")
        return cls._build(fields, max_data_bytes)

    @classmethod
    def _build(cls, fields: dict[str, str], max_data_bytes: int) -> Event:
        text = fields.get("data")
        if text is not None and len(text.encode("utf-8")) > max_data_bytes:
            raise InvalidEventError(
                f"data is larger than {max_data_bytes} bytes", code="data_too_large"
            )
        content_type = fields.get("datacontenttype", JSON_CONTENT_TYPE)
        data: Any = text
        if text is not None and content_type == JSON_CONTENT_TYPE:
            try:
                if text.startswith("\ufeff"):  # as json.loads: a BOM is no JSON text
                    raise ValueError("a byte order mark")
                data = _DECODER.decode(text)
            except _NonFinite:
                raise InvalidEventError(
                    "data holds a non-finite number (NaN, Infinity, or one too large for a "
                    "double such as 1e999)", code="non_finite_number") from None
            except (ValueError, RecursionError):  # RecursionError: absurdly deep nesting
                raise InvalidEventError("data is not valid JSON", code="bad_json") from None
        revision = fields.get("revision")
        if revision is not None and not _is_revision(revision):
            raise InvalidEventError("revision must be a non-negative integer", code="bad_revision")
        time = _parse_time(fields["time"])
        try:
            return cls(
                **{k: v for k, v in fields.items() if k in _PLAIN_ATTRIBUTES},
                data=data,
                time=time,
                revision=None if revision is None else int(revision),
            )
        except ValueError as exc:
            raise InvalidEventError(
                f"invalid attribute: {_first_location(exc)}", code="bad_field"
            ) from None


_PLAIN_ATTRIBUTES = frozenset(Event.model_fields) - {"data", "revision", "time"}
"""The attributes taken from an entry's field of the same name as they are."""


class _NonFinite(Exception):
    """JSON data held ``NaN``/``Infinity`` or an overflowing number (see :meth:`Event._build`)."""


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # "1e999" parses to inf
        raise _NonFinite(text)
    return value


def _no_constant(text: str) -> Any:
    raise _NonFinite(text)  # NaN, Infinity, -Infinity: not JSON (RFC 8259)


# One decoder for every entry: ``json.loads`` with hooks built a new one per call (a tenth of
# a consumer's parse).
_DECODER = json.JSONDecoder(parse_float=_finite_float, parse_constant=_no_constant)


def fingerprint(event: Event) -> str:
    """A hash of what an event says: ``type``, ``source``, aggregate type, id and revision,
    and ``data`` (lowercase hex SHA-256 of their canonical JSON, object keys sorted).

    The inbox stores it with each receipt: a redelivered id with the same fingerprint is a
    duplicate; with another one it is ``conflicting_duplicate``. Time and trace context are
    left out: the relay re-sends an event with the same ones, and they change nothing a
    handler applies. Data is hashed as parsed (``{"a":1, "b":2}`` and ``{"b":2,"a":1}`` are
    one value), so a foreign producer's whitespace or key order is no conflict.
    """
    body = [event.type, event.source, event.aggregatetype, event.aggregateid, event.revision,
            event.datacontenttype, event.data]
    return hashlib.sha256(_canonical_json(body).encode("utf-8")).hexdigest()


# ``json.dumps`` with options built an encoder per call; the text is the same.
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)

# ``_CANONICAL.encode`` still builds its C encoder on every call (a third of a fingerprint's
# time, on every event a consumer claims): this is that encoder, built once, with the same
# options. Without the circular-reference check (its state would be shared between
# threads): data parsed from JSON has no cycle, and anything else falls back to ``encode``.
_C_CANONICAL = None if c_make_encoder is None else c_make_encoder(
    None, _CANONICAL.default, encode_basestring, None, ":", ",", True, False, True)


def _canonical_json(value: Any) -> str:
    """``_CANONICAL.encode(value)``, the same text (checked by the unit tests), cheaper."""
    if _C_CANONICAL is None:
        return _CANONICAL.encode(value)
    try:
        return "".join(_C_CANONICAL(value, 0))
    except RecursionError:  # a cycle (or absurd nesting): encode says which
        return _CANONICAL.encode(value)


def canonical(fields: Mapping[bytes, bytes] | Mapping[str, str], *, exclude: str) -> bytes:
    """The bytes an entry's signature covers (docs/wire-format.md, "Signatures"): every field
    but ``exclude``, sorted by name (bytewise, UTF-8), each written as
    ``<len(name)>:<name><len(value)>:<value>`` with lengths in bytes, in decimal.

    Length prefixes make the form unambiguous (no separator can be forged inside a value), and
    covering every field means nothing can be added to a signed entry either.
    """
    pairs = sorted(
        (k.encode("utf-8") if isinstance(k, str) else k,
         v.encode("utf-8") if isinstance(v, str) else v)
        for k, v in fields.items()
    )
    skip = exclude.encode("utf-8")
    return b"".join(b"%d:%s%d:%s" % (len(k), k, len(v), v) for k, v in pairs if k != skip)


def _decode(raw: Mapping[bytes, bytes] | Mapping[str, str]) -> dict[str, str]:
    """The entry's fields as text: UTF-8, no NUL (``bad_encoding`` otherwise).

    A stream entry's fields are bytes: decoded in one comprehension (a third cheaper per
    entry than a checked loop, on every entry a consumer reads); a mapping of text, or of
    both, takes the loop."""
    try:
        out = {k.decode("utf-8"): v.decode("utf-8")  # type: ignore[union-attr]
               for k, v in raw.items()}
    except AttributeError:  # text keys or values
        return _decode_mixed(raw)
    except UnicodeDecodeError:
        raise InvalidEventError("a field is not UTF-8 text", code="bad_encoding") from None
    for k, v in out.items():
        if "\x00" in k or "\x00" in v:  # PostgreSQL text cannot hold NUL
            raise InvalidEventError("a field contains a NUL character", code="bad_encoding")
    return out


def _decode_mixed(raw: Mapping[bytes, bytes] | Mapping[str, str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in raw.items():
        try:
            k = key.decode("utf-8") if isinstance(key, bytes) else key
            v = value.decode("utf-8") if isinstance(value, bytes) else value
        except UnicodeDecodeError:
            raise InvalidEventError("a field is not UTF-8 text", code="bad_encoding") from None
        if "\x00" in k or "\x00" in v:  # PostgreSQL text cannot hold NUL
            raise InvalidEventError("a field contains a NUL character", code="bad_encoding")
        out[k] = v
    return out


def _is_revision(text: str) -> bool:
    """A non-negative integer that fits the inbox's BIGINT column."""
    digits = text.lstrip("0")
    if not (text.isascii() and text.isdigit()) or len(digits) > 19:
        return False
    return int(digits or 0) <= MAX_REVISION


def _parse_time(text: str) -> datetime:
    try:
        value = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise InvalidEventError("time is not RFC 3339", code="bad_field") from None
    return value if value.tzinfo else value.replace(tzinfo=UTC)


def _first_location(exc: ValueError) -> str:
    errors = getattr(exc, "errors", None)
    if callable(errors):
        for item in errors():
            loc = ".".join(str(p) for p in item.get("loc", ()))
            if loc:
                return loc
    return "unknown"
