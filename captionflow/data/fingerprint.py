"""Content fingerprints: they name the dataset, model and generation folders and key the caches."""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
from pathlib import Path
from typing import Any

SMALL_FILE = 16 * 2**20  # files up to this size are hashed whole
EDGE = 2**20  # of larger files (weights), the size plus the first and last MiB


def digest(obj: Any, length: int = 16) -> str:
    """Short sha256 of a JSON-able object, stable across runs and machines."""
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:length]


def file_digests(folder: str | os.PathLike, patterns: tuple[str, ...]) -> dict[str, str]:
    """sha256 of each file directly in ``folder`` whose name matches one of ``patterns`` (fnmatch), by name."""
    root = Path(folder)
    if not root.is_dir():
        return {}
    return {
        f.name: hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(root.iterdir())
        if f.is_file() and any(fnmatch.fnmatch(f.name, p) for p in patterns)
    }


def model_fingerprint(model_dir: str | os.PathLike) -> str:
    """Fingerprint of a local checkpoint folder.

    Small files (config, tokenizer, processor) are hashed whole; weight files by name, size and
    their first and last MiB, so a multi-GB checkpoint is fingerprinted in milliseconds while a
    retrained checkpoint (new bytes at both ends of every shard) still changes it.
    """
    root = Path(model_dir)
    h = hashlib.sha256()
    for f in sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith(".")):
        size = f.stat().st_size
        h.update(f"{f.relative_to(root)}\0{size}\0".encode())
        with open(f, "rb") as fh:
            if size <= SMALL_FILE:
                h.update(fh.read())
            else:
                h.update(fh.read(EDGE))
                fh.seek(size - EDGE)
                h.update(fh.read(EDGE))
    return h.hexdigest()[:16]


def generation_fingerprint(cfg, engine) -> str:
    """Everything besides dataset and checkpoint that can change a caption: the prompts and sampling
    (``RunConfig.generation_params``) and what of the engine settings is not only about speed
    (``EngineSettings.output_params``: device, pixel budget, context length, dtype, ...)."""
    return digest({**cfg.generation_params(), "engine": engine.output_params()})
