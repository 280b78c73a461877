"""Retry policy of the stage tasks: retry transient faults (storage, engine start), never bad input."""

from __future__ import annotations

import errno

from captionflow.errors import CaptionflowError

# Faults that a retry cannot fix: bad parameters, bad data, broken invariants, captionflow's own errors
# (a bad dataset or model, rows that failed every pass, a stage that stalled).
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
# Storage errors that stay until someone acts: a full disk or quota, a read-only or refusing store.
PERMANENT_ERRNO = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOENT}


def is_permanent(e: BaseException) -> bool:
    if getattr(e, "transient", False):  # captionflow's own error that names a fault worth another try
        return False
    if isinstance(e, PERMANENT):
        return True
    return isinstance(e, OSError) and e.errno in PERMANENT_ERRNO


def retry_transient(task, task_run, state) -> bool:
    """Prefect ``retry_condition_fn``: True (retry) unless the failure is a permanent one."""
    try:
        state.result()
    except BaseException as e:
        return not is_permanent(e)
    return True
