"""Loading the handlers a consumer daemon runs: ``--app module:attribute``.

The attribute is a :class:`consumer.Handlers`, or a callable taking the consumer's settings and
returning one (so handlers can open what they need). This is how every worker CLI in the
ecosystem finds user code (arq, celery, dramatiq); it is the only dotted path we resolve.

Like uvicorn and celery, the current directory is put first on the import path, so
``outbox consume --app myservice.events:handlers`` works from a project's root without
installing it. Whatever goes wrong while loading ends as one ``invalid_config`` line naming
what failed (the missing module, the exception the user's code raised), never a traceback.
"""

from __future__ import annotations

import importlib
import os
import sys

from outbox_relay.consumer import Handlers
from outbox_relay.shared.errors import ConfigError, OutboxError
from outbox_relay.shared.redaction import redact_url
from outbox_relay.shared.settings import ConsumerSettings

DEFAULT_APP = "outbox_relay.cli.demo_app:handlers"
"""The demo's run worker: named in messages and used by ``make demo``, never picked silently."""


def app_spec(flag: str | None) -> str:
    """``--app``, else ``OUTBOX_APP``; neither is ``invalid_config``. A consumer that silently ran
    the demo worker would dead-letter every event of yours as ``unknown_type``."""
    spec = flag or os.environ.get("OUTBOX_APP", "").strip()
    if not spec:
        raise ConfigError(
            "this command needs your handlers: --app module:attribute (or OUTBOX_APP), e.g. "
            f"--app myservice.events:handlers; the demo's run worker is --app {DEFAULT_APP}"
        )
    return spec


def load_handlers(spec: str, settings: ConsumerSettings) -> Handlers:
    """Import ``module:attribute`` (the current directory first on the path) and return its
    handlers, calling the attribute with ``settings`` if it is a factory."""
    return handlers_of(spec, resolve(spec), settings)


def resolve(spec: str) -> object:
    """The attribute ``module:attribute`` names (the current directory first on the path), not
    called yet: ``outbox consume`` looks at it to pick the settings it loads."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"--app must look like 'package.module:attribute', not {spec!r}")
    _cwd_on_path()
    module = _import(spec, module_name)
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ConfigError(f"cannot load handlers {spec!r}: module {module_name!r} has no "
                          f"attribute {attr!r}") from None


def handlers_of(spec: str, target: object, settings: ConsumerSettings) -> Handlers:
    """``target`` (what ``spec`` names) if it is a :class:`Handlers`, else what it returns
    when called with ``settings``."""
    if isinstance(target, Handlers):
        return target
    if isinstance(target, type) or not callable(target):
        raise ConfigError(f"{spec!r} is neither a Handlers object nor a factory returning one "
                          f"(it is {_kind(target)})")
    try:
        handlers = target(settings)
    except OutboxError:
        raise  # unavailable: retried by the start-up; a ConfigError of the user's: shown
    except Exception as err:  # the user's factory failed: say how, in one line
        raise ConfigError(f"cannot load handlers {spec!r}: calling it with the consumer's "
                          f"settings raised {_describe(err)}") from None
    if isinstance(handlers, Handlers):
        return handlers
    raise ConfigError(f"{spec!r} is neither a Handlers object nor a factory returning one "
                      f"(calling it returned {_kind(handlers)})")


def _cwd_on_path() -> None:
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)


def _import(spec: str, module_name: str) -> object:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        missing = err.name or "?"
        if module_name == missing or module_name.startswith(missing + "."):
            raise ConfigError(
                f"cannot load handlers {spec!r}: no module named {missing!r} (looked in the "
                f"current directory {os.getcwd()} and the installed packages)"
            ) from None
        raise ConfigError(f"cannot load handlers {spec!r}: importing {module_name!r} failed: "
                          f"it imports {missing!r}, which is not installed") from None
    except Exception as err:  # the user's module raised while importing
        raise ConfigError(f"cannot load handlers {spec!r}: importing {module_name!r} raised "
                          f"{_describe(err)}") from None


def _describe(err: BaseException) -> str:
    """``Class: first line of the message`` (redacted, bounded): enough to find the bug,
    never a credential from a URL the message quotes."""
    message = redact_url(str(err)).strip().split("\n")[0][:200]
    return f"{type(err).__name__}: {message}" if message else type(err).__name__


def _kind(value: object) -> str:
    if isinstance(value, type):
        return f"the class {value.__name__}"
    return f"an object of type {type(value).__name__}"
