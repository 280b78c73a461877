"""A checkpoint staged at a stable path, so that vLLM's compile cache finds the graphs of its architecture.

vLLM (0.26 on torch >= 2.10, its AOT compile) keys the compiled graphs on the model's *path*: every new
checkpoint folder compiles again (~35 s per engine on an H100). Engines started by this machine's Ray
therefore load a checkpoint through a slot: ``<compile cache>/staged/<architecture>/<compile key>/slot-N``,
a folder of links to the checkpoint's files. Same architecture and engine settings, same slot path, and the
second checkpoint starts from the cache. A run holds its slot's lease for as long as its engines may load
from it (an engine restarted mid-run reads the same checkpoint), so a concurrent run of another checkpoint
takes the next slot instead of re-pointing this one.

On a cluster the engines start on other nodes that cannot see this machine's links: there the checkpoint's
own path is used (``compile_cache_dir`` on a shared volume still keeps the non-AOT graphs).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path

from captionflow.data.lease import Lease, LeaseTimeout
from captionflow.data.storage import Store

log = logging.getLogger("captionflow.staging")

SLOTS = 4


def _link_farm(slot: Path, checkpoint: Path) -> None:
    """Point every entry of ``slot`` at the same-named entry of ``checkpoint`` (and nothing else)."""
    slot.mkdir(parents=True, exist_ok=True)
    wanted = {p.name: p.resolve() for p in checkpoint.iterdir() if not p.name.startswith(".")}
    for entry in slot.iterdir():
        if entry.name.startswith("."):
            continue
        if entry.is_symlink() and wanted.get(entry.name) == Path(os.readlink(entry)):
            wanted.pop(entry.name)
            continue
        entry.unlink() if entry.is_symlink() or entry.is_file() else None
    for name, target in wanted.items():
        (slot / name).symlink_to(target)


@contextlib.contextmanager
def staged(checkpoint: str, compile_dir: str, local: bool, wait_s: float = 600.0) -> Iterator[str]:
    """The path the engines load ``checkpoint`` from while the context is held (see the module docstring).
    ``compile_dir``: the compile cache folder of this architecture and engine settings; ``local``: the
    engines start on this machine."""
    path = Path(checkpoint)
    if not local or not path.is_dir() or not compile_dir:
        yield checkpoint
        return
    root = Path(compile_dir).parent / "staged" / Path(compile_dir).name
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        log.warning("cannot stage the checkpoint under %s (%s): engines load it from its own path", root, e)
        yield checkpoint
        return
    store = Store(str(root))
    for n in range(SLOTS):
        lease = Lease(
            store, f"slot-{n}", what=f"the staging slot {root}/slot-{n}", wait_s=0 if n < SLOTS - 1 else wait_s
        )
        try:
            lease.acquire()
        except LeaseTimeout:
            continue
        try:
            slot = root / f"slot-{n}"
            _link_farm(slot, path)
            log.info("checkpoint %s staged at %s (a stable path for vLLM's compile cache)", checkpoint, slot)
            yield str(slot)
        finally:
            lease.release()
        return
