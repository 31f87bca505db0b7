"""Consumer side: consumer groups, claim-before-ACK, inbox dedup, retries, dead letters."""

from outbox_relay.consumer.handlers import BatchHandler, Handler, Handlers
from outbox_relay.consumer.retry import PermanentError, Reject, Retry

__all__ = ["BatchHandler", "Handler", "Handlers", "PermanentError", "Reject", "Retry"]
