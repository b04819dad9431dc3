"""Evaluation of kvdex policies: tasks (``passkey``) and the harness that runs them."""


def scorecard(*args, **kwargs):
    """Every policy's accuracy and speed side by side (``kvdex scorecard``); see
    :func:`kvdex.eval.card.run.scorecard` for the arguments."""
    from kvdex.eval.card.run import scorecard as run

    return run(*args, **kwargs)
