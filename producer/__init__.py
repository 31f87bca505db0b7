"""Producer side: write state and its outbox event in the caller's own transaction."""

from producer.enqueue import Producer

__all__ = ["Producer"]
