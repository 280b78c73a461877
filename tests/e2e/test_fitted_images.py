"""A golden set's images fitted to the engine's grid and kept (``workers/fitted_images.py``): a run that keeps them
captions exactly as one that decodes every image itself; real Ray Data, the real CPU engine, real Prefect."""

from __future__ import annotations

import glob

import pyarrow.parquet as pq
import pytest
from cli_runs import assert_same_captions, run_cli

from captionflow.data.layout import FITTED

pytestmark = pytest.mark.slow


def _fitted(summary: dict) -> list[str]:
    output = summary["run_dir"].split("/runs/")[0]
    return sorted(glob.glob(f"{output}/datasets/*/{FITTED}/*/part-*.parquet"))


def test_captions_from_kept_fitted_images_equal_captions_from_decoding(plain_golden_run, tmp_path):
    common, kept = plain_golden_run  # the default: a set of 8 images gets its fitted images kept
    files = _fitted(kept)
    assert files and sum(pq.read_metadata(f).num_rows for f in files) == 8
    decoded, _ = run_cli(
        [*common, "--output", str(tmp_path / "decoded"), "--engine-image-cache-max-images", "0"], tmp_path, "decoded"
    )
    assert _fitted(decoded) == []  # nothing kept: every image decoded in the run's preprocess
    assert_same_captions(decoded, kept, 8)
