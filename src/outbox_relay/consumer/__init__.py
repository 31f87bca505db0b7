"""Consumer side: consumer groups, claim-before-ACK, inbox dedup, dead letters."""

from outbox_relay.consumer.handlers import Handler, Handlers

__all__ = ["Handler", "Handlers"]
