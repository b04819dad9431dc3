"""``kvdex soak`` (``python -m kvdex.bench.soak``): does memory stay flat over thousands of decode steps?

Per row (``POLICY[:OPTIONS]/device`` or ``/offload``) a fresh cache prefills a context and decodes many greedy
steps while device memory, host RSS, live tensors and gc-tracked objects are sampled; each series' growth per
step, less what the growing context is expected to add, must stay within a tolerance. ``kvdex soak --help``
(the docstring of :mod:`kvdex.bench.soak.cli`) describes the method in full.

The package, one concept a module:

* ``config``: :class:`SoakConfig` (what to measure) and the rows (:func:`split_row`, :data:`POLICIES`);
* ``sampling``: one sample of every memory series (:func:`sample`);
* ``verdict``: the fits, the growth a decode is expected to add, flat or not (:func:`fit`, :func:`judge`);
* ``runner``: the decode loop of one row (:func:`run_row`) and of every row (:func:`run`);
* ``report``: the per-row line and the closing table (:func:`table`);
* ``cli``: the arguments, the JSON file and the exit status (:func:`register` for ``kvdex``, :func:`main`).
"""

from kvdex.bench.soak.cli import DESCRIPTION, EPILOG, build_parser, cmd, config_from_args, main, register
from kvdex.bench.soak.config import DEFAULT_ROWS, POLICIES, SoakConfig, split_row
from kvdex.bench.soak.report import row_line, table
from kvdex.bench.soak.runner import reserve_all, run, run_row
from kvdex.bench.soak.sampling import live_tensors, rss_bytes, sample
from kvdex.bench.soak.verdict import expected_per_step, fit, judge, kv_bytes_per_token

__all__ = [
    "DEFAULT_ROWS",
    "DESCRIPTION",
    "EPILOG",
    "POLICIES",
    "SoakConfig",
    "build_parser",
    "cmd",
    "config_from_args",
    "expected_per_step",
    "fit",
    "judge",
    "kv_bytes_per_token",
    "live_tensors",
    "main",
    "register",
    "reserve_all",
    "row_line",
    "rss_bytes",
    "run",
    "run_row",
    "sample",
    "split_row",
    "table",
]
