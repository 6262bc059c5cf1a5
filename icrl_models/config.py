"""Dataclass configs on the command line: one ``--flag`` per field, typed from the annotation.

A field ``num_episodes: int = 200`` becomes ``--num-episodes INT``; ``bool`` fields become
``--flag`` / ``--no-flag``; ``X | None`` fields accept ``none``; ``tuple[int, ...]`` fields take a list,
``--ngram-sizes 1 2`` (``nargs``; a comma-separated ``1,2`` is read the same, as older command lines
wrote it). The field's docstring-like comment is not available at run time, so help texts come from an
optional ``help`` entry in the field's metadata; ``aliases`` there adds more option strings, ``metavar``
names the value, ``allow_empty`` lets a list flag take no value, ``const`` is the value of the flag given
alone (``--cuda-graph`` for ``--cuda-graph on``).

Kept hand-written rather than built on tyro or simple-parsing (both evaluated for issue 18): tyro prints
boxed multi-line errors instead of ``prog: error: ...`` and reads the section comments of a dataclass as
help text; simple-parsing writes ``--num_histories`` and ``--flag bool`` unless configured; either is a
new core dependency for ~100 lines.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import re
import types
import typing
from collections.abc import Iterator
from typing import Any, TypeVar

Config = TypeVar("Config")
_SCALARS = (int, float, str, bool)


def _parser_for(annotation) -> tuple[Any, bool, bool]:
    """(element converter, optional, is_list) for a field annotation such as ``int``, ``str | None``,
    ``tuple[int, ...]`` or ``tuple[str, ...] | None``."""
    optional = False
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        members = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        optional = len(members) < len(typing.get_args(annotation))
        if len(members) != 1:
            raise TypeError(f"unsupported config field type {annotation!r}")
        annotation = members[0]
    is_list = False
    if typing.get_origin(annotation) is tuple:
        args = typing.get_args(annotation)
        if len(args) != 2 or args[1] is not Ellipsis:
            raise TypeError(f"unsupported config field type {annotation!r} (use tuple[X, ...])")
        annotation, is_list = args[0], True
    if annotation not in _SCALARS or (is_list and annotation is bool):
        raise TypeError(f"unsupported config field type {annotation!r}")
    return annotation, optional, is_list


def _show(value: Any) -> str:
    """A default as the user would type it: ``1 2`` for a tuple, ``none`` for None."""
    if value is None:
        return "none"
    if isinstance(value, tuple):
        return " ".join(str(v) for v in value) if value else "none"
    return str(value)


def as_tuple(value: Any, kind: type, name: str) -> tuple:
    """``value`` (a sequence, or a comma-separated string as older configs and JSON files hold) as a tuple of
    ``kind``; a ``ValueError`` naming ``name`` otherwise. Lets config classes accept both spellings."""
    if isinstance(value, str):
        parts = [part.strip() for part in value.split(",") if part.strip()]
    elif isinstance(value, (list, tuple)):
        parts = list(value)
    else:
        raise ValueError(f"{name} must be a list of {kind.__name__} values, got {value!r}")
    try:
        items = tuple(kind(part) if isinstance(part, str) else part for part in parts)
    except ValueError:
        raise ValueError(f"{name} must be a list of {kind.__name__} values, got {value!r}") from None
    if kind is int and not all(isinstance(v, int) and not isinstance(v, bool) for v in items):
        raise ValueError(f"{name} must be a list of int values, got {value!r}")
    return items


def add_config_arguments(parser: argparse.ArgumentParser, config_class: type) -> None:
    """Add one option per field of the dataclass ``config_class`` to ``parser``."""
    hints = typing.get_type_hints(config_class)
    for field in dataclasses.fields(config_class):
        kind, optional, is_list = _parser_for(hints[field.name])
        flags = ["--" + field.name.replace("_", "-"), *field.metadata.get("aliases", ())]
        default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
        help_text = field.metadata.get("help", "")
        if "default" not in help_text.lower():  # a help text that explains its default keeps it alone
            help_text = f"{help_text} (default: {_show(default)})".strip()
        if kind is bool:
            parser.add_argument(*flags, action=argparse.BooleanOptionalAction, default=default, help=help_text,
                                dest=field.name)  # fmt: skip
            continue

        def convert(text: str, kind=kind, optional=optional, is_list=is_list):
            if optional and text.lower() == "none":
                return None
            if is_list:  # "1,2" as one token still means two elements
                try:
                    return [kind(part) for part in text.split(",") if part.strip()]
                except ValueError:
                    raise argparse.ArgumentTypeError(f"expected {kind.__name__} values, got {text!r}") from None
            return kind(text)

        convert.__name__ = kind.__name__  # argparse's "invalid int value: 'x'"
        extra: dict[str, Any] = {}
        if "const" in field.metadata:  # the flag alone means this value: "--cuda-graph" for "--cuda-graph on"
            extra.update(nargs="?", const=field.metadata["const"])
        if is_list:
            # A field that may be empty takes zero values ("--markov-heads" alone: none).
            extra["nargs"] = "*" if (optional or field.metadata.get("allow_empty")) else "+"
        parser.add_argument(*flags, type=convert, default=default, dest=field.name, help=help_text,
                            metavar=field.metadata.get("metavar", kind.__name__.upper()), **extra)  # fmt: skip


def _field_value(field: dataclasses.Field, value: Any) -> Any:
    """Flatten ``nargs`` lists of per-token lists (``--sizes 1,2 3`` -> ``(1, 2, 3)``); ``none`` -> None."""
    if not isinstance(value, list):
        return value
    if any(item is None for item in value):
        return None
    return tuple(element for item in value for element in (item if isinstance(item, list) else [item]))


def config_from_args(config_class: type[Config], args: argparse.Namespace) -> Config:
    """Build ``config_class`` from the parsed options added by :func:`add_config_arguments`.

    The config's own checks (``__post_init__``) judge the user's flags, so a ``TypeError`` they raise is
    reported like a ``ValueError``: as :class:`~icrl_models._cli.UsageError` (one line, exit status 2)."""
    from ._cli import UsageError

    values = {field.name: _field_value(field, getattr(args, field.name)) for field in dataclasses.fields(config_class)}
    try:
        return config_class(**values)
    except TypeError as error:
        raise UsageError(str(error)) from error


_ROLE = re.compile(r":(?:func|class|meth|mod|data|attr|obj|exc):`~?([^`]+)`")


def plain_text(doc: str | None) -> str:
    """A reST docstring as plain text for ``--help``: ``x`` for ````x```` and :func:`x`, ``Examples:`` for
    ``Examples::``, dotted paths cut to their last name (``~a.b.C`` and ``a.b.C`` -> ``C``)."""
    if not doc:
        return ""
    text = _ROLE.sub(lambda match: match.group(1).rsplit(".", 1)[-1], doc)
    text = re.sub(r"``([^`]+)``", r"\1", text)
    text = re.sub(r"(?<=\S)::$", ":", text, flags=re.MULTILINE)
    return text.strip() + "\n"


def make_parser(prog: str, doc: str | None, **kwargs: Any) -> argparse.ArgumentParser:
    """An ``ArgumentParser`` for the command ``prog`` whose description is the module docstring ``doc``
    as plain text (:func:`plain_text`), with its paragraphs and lists kept as written."""
    kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
    return argparse.ArgumentParser(prog=prog, description=plain_text(doc), **kwargs)


@contextlib.contextmanager
def torch_threads(num_threads: int | None) -> Iterator[None]:
    """Run the body with ``num_threads`` torch CPU threads (0 or None: the automatic choice of
    :func:`icrl_models.runtime.resolve_threads`), then restore the previous count."""
    from .runtime import torch_threads as _torch_threads

    with _torch_threads(num_threads):
        yield
