"""Loader of the ``kvdex_passkey`` test task: the passkey prompts in passkey.jsonl, next to this file."""

import json
from pathlib import Path

import datasets


def load(**_metadata):
    """lm-eval calls a task's ``custom_dataset`` with the run's metadata (the model args); unused."""
    path = Path(__file__).with_name("passkey.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
