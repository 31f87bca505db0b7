"""The torture's second consumer applies the same work with async and batch handlers
(``TORTURE_HANDLER_STYLE=async-batch``, torture/harness.py), so ``make torture`` covers every
handler kind with the same verdict."""

from __future__ import annotations

import pytest

from outbox_relay.shared.settings import ConsumerSettings
from torture import app, harness


def test_async_batch_style_registers_async_and_batch_handlers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TORTURE_HANDLER_STYLE", "async-batch")
    registry = app.handlers(ConsumerSettings(group="g", streams="items"))
    assert registry.has_async
    assert all(registry.batch(t) is not None for t in app.STRICT_TYPES)
    assert all(registry.batch(t) is None for t in app.LATEST_TYPES)
    monkeypatch.delenv("TORTURE_HANDLER_STYLE")
    plain = app.handlers(ConsumerSettings(group="g", streams="items"))
    assert not plain.has_async and all(plain.batch(t) is None for t in app.STRICT_TYPES)


def test_the_harness_runs_one_consumer_of_each_style(tmp_path: object) -> None:
    made = harness.children({}, tmp_path, seed=1, workers=False)  # type: ignore[arg-type]
    styles = {c.name: c.env.get("TORTURE_HANDLER_STYLE") for c in made
              if c.name.startswith("consumer-")}
    assert styles == {"consumer-0": None, "consumer-1": "async-batch"}
