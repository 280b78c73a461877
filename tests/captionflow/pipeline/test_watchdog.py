"""A wait on results that says what it waits on, and ends when nothing comes."""

from __future__ import annotations

import logging
import time

import pytest

from captionflow.pipeline.watchdog import StageStalled, Watchdog


def test_a_stalled_wait_ends_with_what_it_waited_for(caplog):
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, "captionflow.watchdog"):
        with pytest.raises(StageStalled, match=r"inference stalled: no result for \d+ s.*3 captions so far"):
            with Watchdog("inference", limit_s=1.0, status=lambda: "3 captions so far", every_s=0.2):
                while True:  # a Ray iterator waiting for results that never come
                    time.sleep(0.05)
    assert time.monotonic() - t0 < 60  # it ends (limit 1 s), on a loaded machine too: no hang
    assert "inference: 3 captions so far; last result" in caplog.text  # it said so while waiting


def test_results_that_keep_coming_are_never_interrupted():
    with Watchdog("preprocess", limit_s=0.5, status=lambda: "", every_s=0.1) as w:
        for _ in range(30):
            time.sleep(0.05)
            w.tick()
