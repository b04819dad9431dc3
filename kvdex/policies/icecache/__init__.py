"""``icecache``: IceCache (Mao et al., 2025), a package of components (:mod:`kvdex.policies.icecache.policy` says
which owns what). Importing it registers the policy."""

from kvdex.policies.icecache.policy import IceCachePolicy

__all__ = ["IceCachePolicy"]
