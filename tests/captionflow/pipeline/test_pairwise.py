"""Which run the pairwise judge compares with, and where its judgements are kept (the judging itself runs on the
real engine in tests/e2e/test_demo_flow.py)."""

from __future__ import annotations

import pyarrow as pa
import pytest

from captionflow.data.layout import CAPTIONS
from captionflow.data.storage import Store
from captionflow.errors import BaselineError
from captionflow.evaluation.pairwise_scores import pairwise_per_image
from captionflow.pipeline.pairwise import BEST, LATEST, resolve_baseline
from captionflow.report.markdown import update_leaderboard


def _board(store: Store) -> None:
    for model, gen, cider in (("ckpt-1", "g", 0.9), ("ckpt-2", "g", 0.4), ("ckpt-3", "other-g", 2.0)):
        run = ("runs", "ds", f"fp-{model}", gen)
        metrics = {"stats": {"n_captions": 1, "failure_rate": 0.0}, "reference": {"cider": cider}}
        update_leaderboard(store, "ds", run, model, metrics)
        store.write_table(pa.Table.from_pylist([{"image_id": "i", "caption": model}]), *run, CAPTIONS, "p.parquet")


def test_the_baseline_is_a_comparable_run_or_what_was_named(tmp_path):
    store = Store(str(tmp_path))
    mine = ("runs", "ds", "fp-mine", "g")
    assert resolve_baseline(store, mine, LATEST) is None  # nothing yet: the run says so, it does not fail
    _board(store)
    assert resolve_baseline(store, mine, LATEST)["model"] == "ckpt-2"  # newest, same generation settings
    assert resolve_baseline(store, mine, BEST)["model"] == "ckpt-1"  # ckpt-3 has more CIDEr but other settings
    assert resolve_baseline(store, mine, "fp-ckpt-1")["model"] == "ckpt-1"  # a fingerprint prefix
    assert resolve_baseline(store, ("runs", "ds", "fp-ckpt-2", "g"), LATEST)["model"] == "ckpt-1"  # never itself
    other = store.url("runs", "ds", "fp-ckpt-3", "other-g")
    assert resolve_baseline(store, mine, other)["run_dir"] == other  # a run folder, named explicitly
    with pytest.raises(BaselineError, match="known: ckpt-1, ckpt-2"):
        resolve_baseline(store, mine, "ckpt-9")
    foreign = Store(str(tmp_path / "elsewhere"))
    foreign.write_table(
        pa.Table.from_pylist([{"image_id": "i", "caption": "x"}]), "runs", "ds2", "m", "g", CAPTIONS, "p.parquet"
    )
    with pytest.raises(BaselineError, match="another dataset"):
        resolve_baseline(store, mine, foreign.url("runs", "ds2", "m", "g"))


def test_per_image_shares_need_both_orders(tmp_path):
    store = Store(str(tmp_path))
    rows = [
        {"image_id": "a#ab", "candidate_score": 1.0},
        {"image_id": "a#ba", "candidate_score": 0.0},
        {"image_id": "b#ab", "candidate_score": 1.0},
        {"image_id": "b#ba", "candidate_score": 1.0},
        {"image_id": "c#ab", "candidate_score": 1.0},  # its other order failed: not counted
    ]
    store.write_table(pa.Table.from_pylist(rows), "scores", "part-0.parquet")
    assert pairwise_per_image(store.url()) == {"a": 0.5, "b": 1.0}
