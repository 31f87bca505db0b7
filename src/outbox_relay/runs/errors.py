"""The runs component's errors: leaves of the one error tree (:class:`OutboxError`), each with
its stable ``code``, raised only by durable runs (the state machine, the run store and the
runs HTTP API). The errors every component shares stay in :mod:`outbox_relay.shared.errors`.
"""

from __future__ import annotations

from outbox_relay.shared.errors import OutboxError


class InvalidTransitionError(OutboxError):
    """A status change the run state machine does not allow (never backward)."""

    code = "invalid_transition"


class IdempotencyConflictError(OutboxError):
    """The idempotency key was used before with a different request."""

    code = "idempotency_conflict"


class UnauthorizedError(OutboxError):
    """A request without a valid credential (the runs API: a missing or unknown bearer token)."""

    code = "unauthorized"


class RateLimitedError(OutboxError):
    """A caller exceeded its rate; ``retry_after_s`` says when trying again can succeed."""

    code = "rate_limited"

    def __init__(self, message: str | None = None, *, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
