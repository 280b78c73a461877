"""A wait on results that says what it waits on, and ends when nothing comes."""

from __future__ import annotations

import logging
import time

import pytest

from captionflow.runs.watchdog import StageStalled, Watchdog


def test_a_stalled_wait_ends_with_what_it_waited_for(caplog):
    t0 = time.monotonic()
    with caplog.at_level(logging.INFO, "captionflow.watchdog"):
        with pytest.raises(StageStalled, match=r"inference stalled: no result for \d+ s.*3 captions so far"):
            with Watchdog("inference", limit_s=1.0, status=lambda: "3 captions so far", every_s=0.2) as w:
                w.tick()  # one result, then none: a warning while it waits
                while True:  # a Ray iterator waiting for results that never come
                    time.sleep(0.05)
    assert time.monotonic() - t0 < 60  # it ends (limit 1 s), on a loaded machine too: no hang
    said = [r for r in caplog.records if "inference: 3 captions so far; last result" in r.getMessage()]
    assert said and all(r.levelno == logging.WARNING for r in said)  # it said so while waiting


def test_before_the_first_result_the_wait_is_news_not_a_warning_until_the_stall(caplog):
    """The engines start first: 'last result 60 s ago' was a WARNING during every normal engine start."""
    with caplog.at_level(logging.INFO, "captionflow.watchdog"):
        with pytest.raises(StageStalled, match="no result for"):
            with Watchdog("inference", limit_s=1.0, status=lambda: "0 captions", every_s=0.2):
                while True:
                    time.sleep(0.05)
    waiting = [r for r in caplog.records if "no result yet" in r.getMessage()]
    assert waiting and all(r.levelno == logging.INFO for r in waiting)
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]
    assert [r.levelno for r in caplog.records if "stalled" in r.getMessage()] == [logging.ERROR]


def test_results_that_keep_coming_are_never_interrupted():
    with Watchdog("preprocess", limit_s=0.5, status=lambda: "", every_s=0.1) as w:
        for _ in range(30):
            time.sleep(0.05)
            w.tick()
