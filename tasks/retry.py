"""Retry policy of the stage tasks: retry transient faults (storage, engine start), never bad input."""

from __future__ import annotations

from captionflow.errors import CaptionflowError

# Faults that a retry cannot fix: bad parameters, bad data, broken invariants, captionflow's own errors
# (a bad dataset or model, rows that failed every pass).
PERMANENT = (
    ValueError,
    TypeError,
    KeyError,
    AssertionError,
    FileNotFoundError,
    NotADirectoryError,
    PermissionError,
    CaptionflowError,
)


def retry_transient(task, task_run, state) -> bool:
    """Prefect ``retry_condition_fn``: True (retry) unless the failure is a permanent one."""
    try:
        state.result()
    except BaseException as e:
        return not isinstance(e, PERMANENT)
    return True
