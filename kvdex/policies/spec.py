"""Policy spec strings (``"name:KEY=VALUE:..."``) and the typing of their option values: the text side of
:func:`kvdex.policies.registry.make_policy`."""

from __future__ import annotations

import ast
import dataclasses
import re


def parse_policy_spec(spec: str) -> tuple[str, dict]:
    """``"chess:preset=aggressive:interval=192"`` -> ``("chess", {"preset": "aggressive", "interval": 192})``.

    A policy name optionally followed by ``:KEY=VALUE`` options (values are Python literals where
    they parse, else strings), so one string names a configured policy everywhere a name is taken
    (``kvdex.Cache``, ``kvdex eval --policies``, ``cache.fork``).
    """
    name, *items = spec.split(":")
    bad = lambda item: f"policy option {item!r} in {spec!r} is not KEY=VALUE (e.g. 'chess:preset=moderate')"  # noqa: E731
    return name, parse_options(items, bad)


def parse_options(items, bad) -> dict:
    """``["KEY=VALUE", ...]`` -> ``{KEY: VALUE}``, values Python literals where they parse, else strings;
    an item that is not ``KEY=VALUE`` raises ``ValueError(bad(item))``."""
    options = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(bad(item))
        try:
            options[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            options[key] = value
    return options


_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


def coerce_option(policy: str, field: dataclasses.Field, value):
    """``value`` for option ``field`` of ``policy``, typed by the field's annotation.

    Text from a command line or a spec string is converted (``"no"`` / ``"false"`` / ``"0"`` for a
    ``bool``, ``"12"`` for an ``int``, ``"none"`` where ``None`` is allowed); a value that does not fit
    the annotation raises ``ValueError`` naming the option, what it takes and what was given, so an
    option never silently means the opposite of what it says.
    """
    annotation = re.sub(r"Literal\[[^\]]*\]", "str", str(field.type))  # choices of text: checked by the policy
    kinds = [t.strip() for t in annotation.replace("Optional[", "").rstrip("]").split("|")]
    known = {"bool", "int", "float", "str", "None"}
    if not kinds or not set(kinds) <= known:
        return value  # an annotation this check does not model: the policy validates it
    if value is None and "None" in kinds:
        return None
    if isinstance(value, str):
        text = value.strip().lower()
        if "None" in kinds and text in ("none", "null"):
            return None
        if "bool" in kinds and text in _TRUE + _FALSE:
            return text in _TRUE
        if "int" in kinds:
            try:
                return int(text)
            except ValueError:
                pass
        if "float" in kinds:
            try:
                return float(text)
            except ValueError:
                pass
        if "str" in kinds:
            return value
    elif isinstance(value, bool):
        if "bool" in kinds:
            return value
    elif isinstance(value, int):
        if "int" in kinds:
            return value
        if "float" in kinds:
            return float(value)
        if "bool" in kinds and value in (0, 1):
            return bool(value)
    elif isinstance(value, float):
        if "float" in kinds:
            return value
        if "int" in kinds and value.is_integer():
            return int(value)
    takes = " or ".join("true/false (yes/no, 1/0)" if k == "bool" else k for k in kinds)
    raise ValueError(f"policy {policy!r} option {field.name}={value!r}: expected {takes}")
