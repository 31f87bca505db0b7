"""A test kit for handlers: enqueue, :meth:`Outbox.drain`, assert.

::

    pytest_plugins = ["outbox_relay.testing.plugin"]

    @pytest.fixture
    def outbox_handlers() -> Handlers:
        return my_app.handlers

    def test_invoice(outbox: Outbox) -> None:
        with outbox.engine.begin() as conn:
            place_order(conn, "o-1", 42)       # the app's own transaction and enqueue
        outbox.drain()                          # relay + consumer until nothing is left
        assert [r.outcome for r in outbox.receipts()] == ["applied"]

:class:`Outbox` runs the real relay and consumer in-process (:mod:`testing.kit`); the
``outbox`` fixture and its two configuration fixtures come from :mod:`testing.plugin`, which
only pytest imports. This package is a wiring module like the CLI: nothing in ``outbox_relay``
imports it; it needs ``fakeredis[lua]`` by default, and its plugin pytest (the ``testing``
extra).
"""

from __future__ import annotations

from outbox_relay.testing.kit import DrainReport, NotSettledError, Options, Outbox
from outbox_relay.testing.state import Backlog, DeadLetter, Receipt

__all__ = [
    "Backlog",
    "DeadLetter",
    "DrainReport",
    "NotSettledError",
    "Options",
    "Outbox",
    "Receipt",
]
