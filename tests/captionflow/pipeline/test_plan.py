"""captionflow plan: GPUs for a batch by a deadline, from the measured scaling (bench/results)."""

from __future__ import annotations

import json

import pytest

from captionflow.pipeline.plan import RESULTS, load_scaling, plan


def test_the_model_reproduces_the_measured_runs_within_20_percent():
    """For each G measured on the host (bench/results/gpu_scaling-h200.json), the projected time of its run (the
    same images) against that run's engines-accepting + steady window."""
    data = json.loads((RESULTS / "gpu_scaling-h200.json").read_text())
    s = load_scaling("h200")
    for row in data["scaling"]:
        measured = min(row["engines_accepting_after_s"]) + row["steady_window_s"]
        projected = s.seconds(data["n"], row["gpus"])
        assert abs(projected / measured - 1) <= 0.2, (row["gpus"], projected, measured)


def test_the_fewest_gpus_that_make_the_deadline(tmp_path):
    rows = [
        {"gpus": 1, "images_per_s": 100.0, "engines_accepting_after_s": [50.0]},
        {"gpus": 2, "images_per_s": 180.0, "engines_accepting_after_s": [60.0]},
    ]
    (tmp_path / "gpu_scaling-x1.json").write_text(json.dumps({"n": 1000, "scaling": rows}))
    s = load_scaling(None, tmp_path)
    assert s.start_s == 60.0 and s.efficiency_at(2) == 0.9 and s.efficiency_at(8) == 0.9  # beyond: the lowest
    assert plan(36_000, 420, s)["gpus"] == 1  # 60 + 360 s
    p = plan(36_000, 419, s)
    assert p["gpus"] == 2 and p["projected_s"] == 260.0 and p["spare_s"] == 159.0  # 60 + 36,000 / 180
    assert plan(10**9, 120, s, max_gpus=8)["gpus"] is None
    with pytest.raises(ValueError, match="no measured rates for 'h100'"):
        load_scaling("h100", tmp_path)
    with pytest.raises(ValueError, match="no measured GPU rates"):
        load_scaling(None, tmp_path / "empty")


def test_plan_on_the_command_line(capsys):
    from flows.cli import main

    assert main(["plan", "--images", "32000", "--deadline", "100s", "--gpu", "h200"]) == 0
    assert "4 GPUs (16 engines)" in capsys.readouterr().out
    assert main(["plan", "--images", "10", "--deadline", "tomorrow"]) == 2
    assert capsys.readouterr().err.strip().count("\n") == 0  # one line
