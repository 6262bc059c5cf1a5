"""Dataclass configs on the command line: one ``--flag`` per field, typed from the annotation.

A field ``num_episodes: int = 200`` becomes ``--num-episodes INT``; ``bool`` fields become
``--flag`` / ``--no-flag``; ``X | None`` fields accept ``none``. The field's docstring-like comment is not
available at run time, so help texts come from an optional ``help`` entry in the field's metadata.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import types
import typing
from collections.abc import Iterator, Mapping
from typing import Any, TypeVar

Config = TypeVar("Config")


def _parser_for(annotation) -> tuple[Any, bool]:
    """(converter, optional) for a field annotation such as ``int``, ``str | None``, ``float``."""
    optional = False
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        members = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        optional = len(members) < len(typing.get_args(annotation))
        annotation = members[0]
    if annotation not in (int, float, str, bool):
        raise TypeError(f"unsupported config field type {annotation!r}")
    return annotation, optional


def add_config_arguments(parser: argparse.ArgumentParser, config_class: type) -> None:
    """Add one option per field of the dataclass ``config_class`` to ``parser``."""
    hints = typing.get_type_hints(config_class)
    for field in dataclasses.fields(config_class):
        kind, optional = _parser_for(hints[field.name])
        flag = "--" + field.name.replace("_", "-")
        default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
        help_text = field.metadata.get("help", "") + f" (default: {default})"
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_text)
            continue

        def convert(text: str, kind=kind, optional=optional):
            if optional and text.lower() == "none":
                return None
            return kind(text)

        parser.add_argument(flag, type=convert, default=default, dest=field.name, help=help_text,
                            metavar=kind.__name__.upper())  # fmt: skip


def config_from_args(config_class: type[Config], args: argparse.Namespace) -> Config:
    """Build ``config_class`` from the parsed options added by :func:`add_config_arguments`.

    The config's own checks (``__post_init__``) judge the user's flags, so a ``TypeError`` they raise is
    reported like a ``ValueError``: as :class:`~icrl_models._cli.UsageError` (one line, exit status 2)."""
    from ._cli import UsageError

    try:
        return config_class(**{field.name: getattr(args, field.name) for field in dataclasses.fields(config_class)})
    except TypeError as error:
        raise UsageError(str(error)) from error


def fill_from_preset(config: Any, presets: Mapping[str, Mapping[str, Any]]) -> None:
    """Set every field of ``config`` that is ``None`` and named in ``presets[config.preset]`` to the preset's value.

    The pattern behind ``--preset cpu|paper``: fields default to ``None`` so that an explicit flag always wins.
    """
    if config.preset not in presets:
        raise ValueError(f"preset must be one of {tuple(presets)}, got {config.preset!r}")
    for name, value in presets[config.preset].items():
        if getattr(config, name) is None:
            setattr(config, name, value)


@contextlib.contextmanager
def torch_threads(num_threads: int | None) -> Iterator[None]:
    """Run the body with ``torch.set_num_threads(num_threads)`` (unchanged for ``None`` or 0), then restore.

    Tiny models gain nothing from intra-op threads, and on a shared CPU the threads fight each other."""
    import torch

    previous = torch.get_num_threads()
    if num_threads:
        torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
