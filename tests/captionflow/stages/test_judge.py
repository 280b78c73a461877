"""The judge's 1-5 score as the sequential verdict's score (the judging itself runs on the real engine in
tests/e2e/test_demo_flow.py, and the ordered, stopping judge passes in tests/e2e/test_sequential_verdict.py)."""

from __future__ import annotations

import pyarrow as pa
import pytest
from PIL import Image

from captionflow.config import RunConfig
from captionflow.data.layout import CAPTIONS, SCORES
from captionflow.data.storage import Store
from captionflow.errors import BaselineError
from captionflow.evaluation.evaluate import bootstrap_beside_verdict
from captionflow.evaluation.sequential import seeded_order, verdict_line
from captionflow.preflight import OptionError, check_inputs, preflight
from captionflow.stages.judge import judge_run_parts, judge_verdict


def test_a_judge_verdict_compares_each_image_with_the_baseline_judged_by_the_same_judge(tmp_path):
    (tmp_path / "ds").mkdir()
    Image.new("RGB", (40, 30), "red").save(tmp_path / "ds" / "red.png")
    cfg = RunConfig(
        dataset=str(tmp_path / "ds"), output=str(tmp_path / "out"), device="cpu", judge=True,
        verdict="sequential", verdict_score="judge",
    )  # fmt: skip
    checked = preflight(cfg)
    store = Store(cfg.output)
    ids = [f"i{k:02d}" for k in range(40)]
    captions = pa.Table.from_pylist([{"image_id": i, "caption": "a caption"} for i in ids])
    base, other, mine = (("runs", "ds", fp, "g") for fp in ("fp-base", "fp-other", "fp-me"))
    for run in (base, other):
        store.write_table(captions, *run, CAPTIONS, "part-0.parquet")
    # the baseline judged by this judge (3 for every image); the other run never judged
    scores = pa.Table.from_pylist([{"image_id": i, "score": 3} for i in ids[:30]])  # 30 of the 40 judged
    store.write_table(scores, *judge_run_parts(base, checked.judge, checked.engine), SCORES, "part-0.parquet")

    against = cfg.model_copy(update={"verdict_against": store.url(*base)})
    # the images the baseline has scores of, but the one whose caption failed for good: the order of all of them
    # with it left out, so that the judgements committed before it was left out stay a prefix
    verdict = judge_verdict(against, store, mine, checked.judge, checked.engine, set(ids), {ids[3]})
    seed = f"ds:{store.url(*base).rstrip('/')}:fp-me"  # the dataset, the baseline and this candidate
    assert verdict.order == [i for i in seeded_order(ids[:30], seed) if i != ids[3]]
    assert judge_verdict(against, store, mine, checked.judge, checked.engine, set(ids), set()).order == seeded_order(
        ids[:30], seed
    )
    for i in verdict.order:  # this run's judge gives 5 where the baseline got 3
        if verdict.observe({i: 5}):
            break
    record = verdict.record()
    assert record["decision"] == "better" and record["images_used"] < 29 and record["mean_difference"] == 2.0
    assert record["metric"] == "judge_mean" and record["judge_model"] == "builtin"
    assert record["baseline_scores"].endswith(judge_run_parts(base, checked.judge, checked.engine)[-1])
    assert "judge score difference +2.000" in verdict_line(record)
    rows = [{"image_id": i, "judge_score": 5} for i in verdict.order[: record["images_used"]]]
    boot = bootstrap_beside_verdict(record, rows, 200)
    assert boot["delta"] == 2.0 and boot["n_images"] == record["images_used"] and boot["agrees"]
    assert f"on the {record['images_used']} images judged: better" in boot["line"]
    assert "has no judge scores by builtin" in bootstrap_beside_verdict({**record, "baseline_scores": str(tmp_path)},
                                                                       rows, 9)["error"]  # fmt: skip

    # a baseline never judged by this judge: one line, before the judge's engines start
    unjudged = cfg.model_copy(update={"verdict_against": store.url(*other)})
    with pytest.raises(BaselineError, match="has no scores by the judge builtin"):
        judge_verdict(unjudged, store, mine, checked.judge, checked.engine, set(ids), set())
    with pytest.raises(OptionError, match="verdict_score judge needs judge"):
        check_inputs(cfg.model_copy(update={"judge": False}))


def test_a_judge_runs_beside_the_captioner_where_both_fit_and_says_why_not_elsewhere(tmp_path):
    from dataclasses import replace

    from captionflow.engines.presets import GPU
    from captionflow.stages.judge import alongside

    (tmp_path / "ds").mkdir()
    Image.new("RGB", (40, 30), "red").save(tmp_path / "ds" / "red.png")
    cfg = RunConfig(dataset=str(tmp_path / "ds"), output=str(tmp_path / "out"), device="cpu", judge=True)
    checked = preflight(cfg)
    cpu = checked.engine
    assert alongside(cfg, cpu, checked.judge, checked.judge_engine) is None  # CPU: one engine each, side by side
    assert alongside(cfg, cpu, None, None) == "no judge"
    other_grid = replace(checked.judge_engine, image_grid=(16, 2, 3136, 200704))
    assert "image grid" in alongside(cfg, cpu, checked.judge, other_grid)
    # GPUs: half of each GPU's engines the captioner's, half the judge's, each keeping its share of the GPU
    four = replace(cpu, preset=GPU, engines_per_gpu=4, gpu_share=0.25, concurrency=8)  # 2 GPUs, 4 engines on each
    assert alongside(cfg, four, checked.judge, four) is None
    half = four.halved()
    assert (half.concurrency, half.gpu_share, half.engine_kwargs) == (4, 0.25, four.engine_kwargs)
    alone = replace(four, engines_per_gpu=1, gpu_share=1.0, concurrency=2)  # a judge alone on each GPU
    assert "only one engine" in alongside(cfg, four, checked.judge, alone)
