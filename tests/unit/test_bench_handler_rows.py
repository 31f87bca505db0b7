"""The consumer bench's handler rows (bench/consumer_loop.py): each compared row gets its own
registry, and a name that is no handler row (the hand-written loop's, a typo) is refused
instead of being measured as the one-row handler under another name."""

from __future__ import annotations

import pytest

from bench import consumer_loop

TYPE = "bench.event"


@pytest.mark.parametrize("variant", [v for v in consumer_loop.VARIANTS if v != "loop"])
def test_every_handler_row_has_its_registry(variant: str) -> None:
    handlers = consumer_loop.handlers_for(variant, TYPE)
    assert handlers.pipeline is (variant != "one-row unpipelined")
    assert (handlers.batch(TYPE) is not None) is (variant == "batch")
    assert handlers.get(TYPE) is not None
    assert handlers.has_async is (variant == "async one-row")
    expected = {"no-op": consumer_loop._noop, "one-row": consumer_loop.one_row_handler,
                "one-row unpipelined": consumer_loop.one_row_handler}
    if variant in expected:  # the function itself (the batch and async rows are wrapped)
        assert handlers.get(TYPE) is expected[variant]


@pytest.mark.parametrize("variant", ["loop", "one row", ""])
def test_a_name_that_is_no_handler_row_is_refused(variant: str) -> None:
    with pytest.raises(ValueError, match="no handler row"):
        consumer_loop.handlers_for(variant, TYPE)
