"""The policy registry: :func:`register_policy` (a class decorator), the registered names and classes, and
:func:`make_policy` (a policy from a name or spec ``"name:KEY=VALUE:..."``, or a copy of an instance)."""

from __future__ import annotations

import dataclasses
from typing import Any

from kvdex.policies.base import Policy, option_choices
from kvdex.policies.spec import coerce_option, parse_policy_spec

_REGISTRY: dict[str, type[Policy]] = {}


def register_policy(cls: type[Policy]) -> type[Policy]:
    if not cls.name:
        raise ValueError(f"{cls.__name__} needs a class attribute `name`")
    option_choices(cls)  # read the option types once, at registration (not when a cache makes the policy)
    _REGISTRY[cls.name] = cls
    return cls


def policies() -> list[str]:
    """Names of the registered policies."""
    return sorted(_REGISTRY)


def policy_classes() -> dict[str, type[Policy]]:
    """The registered policy classes by name (a copy: registering goes through :func:`register_policy`)."""
    return dict(_REGISTRY)


def policy_class(name: str) -> type[Policy]:
    if name not in _REGISTRY:
        raise ValueError(f"unknown policy {name!r}; valid policies: {', '.join(policies())}")
    return _REGISTRY[name]


def make_policy(name: str | Policy, **options: Any) -> Policy:
    """A fresh policy instance from a name (or a copy of an instance) and its options.

    ``name`` may carry options, ``"name:KEY=VALUE:..."`` (:func:`parse_policy_spec`); keyword
    options override them.
    """
    if isinstance(name, str) and ":" in name:
        name, spec_options = parse_policy_spec(name)
        options = {**spec_options, **options}
    if isinstance(name, Policy):
        fields = {f.name: f for f in dataclasses.fields(name)}
        typed = {k: coerce_option(name.name, fields[k], v) if k in fields else v for k, v in options.items()}
        return dataclasses.replace(name, **typed)
    cls = policy_class(name)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(options) - set(fields))
    if unknown:
        raise TypeError(
            f"policy {name!r} has no option(s) {', '.join(unknown)}; "
            f"its options are: {', '.join(sorted(fields)) or '(none)'}"
        )
    return cls(**{k: coerce_option(name, fields[k], v) for k, v in options.items()})
