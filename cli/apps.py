"""Loading the handlers a consumer daemon runs: ``--app module:attribute``.

The attribute is a :class:`consumer.Handlers`, or a callable taking the consumer's settings and
returning one (so handlers can open what they need). This is how every worker CLI in the
ecosystem finds user code (arq, celery, dramatiq); it is the only dotted path we resolve.
"""

from __future__ import annotations

import importlib

from consumer import Handlers
from shared.errors import ConfigError
from shared.settings import ConsumerSettings

DEFAULT_APP = "cli.demo_app:handlers"


def load_handlers(spec: str, settings: ConsumerSettings) -> Handlers:
    """Import ``module:attribute`` and return its handlers."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"--app must look like 'package.module:attribute', not {spec!r}")
    try:
        target = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"cannot load handlers {spec!r}: {type(err).__name__}") from None
    if isinstance(target, Handlers):
        return target
    if callable(target):
        handlers = target(settings)
        if isinstance(handlers, Handlers):
            return handlers
    raise ConfigError(f"{spec!r} is neither a Handlers object nor a factory returning one")
