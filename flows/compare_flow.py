"""Evaluate a list of checkpoints on one dataset, in order, and return the leaderboard.

The dataset is preprocessed once (the other runs hit the preprocess cache). Checkpoints run in
sequence: on one GPU host each run uses the GPU in turn. On a Ray cluster with room for several
engines, run the flow with prefect-ray's ``RayTaskRunner`` and ``concurrency`` instead (mind its
open issue: remote Ray workers do not inherit ``PREFECT_API_URL``; set it in the runtime env).
"""

from __future__ import annotations

import inspect

from prefect import flow

from captionflow.config import RunConfig
from captionflow.model_source import resolve_model
from captionflow.report import read_leaderboard
from captionflow.storage import Store
from flows.caption_flow import caption_flow
from flows.parameters import with_config_parameters

MODELS = inspect.Parameter("models", inspect.Parameter.KEYWORD_ONLY, default=("builtin",), annotation=tuple[str, ...])


@flow(name="captionflow-compare")
@with_config_parameters(MODELS)
def compare_checkpoints(config: RunConfig, models: tuple[str, ...] = ("builtin",)) -> dict:
    """Run the caption flow for each checkpoint (training order) and return their leaderboard rows."""
    # every checkpoint checked before any run starts
    resolved = [resolve_model(m, dummy_weights=config.dummy_weights()) for m in models]
    runs = [caption_flow(**config.model_copy(update={"model": m}).model_dump()) for m in models]
    store = Store(config.output)
    board = read_leaderboard(store)
    wanted = {r["run_dir"] for r in runs}
    order = [r["run_dir"] for r in runs]
    rows = sorted((r for r in board if r["run_dir"] in wanted), key=lambda r: order.index(r["run_dir"]))
    return {"runs": runs, "leaderboard": rows, "models": [m.fingerprint for m in resolved]}
