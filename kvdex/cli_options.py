"""Command-line options of a kvdex cache, made from :class:`kvdex.config.CacheConfig`'s fields.

Every kvdex command that builds caches (``kvdex generate``, ``demo``, ``eval``, ``bench``,
``scorecard``) takes its cache options from :func:`add_cache_options`, so each option's name
(``--page-size`` for ``page_size``), type, default and help exist once, on the dataclass field. A
command leaves out the fields it sets another way, each with its reason (``exclude``), and reads
the options back with :func:`cache_config_from_args`.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping

from kvdex.config import CacheConfig

# the Namespace attribute listing the fields add_cache_options added (read by cache_config_from_args)
_ADDED = "cache_options"


def cache_fields() -> tuple[dataclasses.Field, ...]:
    return dataclasses.fields(CacheConfig)


def option_name(name: str) -> str:
    """``"page_size"`` -> ``"--page-size"``."""
    return "--" + name.replace("_", "-")


def add_cache_options(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    exclude: Mapping[str, str] | None = None,
    defaults: Mapping[str, object] | None = None,
) -> None:
    """Add one option per :class:`CacheConfig` field to ``parser`` (a parser or an argument group).

    ``exclude``: ``{field: why the command has no option for it}`` (e.g. a list flag ``--budgets``
    instead of ``--budget``); ``defaults``: a command's own defaults for some fields. Integer fields
    take ``type=int``, boolean ones are flags (``store_true``); the help text is the field's.
    """
    exclude, defaults = dict(exclude or {}), dict(defaults or {})
    names = {f.name for f in cache_fields()}
    for name, why in exclude.items():
        if name not in names:
            raise ValueError(f"exclude: {name!r} is not a CacheConfig field ({', '.join(sorted(names))})")
        if not isinstance(why, str) or not why.strip():
            raise ValueError(f"exclude: say why the command has no {option_name(name)} option")
    unknown = set(defaults) - names
    if unknown:
        raise ValueError(f"defaults: {', '.join(sorted(unknown))} are not CacheConfig fields")
    added = []
    for f in cache_fields():
        if f.name in exclude:
            continue
        default = defaults.get(f.name, f.default)
        helptext = f.metadata["help"]
        if f.type in (bool, "bool"):
            parser.add_argument(option_name(f.name), action="store_true", default=default, help=helptext)
        else:
            parser.add_argument(
                option_name(f.name), type=int, default=default, metavar="N", help=helptext + " (default %(default)s)"
            )
        added.append(f.name)
    parser.set_defaults(**{_ADDED: tuple(added)})


def cache_config_from_args(args: argparse.Namespace, **given) -> CacheConfig:
    """The :class:`CacheConfig` of parsed ``args``: the fields :func:`add_cache_options` added, then
    ``given`` (a command's own value of a field, e.g. one of its ``--budgets``); the rest default."""
    added = getattr(args, _ADDED, None)
    if added is None:
        raise ValueError("these arguments come from a parser without add_cache_options(parser)")
    values = {name: getattr(args, name) for name in added}
    return CacheConfig(**{**values, **given})
