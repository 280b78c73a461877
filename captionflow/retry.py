"""Retry policy for the Prefect tasks: retry transient faults, never bad input."""

from __future__ import annotations

# Faults that a retry cannot fix: bad parameters, bad data, broken invariants.
PERMANENT = (ValueError, TypeError, KeyError, AssertionError, FileNotFoundError, NotADirectoryError,
             PermissionError)


def _is_permanent(exc: BaseException) -> bool:
    from tasks.inference import RowsFailed  # rows were already retried pass by pass

    return isinstance(exc, PERMANENT + (RowsFailed,))


def retry_transient(task, task_run, state) -> bool:
    """Prefect ``retry_condition_fn``: True (retry) unless the failure is a permanent one."""
    try:
        state.result()
    except BaseException as e:
        return not _is_permanent(e)
    return True
