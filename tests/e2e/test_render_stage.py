"""Requests rendered on CPU actors before the engine stage (``render_actors``): the real CPU engine, real Ray Data,
real Prefect."""

from __future__ import annotations

import shutil

import pytest
from cli_runs import captions, run_cli

from captionflow.builtin.demo_data import DEMO_CAPTIONS, ensure_demo_dataset
from captionflow.pipeline.render_stage import READY

pytestmark = pytest.mark.slow


def test_requests_rendered_before_the_engine_caption_as_the_engine_front_end_does(prefect_api, tmp_path):
    data = tmp_path / "golden"
    data.mkdir()
    for n in sorted(DEMO_CAPTIONS)[:8]:
        shutil.copy2(ensure_demo_dataset() / n, data / n)
    common = ["--dataset", str(data), "--device", "cpu", "--batch-size", "2"]
    alone, _ = run_cli([*common, "--output", str(tmp_path / "alone")], tmp_path, "alone")
    rendered, log = run_cli(
        [*common, "--output", str(tmp_path / "rendered"), "--render-actors", "1"], tmp_path, "rendered"
    )
    assert READY in log  # the render actor ran
    # the same settings that make a caption: the same generation fingerprint, the same captions
    assert rendered["run_dir"].split("/")[-2:] == alone["run_dir"].split("/")[-2:]
    mine = {r["image_id"]: r["caption"] for r in captions(rendered["run_dir"])}
    assert len(mine) == 8 and mine == {r["image_id"]: r["caption"] for r in captions(alone["run_dir"])}
