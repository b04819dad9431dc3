"""The example policy of ``docs/adding-a-policy.md`` runs, as written, through the contract every
registered policy keeps (``tests/test_contract.py``), registered only for the duration of the test."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import test_contract as C

from kvdex.policies import registry

DOC = Path(__file__).resolve().parents[1] / "docs" / "adding-a-policy.md"


@pytest.fixture
def pagemean(monkeypatch):
    """Register the doc's example in a copy of the registry (the built-in registry is left as it was)."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    block = re.search(r"```python\n(.*?)```", DOC.read_text(), re.S).group(1)
    namespace: dict = {"__name__": "kvdex_doc_example"}
    exec(compile(block, str(DOC), "exec"), namespace)  # noqa: S102  (the documentation's own code)
    assert "pagemean" in registry.policies()
    yield "pagemean"


def test_example_is_short():
    block = re.search(r"```python\n(.*?)```", DOC.read_text(), re.S).group(1)
    assert len(block.strip().splitlines()) < 40


@pytest.mark.parametrize("batch", list(C.BATCHES))
@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
def test_example_full_budget_equals_dense(pagemean, offload, batch):
    C.test_full_budget_equals_dense(pagemean, offload, batch)


def test_example_offload_fork_and_budget(pagemean):
    C.test_offload_equals_device_at_full_budget(pagemean, "ragged3")
    C.test_fork_independence_and_offload_at_small_budget(pagemean)
