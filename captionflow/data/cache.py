"""The local cache (built-in model, demo set, downloaded checkpoints): build once, atomically."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def default_cache_dir() -> Path:
    """``$CAPTIONFLOW_CACHE``, else ``$XDG_CACHE_HOME/captionflow``, else ``~/.cache/captionflow``."""
    base = os.environ.get("CAPTIONFLOW_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "captionflow"
    )
    return Path(base)


def build_once(final: Path, marker: str, build: Callable[[Path], object]) -> Path:
    """Return ``final``, first building it with ``build(tmp)`` into a temporary sibling and renaming.

    ``final/marker`` existing means the folder is complete. Concurrent builders are safe: the
    loser of the rename race discards its copy and uses the winner's.
    """
    if (final / marker).exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=final.parent))
    try:
        build(tmp / "out")
        try:
            os.rename(tmp / "out", final)
        except OSError:
            if not (final / marker).exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
