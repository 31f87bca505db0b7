"""``--app``: loaded from the current directory; every failure one clear invalid_config line."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from outbox_relay.cli import apps
from outbox_relay.consumer import Handlers
from outbox_relay.shared.errors import ConfigError, UnavailableError
from outbox_relay.shared.settings import ConsumerSettings

SETTINGS = ConsumerSettings(database_url="sqlite://", redis_url="redis://127.0.0.1:6379/0")


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A service's project root as the current directory, with its modules forgotten after."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    before = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - before:
        del sys.modules[name]


def _write(root: Path, name: str, body: str) -> None:
    path = root / (name.replace(".", "/") + ".py")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(body)


def _error(spec: str) -> str:
    with pytest.raises(ConfigError) as info:
        apps.load_handlers(spec, SETTINGS)
    assert info.value.code == "invalid_config"
    return info.value.message


def test_a_module_in_the_current_directory_loads(project: Path) -> None:
    _write(project, "svc_events", "from outbox_relay import Handlers\nhandlers = Handlers()\n")
    assert isinstance(apps.load_handlers("svc_events:handlers", SETTINGS), Handlers)


def test_a_factory_gets_the_settings(project: Path) -> None:
    _write(project, "svc_factory", "from outbox_relay import Handlers\n"
           "def make(settings):\n    assert settings.group\n    return Handlers()\n")
    assert isinstance(apps.load_handlers("svc_factory:make", SETTINGS), Handlers)


def test_a_missing_module_is_named(project: Path) -> None:
    message = _error("nowhere_to_be_found.events:handlers")
    assert "no module named 'nowhere_to_be_found'" in message
    assert str(project) in message


def test_a_module_importing_something_missing_names_that_module(project: Path) -> None:
    _write(project, "svc_broken", "import not_installed_dependency\n")
    message = _error("svc_broken:handlers")
    assert "importing 'svc_broken' failed: it imports 'not_installed_dependency'" in message


def test_a_module_raising_on_import_says_what_it_raised(project: Path) -> None:
    _write(project, "svc_raises", "raise RuntimeError('postgresql://u:secret@db/x is down')\n")
    message = _error("svc_raises:handlers")
    assert "RuntimeError" in message and "secret" not in message


def test_the_wrong_kind_of_attribute(project: Path) -> None:
    assert "has no attribute 'nope'" in _error("outbox_relay:nope")
    assert "neither a Handlers object" in _error("outbox_relay:Handlers")  # the class itself
    _write(project, "svc_wrong", "value = 3\ndef make(settings):\n    return 'x'\n"
           "def bad(settings):\n    raise TypeError('boom')\n")
    assert "it is an object of type int" in _error("svc_wrong:value")
    assert "returned an object of type str" in _error("svc_wrong:make")
    assert "raised TypeError: boom" in _error("svc_wrong:bad")
    assert "must look like" in _error("svc_wrong")


def test_unavailable_from_a_factory_is_left_to_the_start_up_retry(project: Path) -> None:
    _write(project, "svc_wait", "from outbox_relay.shared.errors import UnavailableError\n"
           "def make(settings):\n    raise UnavailableError('database not up yet')\n")
    with pytest.raises(UnavailableError):
        apps.load_handlers("svc_wait:make", SETTINGS)


def test_no_app_is_refused_never_the_demo_worker_by_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("OUTBOX_APP", raising=False)
    with pytest.raises(ConfigError) as caught:
        apps.app_spec(None)
    assert "needs your handlers: --app module:attribute (or OUTBOX_APP)" in caught.value.message
    assert apps.DEFAULT_APP in caught.value.message  # and says how to run the demo worker
    monkeypatch.setenv("OUTBOX_APP", "svc.events:handlers")
    assert apps.app_spec(None) == "svc.events:handlers"
    assert apps.app_spec("other:h") == "other:h"
