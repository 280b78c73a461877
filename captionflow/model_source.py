"""Resolve and validate the ``model`` parameter before any expensive work starts."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from captionflow.builtin_model import BUILTIN_NAME, ensure_builtin_model
from captionflow.fingerprint import model_fingerprint


class ModelError(ValueError):
    """The model parameter does not name a usable vision-language checkpoint."""


@dataclass(frozen=True)
class ResolvedModel:
    source: str  # what the user passed
    path: str  # local folder vLLM loads
    fingerprint: str
    architecture: str


def resolve_model(model: str, cache_dir: str | None = None) -> ResolvedModel:
    """'builtin' or a local checkpoint folder -> a validated local folder and its fingerprint.

    Raises ModelError naming the problem and the path: missing folder, no config.json, a config
    that is not JSON, or a model without a vision tower (captionflow needs a VLM).
    """
    if model == BUILTIN_NAME:
        path = ensure_builtin_model(cache_dir)
    else:
        if "://" in model:
            raise ModelError(
                f"model {model!r}: only 'builtin' and local checkpoint folders are supported so far")
        path = Path(os.path.expanduser(model)).resolve()
        if not path.exists():
            raise ModelError(f"model path {str(path)!r} does not exist")
        if not path.is_dir():
            raise ModelError(f"model path {str(path)!r} is a file; pass the checkpoint folder")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ModelError(f"model {str(path)!r} has no config.json: not a Hugging Face checkpoint folder")
    try:
        cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelError(f"model {str(path)!r}: config.json is unreadable ({e})") from None
    archs = cfg.get("architectures") or []
    if "vision_config" not in cfg:
        raise ModelError(
            f"model {str(path)!r} ({', '.join(archs) or cfg.get('model_type', '?')}) has no vision_config: "
            "captionflow needs a vision-language model")
    weights = [p for p in path.iterdir() if p.suffix in (".safetensors", ".bin", ".pt")]
    if not weights:
        raise ModelError(f"model {str(path)!r} has no weight files (*.safetensors / *.bin)")
    return ResolvedModel(
        source=model, path=str(path), fingerprint=model_fingerprint(path),
        architecture=archs[0] if archs else str(cfg.get("model_type", "unknown")),
    )
