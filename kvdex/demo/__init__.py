"""``kvdex demo``: passkey retrieval, one prefill, kvdex's policies at a small budget.

The defaults depend on the device: on a CPU a 1000-token prompt, 6 new tokens and seven policies
(:data:`CPU_POLICIES`: ``full``, ``streaming`` and the sparse ones), about a minute on two cores; on a CUDA
device a 6000-token prompt, 16 new tokens and also ``oracle`` (:data:`CUDA_POLICIES`).
``--length``, ``--max-new-tokens`` and ``--policies`` override them.

What it does, in order:

1. loads the model (default: SmolLM2-135M-Instruct, installed by ``kvdex models fetch smollm2``,
   see :mod:`kvdex.models`) and builds one passkey prompt (:mod:`kvdex.eval.passkey`);
2. prefills the prompt ONCE into a ``full`` kvdex cache and takes the first answer token from the
   prefill's logits;
3. for every policy, forks the prefilled cache (``cache.fork(policy=..., budget=...)``) and decodes
   greedily from there with ``model.generate``, with a progress bar per policy (on stderr);
4. prints the settings and one row per policy: whether the key was retrieved, tokens attended per
   decode step per kv head (and their share of the context), the bytes of the keys and values held on
   the device and on the host, and the row's wall time (its fork and decode); then a legend: what each
   column means and why each row that misses the key misses (by design, or what the run measured:
   :func:`kvdex.demo.report.explain_miss`).
   On a CUDA device it also decodes the prompt with transformers' own dense cache and shows each
   policy's decode speed next to it (ms/token and the speed-up) and the peak device memory of its
   decode. On a CPU it shows no timings: kvdex's speed comes from its CUDA kernels and graphs, and
   CPU timings say nothing about it (``kvdex bench`` measures speed on a GPU).

ms/token (CUDA only) is decode only: a stopping criterion stamps the time after every generated
token and the table shows the median gap between consecutive stamps (one decode forward plus
generate's own per-token work); prefill and generate's start-up are outside every gap.
``--threads`` sets torch's CPU threads (on a busy shared CPU, 1 avoids waits for descheduled threads).

``--no-fork`` prefills anew for every policy (a fresh ``kvdex.Cache`` passed to ``generate``),
which checks that forking changes nothing; it is slower by one prefill per policy.

The package, one concept a module: ``decode`` (the prefill, the forks and the decoding of every policy:
:func:`run`, :class:`Row`), ``report`` (the table and its legend), ``cli`` (the arguments, their
device-dependent defaults and :func:`main`, the run from loading the model to the last line).
"""

from kvdex.demo.cli import (
    CPU_LENGTH,
    CPU_NEW_TOKENS,
    CPU_POLICIES,
    CUDA_LENGTH,
    CUDA_NEW_TOKENS,
    CUDA_POLICIES,
    DEFAULT_BUDGET,
    DEFAULT_LENGTH,
    DEFAULT_POLICIES,
    add_arguments,
    main,
)
from kvdex.demo.decode import Row, decode_forked, decode_fresh, dense_baseline, prefill, run
from kvdex.demo.report import BY_DESIGN, format_legend, format_table, kv_bytes

__all__ = [
    "BY_DESIGN",
    "CPU_LENGTH",
    "CPU_NEW_TOKENS",
    "CPU_POLICIES",
    "CUDA_LENGTH",
    "CUDA_NEW_TOKENS",
    "CUDA_POLICIES",
    "DEFAULT_BUDGET",
    "DEFAULT_LENGTH",
    "DEFAULT_POLICIES",
    "Row",
    "add_arguments",
    "decode_forked",
    "decode_fresh",
    "dense_baseline",
    "format_legend",
    "format_table",
    "kv_bytes",
    "main",
    "prefill",
    "run",
]
