"""Command-line flags generated from the settings models, so ``--help`` and the environment
variables can never disagree: each field is ``--field-name`` and ``OUTBOX_FIELD_NAME``, and its
description and default are the help text. Flags override the environment."""

from __future__ import annotations

import argparse
from typing import Any, TypeVar

from pydantic import BaseModel, BeforeValidator, ValidationError

from shared.errors import ConfigError
from shared.logs import configure_logging

S = TypeVar("S", bound=BaseModel)


def add_settings_flags(parser: argparse.ArgumentParser, model: type[BaseModel]) -> None:
    """One flag per settings field (booleans as ``--flag/--no-flag``)."""
    group = parser.add_argument_group(f"settings ({model.__name__}; env OUTBOX_<NAME>)")
    for name, field in model.model_fields.items():
        flag = "--" + name.replace("_", "-")
        help_text = f"{field.description} [env OUTBOX_{name.upper()}, default {field.default!r}]"
        if field.annotation is bool:
            group.add_argument(
                flag, dest=name, action=argparse.BooleanOptionalAction, default=None,
                help=help_text,
            )
        else:
            duration = any(isinstance(m, BeforeValidator) for m in field.metadata)
            numeric = field.annotation in (int, float) and not duration  # "7d" is a duration
            kind: type = field.annotation if numeric else str  # type: ignore[assignment]
            group.add_argument(flag, dest=name, type=kind, default=None, help=help_text,
                               metavar=name.upper())


def load_settings(model: type[S], args: argparse.Namespace) -> S:
    """Build settings from the environment, then the flags given on the command line, and
    set up logging by their ``log_level``/``log_format``."""
    overrides: dict[str, Any] = {
        name: getattr(args, name)
        for name in model.model_fields
        if getattr(args, name, None) is not None
    }
    try:
        settings = model(**overrides)
    except ValidationError as err:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'settings'}: {e['msg']}"
            for e in err.errors()
        )
        raise ConfigError(f"invalid settings: {problems}") from None
    # Every command logs as asked (--log-level DEBUG shows the redacted driver messages).
    level, fmt = getattr(settings, "log_level", None), getattr(settings, "log_format", "text")
    if isinstance(level, str):
        configure_logging(level, fmt)
    return settings
