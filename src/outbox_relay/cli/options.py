"""Command-line flags generated from the settings models, so ``--help`` and the environment
variables can never disagree: each field is ``--field-name`` and ``OUTBOX_FIELD_NAME``, and its
description and default are the help text. Flags override the environment."""

from __future__ import annotations

import argparse
import difflib
import logging
import os
from collections.abc import Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, BeforeValidator, ValidationError

from outbox_relay.shared.errors import ConfigError
from outbox_relay.shared.logs import configure_logging
from outbox_relay.shared.settings import CommonSettings

log = logging.getLogger("outbox.settings")

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
    settings = validated(model, overrides)
    # Every command logs as asked (--log-level DEBUG shows the redacted driver messages).
    level, fmt = getattr(settings, "log_level", None), getattr(settings, "log_format", "text")
    if isinstance(level, str):
        configure_logging(level, fmt)
    for name, hint in unknown_environment(os.environ):
        log.warning("unknown setting %s ignored%s", name,
                    f" (did you mean {hint}?)" if hint else "")
    return settings


def validated(model: type[S], values: Mapping[str, Any]) -> S:
    """``model`` from ``values`` over the environment; a validation error is one
    ``invalid_config`` naming every field that failed."""
    try:
        return model(**values)
    except ValidationError as err:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'settings'}: {e['msg']}"
            for e in err.errors()
        )
        raise ConfigError(f"invalid settings: {problems}") from None


# OUTBOX_* variables that are not settings fields but are ours: fault injection (shared/faults.py),
# --app's default (cli/apps.py),
# the test and benchmark suites' servers, the demo agent's own settings (cli/demo_app.py).
NOT_FIELDS = frozenset({"OUTBOX_FAULTS", "OUTBOX_FAULTS_SEED", "OUTBOX_STREAM_MAXLEN",
                        "OUTBOX_APP"})
NOT_FIELD_PREFIXES = ("OUTBOX_TEST_", "OUTBOX_BENCH_", "OUTBOX_DEMO_")


def unknown_environment(environ: Mapping[str, str]) -> list[tuple[str, str | None]]:
    """``OUTBOX_*`` variables no settings model knows (a typo like ``OUTBOX_PARTITONS`` would
    otherwise be ignored in silence), each with the closest known name, if any."""
    known = {f"OUTBOX_{name.upper()}" for model in _settings_models()
             for name in model.model_fields} | NOT_FIELDS
    unknown = sorted(k for k in environ if k.startswith("OUTBOX_") and k not in known
                     and not k.startswith(NOT_FIELD_PREFIXES))
    return [(k, next(iter(difflib.get_close_matches(k, known, n=1, cutoff=0.8)), None))
            for k in unknown]


def _settings_models() -> list[type[BaseModel]]:
    """Every settings model loaded (the CLI imports them all when it builds its parser)."""
    found: list[type[BaseModel]] = []
    todo: list[type[BaseModel]] = [CommonSettings]
    while todo:
        model = todo.pop()
        if model not in found:
            found.append(model)
            todo.extend(model.__subclasses__())
    return found
