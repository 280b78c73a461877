"""Which run the pairwise judge compares with, and where its judgements are kept (the judging itself runs on the
real engine in tests/e2e/test_demo_flow.py)."""

from __future__ import annotations

import pyarrow as pa
import pytest

from captionflow.data.layout import CAPTIONS
from captionflow.data.storage import Store
from captionflow.errors import BaselineError
from captionflow.evaluation.pairwise_scores import pairwise_per_image
from captionflow.report.markdown import update_leaderboard
from captionflow.runs.baseline import BEST, LATEST, resolve_baseline


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


def test_a_pairwise_verdict_takes_each_image_once_both_orders_are_judged_in_the_seeded_order():
    from captionflow.config import RunConfig
    from captionflow.evaluation.evaluate import bootstrap_beside_verdict
    from captionflow.evaluation.sequential import seeded_order, verdict_line
    from captionflow.stages.pairwise import JudgedShares, both_orders_of, pairwise_verdict

    # pending judgements keep their order: the images are read in it (the verdict's), not sorted
    assert both_orders_of(["b#ab", "b#ba", "a#ab", "c#ba"])[0] == ["b", "a", "c"]
    images = {f"i{k:02d}" for k in range(40)}
    cfg = RunConfig(verdict="sequential", verdict_score="pairwise", pairwise_against="previous")
    base = {"model": "ckpt-1", "run_dir": "/out/runs/ds/fp-ckpt-1/g"}
    verdict = pairwise_verdict(cfg, ("runs", "ds", "fp-me", "g"), base, images, set())
    assert verdict.order == seeded_order(sorted(images), "ds:/out/runs/ds/fp-ckpt-1/g:fp-me")  # and this candidate
    # an image whose caption failed for good is left out of the same order
    less = pairwise_verdict(cfg, ("runs", "ds", "fp-me", "g"), base, images, {verdict.order[1]})
    assert less.order == verdict.order[:1] + verdict.order[2:] and len(less.order) == len(images) - 1
    judged = JudgedShares()
    first, second = verdict.order[:2]
    assert judged.add([{"image_id": f"{second}#ab", "candidate_score": 1.0}]) == {}  # one order: not yet an image
    shares = judged.add([{"image_id": f"{second}#ba", "candidate_score": 0.0}])
    assert shares == {second: 0.5} and verdict.observe(shares) is False and verdict.cs.n == 0  # the prefix waits
    both = [{"image_id": f"{first}#{o}", "candidate_score": 1.0} for o in ("ab", "ba")]
    assert verdict.observe(judged.add(both)) is False and verdict.cs.n == 2  # the first image in: the prefix is two
    for i in verdict.order[2:]:  # this run wins both orders of every other image
        if verdict.observe(judged.add([{"image_id": f"{i}#{o}", "candidate_score": 1.0} for o in ("ab", "ba")])):
            break
    record = verdict.record()
    assert record["decision"] == "better" and record["lower"] > 0 and record["images_used"] < 40
    assert record["mean_difference"] == pytest.approx(
        (0.5 * (record["images_used"] - 1)) / record["images_used"], abs=1e-6
    )
    line = verdict_line(record)
    assert line.startswith(f"better after {record['images_used']} of 40 images (pairwise win rate 0.")
    assert line.endswith("; alpha 0.05, margin 0.03, against ckpt-1)")
    win = {"win_rate": 0.9, "ci_low": 0.8, "ci_high": 1.0, "n_images": record["images_used"], "verdict": "better"}
    boot = bootstrap_beside_verdict(record, [], 100, win=win)
    assert boot["agrees"] and boot["delta"] == pytest.approx(0.4) and "images judged: better" in boot["line"]
    assert "no image judged" in bootstrap_beside_verdict(record, [], 100)["error"]


def test_a_pairwise_verdict_without_its_baseline_is_refused_before_any_work(tmp_path):
    from captionflow.config import RunConfig
    from captionflow.preflight import OptionError, check_inputs

    cfg = RunConfig(output=str(tmp_path), verdict="sequential", verdict_score="pairwise")
    with pytest.raises(OptionError, match="verdict_score pairwise needs pairwise_against"):
        check_inputs(cfg)
