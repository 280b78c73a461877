"""The errors captionflow raises on purpose: each says what is wrong and where, and none is worth a retry."""

from __future__ import annotations


class CaptionflowError(Exception):
    """Base of captionflow's own errors."""


class DatasetError(CaptionflowError, ValueError):
    """The dataset parameter names nothing usable (missing, unreadable, no image column, 0 rows...)."""


class ModelError(CaptionflowError, ValueError):
    """The model parameter does not name a usable vision-language checkpoint."""


class RowsFailed(CaptionflowError, RuntimeError):
    """Rows still failed after every retry pass. ``result`` is the stage's result, failures counted."""

    def __init__(self, message: str, result):
        super().__init__(message)
        self.result = result


class EngineFailed(CaptionflowError, RuntimeError):
    """The engine (or its Ray actor) failed while starting or running; the message carries the root cause.
    Worth one more try (a node, an accelerator, a port can fail for a while), so not a bad-input error."""

    transient = True


class BaselineError(CaptionflowError, ValueError):
    """``pairwise_against`` names nothing this run can be compared with."""


class ModelTooLarge(CaptionflowError, ValueError):
    """The checkpoint's weights, with an engine's KV cache and activations, do not fit the GPU: said before any
    engine starts, with what would fit it."""


class ClusterUnreachable(CaptionflowError, ConnectionError):
    """``ray_address`` (or ``RAY_ADDRESS``) names a Ray cluster that does not answer: a typo, or a head that is down.
    Not retried: Ray itself waited 13.7 min on such an address before failing, and Prefect then retried it."""


class StorageFull(CaptionflowError, OSError):
    """A write that found no space (ENOSPC, EDQUOT), naming the file it was writing: the OS's error names none.
    Still an OSError with its errno, so the retry policy knows it is permanent."""

    def __str__(self) -> str:
        return str(self.strerror)
