"""Evaluation of kvdex policies: tasks (``passkey``) and the harness that runs them."""
