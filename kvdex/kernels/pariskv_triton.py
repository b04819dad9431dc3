"""ParisKV's retrieval pipeline in Triton as one module, the one ``ParisKV.ops`` returns on CUDA: the names and
signatures of its twin module ``kvdex.kernels.pariskv`` (the PyTorch spec), each from the stage that runs it.

* the coarse stage (``kvdex.kernels.pariskv_coarse_triton``): ``cluster_votes``, ``collision_votes``,
  ``bucket_topk`` -- the centroids' votes, every key's score and the candidate pool;
* the rerank stage (``kvdex.kernels.pariskv_rerank_triton``): ``rerank_scores``, ``rerank_combined``,
  ``gather_rows`` -- the pool's 4-bit estimates, the heads' combination and the final rows.

triton is optional: this module imports without it and :func:`available` says whether the kernels can run.
"""

from __future__ import annotations

from kvdex.kernels.pariskv_coarse_triton import available, bucket_topk, cluster_votes, collision_votes
from kvdex.kernels.pariskv_rerank_triton import gather_rows, rerank_combined, rerank_scores

__all__ = [
    "available",
    "bucket_topk",
    "cluster_votes",
    "collision_votes",
    "gather_rows",
    "rerank_combined",
    "rerank_scores",
]
