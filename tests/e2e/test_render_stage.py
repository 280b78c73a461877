"""Requests rendered on CPU actors before the engine stage (``render_actors``): the real CPU engine, real Ray Data,
real Prefect."""

from __future__ import annotations

import pytest
from cli_runs import assert_same_captions, run_cli

from captionflow.pipeline.render_stage import READY

pytestmark = pytest.mark.slow


def test_requests_rendered_before_the_engine_caption_as_the_engine_front_end_does(plain_golden_run, tmp_path):
    common, alone = plain_golden_run
    rendered, log = run_cli(
        [*common, "--output", str(tmp_path / "rendered"), "--render-actors", "1"], tmp_path, "rendered"
    )
    assert READY in log  # the render actor ran
    assert_same_captions(rendered, alone, 8)
