"""``OUTBOX_CONSOLE_APPS``: which handlers the console replays each group's letters with."""

from __future__ import annotations

import pytest

from outbox_relay.cli.console import parse_apps
from outbox_relay.shared.errors import ConfigError


def test_entries_name_a_group_and_its_handlers() -> None:
    assert parse_apps("") == {}
    assert parse_apps(" billing = shop.billing:handlers , workers=app:h,") == {
        "billing": "shop.billing:handlers", "workers": "app:h"}


@pytest.mark.parametrize("text", ["billing", "billing=shop", "=a:b", "a b=x:y", "g=a:b,g=c:d"])
def test_a_malformed_entry_is_one_clear_error(text: str) -> None:
    with pytest.raises(ConfigError):
        parse_apps(text)
