"""Consumer side: consumer groups, claim-before-ACK, inbox dedup, dead letters."""

from consumer.handlers import Handler, Handlers

__all__ = ["Handler", "Handlers"]
