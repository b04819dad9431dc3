"""``kvdex demo``'s table and legend (:mod:`kvdex.demo.report`), formatting only: rows are built here, no model
runs. Every row that misses the key gets a legend line saying why -- by design
(:data:`~kvdex.demo.report.BY_DESIGN`) or, for any other miss, what the run measured."""

from __future__ import annotations

from kvdex.demo.decode import Row
from kvdex.demo.report import BY_DESIGN, KNOWN_LIMITS, explain_miss, format_legend, format_table

NOT_BY_DESIGN = "missed the key, not by design"


def _row(policy: str, correct: bool, attended: float) -> Row:
    stats = {"attended_tokens_per_step": attended, "kv_bytes_device": 2**20, "kv_bytes_host": 0}
    return Row(policy, "60494." if correct else "6721.", correct, stats, None)


def _legend(rows: list[Row], depth: float = 0.5) -> str:
    return format_legend(rows, "60494", depth, 128, False, 6, context=997)


def _line(legend: str, policy: str) -> str:
    section = legend[legend.index(NOT_BY_DESIGN) :]
    return next(line for line in section.splitlines() if line.split()[0] == policy)


def test_a_miss_not_by_design_is_explained_with_what_the_run_measured():
    """The demo's CPU default: quest misses at budget 128 while the other sparse policies, attending as many
    tokens, answer. The legend says so, with quest's measured share of the context and its known limit."""
    rows = [_row("full", True, 1000.0), _row("streaming", False, 128.0), _row("quest", False, 120.0)]
    rows += [_row(p, True, 120.0) for p in ("icecache", "pariskv", "chess", "prkv")]
    legend = _legend(rows)
    assert f"{NOT_BY_DESIGN} (budget 128):" in legend
    quest = _line(legend, "quest")
    assert "attends 120 of the 997 tokens per step per kv head (12%)" in quest
    assert "icecache, pariskv, chess, prkv answer attending as many" in quest and "full" not in quest
    assert KNOWN_LIMITS["quest"] in quest
    # streaming's miss is by design (the needle is in the middle): explained there, not twice
    assert "streaming" in BY_DESIGN and "streaming" not in legend[legend.index(NOT_BY_DESIGN) :]


def test_every_row_that_misses_has_a_line():
    """Whatever misses -- a policy without a known limit, one whose miss is by design only in the middle,
    ``full`` itself -- the legend names it with a reason: no unexplained NO."""
    rows = [_row("full", True, 1000.0), _row("oracle", True, 120.0), _row("chess:rebuild=2", False, 120.0)]
    chess = _line(_legend(rows), "chess:rebuild=2")
    assert "oracle (the exact top-k) answers attending as many" in chess and "chess:rebuild=2's choice" in chess

    rows = [_row("full", True, 1000.0), _row("oracle", False, 120.0), _row("prkv", False, 120.0)]
    legend = _legend(rows)
    assert all("this prompt needs a larger --budget" in _line(legend, p) for p in ("oracle", "prkv"))

    rows = [_row("full", False, 1000.0), _row("quest", False, 120.0), _row("streaming", False, 128.0)]
    legend = _legend(rows, depth=0.98)  # not in the middle: streaming's miss is not by design here
    assert "expected to miss" not in legend
    assert "the model does not answer this prompt" in _line(legend, "full")
    assert all(
        "full (dense attention over the whole context) misses too" in _line(legend, p) for p in ("quest", "streaming")
    )


def test_no_miss_no_explanation():
    rows = [_row("full", True, 1000.0), _row("quest", True, 120.0)]
    assert NOT_BY_DESIGN not in _legend(rows) and "expected to miss" not in _legend(rows)
    assert explain_miss(_row("quest", False, 120.0), rows).startswith("attends 120 tokens per step per kv head;")


def test_demo_table_on_cuda_shows_speed_against_dense():
    """The CUDA table (formatting only; the GPU run is in the GPU tests): ms/token, the speed-up over
    transformers' dense cache and peak device memory per row, the dense baseline first."""
    stats = {"attended_tokens_per_step": 64.0, "kv_bytes_device": 2**20, "kv_bytes_host": 0}
    quest = Row("quest", "12345", True, stats, 2.5, [], 3 * 2**20)
    dense = Row("transformers (dense)", "12345", True, {**stats, "kv_bytes_device": None}, 10.0, [], 5 * 2**20)
    lines = format_table([quest], context=6400, baseline=dense).splitlines()
    assert "ms/token" in lines[0] and "vs dense" in lines[0] and "peak device mem" in lines[0]
    assert lines[2].startswith("transformers (dense)") and "1.00x" in lines[2]
    row = lines[3].split()
    assert row[0] == "quest" and "2.5" in row and "4.00x" in row and "(1%)" in row and "3.00" in row
    assert "ms/token" not in format_table([quest], context=6400)
