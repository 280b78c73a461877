"""Checks that fail cheaply, before Ray, a decoder or an engine starts: each failure one line naming what and where."""

from __future__ import annotations

import shutil

from captionflow.config import RunConfig
from captionflow.model_source import resolve_model
from captionflow.results import PreflightResult


def preflight(cfg: RunConfig) -> PreflightResult:
    """Resolve and check the checkpoint (and the judge's), and what the options need."""
    model = resolve_model(cfg.model, dummy_weights=cfg.dummy_weights())
    judge = None
    if cfg.judge:
        same = cfg.judge_model in (None, cfg.model)
        judge = model if same else resolve_model(cfg.judge_model, dummy_weights=cfg.dummy_weights())
    if cfg.coco_java and not shutil.which("java"):
        raise ValueError("coco_java needs Java on the PATH (PTB tokenizer and METEOR run on the JVM)")
    return PreflightResult(model=model, judge=judge)
