"""Producer side: write state and its outbox event in the caller's own transaction."""

from outbox_relay.producer.enqueue import Producer

__all__ = ["Producer"]
