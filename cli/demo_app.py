"""Handlers of the demo consumer group: accept every run event.

The receipt in the inbox is the demo's side effect: ``applied`` once per event, however often
the stream delivers it.
"""

from __future__ import annotations

from sqlalchemy import Connection

from consumer import Handlers
from shared.envelope import Event
from shared.settings import ConsumerSettings


def _accept(conn: Connection, event: Event) -> None:
    """Nothing to do beyond the receipt the claim transaction writes."""


def handlers(settings: ConsumerSettings) -> Handlers:
    """The demo's registry: every ``run.*`` event type the run store emits."""
    registry = Handlers()
    for kind in ("run.created", "run.resume", "run.answered", "run.needs_input",
                 "run.completed", "run.failed"):
        registry.register(kind, _accept)
    return registry
