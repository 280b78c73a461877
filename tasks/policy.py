"""Policy of the stage tasks: which faults are worth a retry, and how long an attempt may take.

Retries: transient faults (storage, engine start), never bad input, never a timeout (another attempt with the
same limit would run out the same way; committed rows are kept, so a rerun resumes).

Timeouts (``TIMEOUT_S``, seconds per attempt, on each task's decorator): a backstop so that no attempt holds a
deployment's concurrency slot forever. The stages whose work grows with the dataset also have the stall watchdog
(``stall_timeout_s``: no result for that long fails at once), which is what catches a stuck engine in minutes;
their limits here are sized for millions of images.
"""

from __future__ import annotations

import errno

from prefect.task_engine import TaskRunTimeoutError

from captionflow.errors import CaptionflowError

HOUR = 3600
TIMEOUT_S = {
    "preflight": HOUR // 4,  # model and dataset checks, one tokenizer load
    "ingest": 6 * HOUR,  # listing (and checking) every object of the dataset
    "preprocess": 48 * HOUR,
    "inference": 72 * HOUR,
    "shared-pass": 72 * HOUR,  # the inference of several checkpoints at once (compare over LoRA adapters)
    "judge": 72 * HOUR,
    "pairwise": 72 * HOUR,
    "clip-score": 24 * HOUR,
    "evaluate": 6 * HOUR,
    "import-captions": 6 * HOUR,
    "publish": HOUR // 4,
}

# Faults that a retry cannot fix: bad parameters, bad data, broken invariants, captionflow's own errors
# (a bad dataset or model, rows that failed every pass, a stage that stalled), an attempt that timed out.
PERMANENT = (
    TaskRunTimeoutError,  # Prefect's timeout of the attempt; a storage call's TimeoutError stays transient
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
