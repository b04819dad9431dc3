"""Selection policies, one file each. Importing this package registers the built-in ones."""

from kvdex.policies import full, oracle, quest, streaming  # noqa: F401  (registration)
from kvdex.policies import arkvale, h2o, prkv, snapkv  # noqa: F401  (registration)
from kvdex.policies import chess  # noqa: F401  (registration)
from kvdex.policies import icecache  # noqa: F401  (registration)
from kvdex.policies import pariskv  # noqa: F401  (registration)
from kvdex.policies.base import (
    Policy,
    PolicyInfo,
    group_reduce,
    make_policy,
    mask_pages,
    policies,
    policy_class,
    register_policy,
    topk_ids,
)

__all__ = [
    "Policy",
    "PolicyInfo",
    "group_reduce",
    "make_policy",
    "mask_pages",
    "policies",
    "policy_class",
    "register_policy",
    "topk_ids",
]
