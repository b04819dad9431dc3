"""Selection policies: a module or a package each (``chess/``, ``prkv/``: components), and the policy
author's toolbox (:mod:`~kvdex.policies.rerank`, :mod:`~kvdex.policies.reuse`, :mod:`~kvdex.policies.digest`,
:mod:`~kvdex.policies.observation`, :mod:`~kvdex.policies.spec`; docs/adding-a-policy.md). Importing this
package registers the built-in policies."""

from kvdex.kernels.scoring import group_reduce, mask_pages, topk_ids
from kvdex.policies import (  # noqa: F401  (the author's toolbox)  # noqa: F401  (importing a policy module registers it)
    arkvale,
    chess,
    digest,
    full,
    h2o,
    icecache,
    observation,
    oracle,
    pariskv,
    prkv,
    quest,
    rerank,
    reuse,
    snapkv,
    spec,
    streaming,
)
from kvdex.policies.base import Policy, PolicyInfo
from kvdex.policies.page_scoring import PageScoringPolicy
from kvdex.policies.registry import make_policy, policies, policy_class, register_policy
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
