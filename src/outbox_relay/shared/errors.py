"""One error tree for the whole system.

Every failure a caller can see is an :class:`OutboxError` with a stable, machine-readable
``code``. Driver errors (SQLAlchemy, psycopg, redis-py) are wrapped at the component boundary
with ``raise ... from exc``: the public ``message`` is ours and never carries the driver's text
or a credential; the original exception stays on ``__cause__`` for debug logs only.

These are the errors the components share; a component's own leaves of this tree live in that
component's ``errors`` module.
"""

from __future__ import annotations


class OutboxError(Exception):
    """Root of every error this package raises on purpose."""

    code: str = "error"

    def __init__(self, message: str | None = None, *, code: str | None = None) -> None:
        if code is not None:
            self.code = code
        self.message = message or self.code.replace("_", " ")
        super().__init__(self.message)

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


class ConflictError(OutboxError):
    """A compare-and-set found another revision: someone else changed the row first."""

    code = "conflict"


class NotFoundError(OutboxError):
    """The row (run, question, dead letter) does not exist."""

    code = "not_found"


class DuplicateEventError(OutboxError):
    """An outbox row with this event id already exists; the mutation was enqueued before."""

    code = "duplicate_event"


class CorruptRecordError(OutboxError):
    """A stored record does not parse, or its revision disagrees with its own column."""

    code = "corrupt_record"


class SchemaError(OutboxError):
    """The database schema is not the one this code was written for."""

    code = "schema_mismatch"


class SchemaTooNewError(SchemaError):
    """The database was migrated by a newer release; we refuse to guess at it."""

    code = "schema_too_new"


class SchemaNotReadyError(SchemaError):
    """The database lacks tables or migrations; run ``outbox db upgrade``."""

    code = "schema_not_ready"


class UnavailableError(OutboxError):
    """Redis or the database could not be reached or timed out; retrying may help."""

    code = "unavailable"


class CannotConnectError(OutboxError):
    """The database or Redis refused us for a reason retrying cannot fix: an unknown database
    or user, failed authentication, an unknown host. Not an :class:`UnavailableError`, so
    nothing retries it; the CLI exits at once with status 2 (fix the setting)."""

    code = "unavailable"


class ReadOnlyError(CannotConnectError):
    """The database opens but refuses writes (a read-only SQLite file, folder or mount)."""

    code = "read_only"


class StreamBehindError(UnavailableError):
    """A stream holds less than the outbox delivered to it (Redis lost data): repair it first."""

    code = "stream_behind"


class InvalidEventError(OutboxError):
    """An event (from a producer or read from a stream) breaks the wire contract.

    ``code`` says which rule: ``missing_field``, ``bad_specversion``, ``bad_json``,
    ``data_too_large``, ``bad_encoding``, ``bad_revision``, ``empty_entry``, ``bad_field``,
    ``non_finite_number``; read by a consumer also ``bad_signature`` and ``oversized`` (an
    entry larger than the read limit, refused unread: :mod:`consumer.streams`).
    """

    code = "invalid_event"


class ConfigError(OutboxError):
    """A setting is missing or malformed."""

    code = "invalid_config"


class LeaseLostError(OutboxError):
    """A lease we held (a relay's partition, a consumer's stream, a worker's run) was taken
    over by another process; stop without writing."""

    code = "lease_lost"


class InvalidRequestError(OutboxError):
    """A caller's input failed validation."""

    code = "invalid_request"


class ForbiddenError(OutboxError):
    """A known caller (or the anonymous one) asked for what it may not do: a mutation of the
    operator console on an API without tokens (``read_only``)."""

    code = "forbidden"
