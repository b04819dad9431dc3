"""Tensor parallelism: which kv heads this process holds, and the collectives kvdex needs.

Under transformers' tensor parallelism (``from_pretrained(..., distributed_config=
DistributedConfig(tp_plan="auto"))`` under ``torchrun``) the k/v projections are sharded by output
rows (``Shard(0)`` DTensors): rank ``r`` of ``n`` computes kv heads ``r * H/n ... (r+1) * H/n - 1``
and the keys its cache receives have ``H/n`` heads. kvdex reads that layout from the weight itself
(:func:`tensor_parallel`, the one place that finds it), so that

* per-head state (IceCache's tree seeds, ParisKV-kmeans' centroid init) is keyed by the global
  head index ``head_offset + h``: every rank builds what one process builds for those heads;
* a policy that makes one selection across heads (CHESS) sums its partial scores over the group
  (:meth:`TensorParallel.all_reduce`) before selecting, so every rank selects the same pages;
* ``Cache.stats()`` sums its counters over the group (a collective: call it on every rank).

Without tensor parallelism :data:`SINGLE` is used and every collective is a no-op.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvdex.hf.model_parts import attention_modules, head_geometry


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in the tensor-parallel group (``size == 1``: no tensor parallelism)."""

    rank: int = 0
    size: int = 1
    group: object = None  # torch.distributed ProcessGroup of the tensor-parallel ranks

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the tensor-parallel ranks, in place; returns ``x``. No-op for one rank."""
        if self.size > 1:
            torch.distributed.all_reduce(x, op=torch.distributed.ReduceOp.SUM, group=self.group)
        return x

    def sum_values(self, *values: float) -> list[float]:
        """The sums of ``values`` over the ranks (one collective; every rank must call it)."""
        if self.size == 1:
            return list(values)
        nccl = torch.distributed.get_backend(self.group) == "nccl"
        dev = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        x = torch.tensor([float(v) for v in values], dtype=torch.float64, device=dev)
        return self.all_reduce(x).tolist()


SINGLE = TensorParallel()


def _sharded_rows(weight) -> tuple[object, int] | None:
    """(DeviceMesh, mesh dim) over which ``weight``'s rows are sharded, or None (not a row-sharded DTensor)."""
    try:
        from torch.distributed.tensor import DTensor, Shard
    except ImportError:  # pragma: no cover - torch without distributed
        return None
    if not isinstance(weight, DTensor):
        return None
    for dim, p in enumerate(weight.placements):
        if isinstance(p, Shard) and p.dim == 0:
            return weight.device_mesh, dim
    return None


def tensor_parallel(model) -> TensorParallel:
    """The tensor-parallel layout of ``model``'s attention (``SINGLE`` when its k projection is not sharded).

    Raises ``ValueError`` when the model's query or kv heads do not divide over the ranks: the
    shard of a rank would hold part of a head, which neither the model nor kvdex can attend with.
    """
    mods = attention_modules(model)
    if not mods:
        return SINGLE
    proj = getattr(mods[min(mods)], "k_proj", None)
    found = _sharded_rows(getattr(proj, "weight", None))
    if found is None:
        return SINGLE
    mesh, dim = found
    size = mesh.size(dim)
    if size == 1:
        return SINGLE
    q_heads, kv_heads, _ = head_geometry(model)
    if kv_heads % size or q_heads % size:
        raise ValueError(
            f"{type(model).__name__} has {kv_heads} kv heads and {q_heads} query heads, which do not divide "
            f"over the {size} tensor-parallel ranks (each rank must hold whole heads). Run with a number of "
            f"ranks that divides {kv_heads} (e.g. torchrun --nproc-per-node {_divisor(kv_heads, q_heads, size)}), "
            "or split the model by layers with device_map instead of tp_plan"
        )
    return TensorParallel(rank=mesh.get_local_rank(dim), size=size, group=mesh.get_group(dim))


def _divisor(kv_heads: int, q_heads: int, size: int) -> int:
    """The largest rank count <= size that divides both head counts."""
    return max(n for n in range(1, size + 1) if kv_heads % n == 0 and q_heads % n == 0)
