"""Selection policies, one file each. Importing this package registers the built-in ones."""

from kvdex.policies import (  # noqa: F401  (importing a policy module registers it)
    arkvale,
    chess,
    full,
    h2o,
    icecache,
    oracle,
    pariskv,
    pariskv_kmeans,
    prkv,
    quest,
    snapkv,
    streaming,
)
from kvdex.policies.base import (
    PageScoringPolicy,
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
from kvdex.view import LayerView

__all__ = [
    "LayerView",
    "PageScoringPolicy",
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
