"""captionflow plan: GPUs for a batch by a deadline, from the measured scaling (bench/results)."""

from __future__ import annotations

import json

import pytest

from captionflow.runs.plan import RESULTS, load_scaling, plan


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
    out = capsys.readouterr().out
    assert "  4 GPUs: projected" in out and "basis: measured: qwen2.5-vl-3b at 224 px, 64 tokens on h200" in out
    assert main(["plan", "--images", "10", "--deadline", "tomorrow"]) == 2
    assert capsys.readouterr().err.strip().count("\n") == 0  # one line


def test_plan_for_another_model_scales_by_flops_per_image_and_says_so(capsys):
    """The 3B stand-in at 224 px and 64 tokens costs ~1.4 TFLOP an image (2 per weight per token), the 72B ~26; the
    rate measured for the one is scaled to the other at the same share of the GPU's peak, and the answer says so."""
    from captionflow.builtin.standin import arch_config
    from captionflow.runs.plan import basis, flops_per_image, for_model
    from flows.cli import main

    f3, f72 = (flops_per_image(arch_config(f"qwen2.5-vl-{s}"), 224 * 224, 64) for s in ("3b", "72b"))
    assert 1.3e12 < f3 < 1.45e12 and 25e12 < f72 < 27.5e12
    assert flops_per_image(arch_config("qwen2.5-vl-3b"), 448 * 448, 64) > 2 * f3  # four times the patches
    s, b = load_scaling("h200"), basis(RESULTS, "h200")
    scaled, said = for_model(s, arch_config("qwen2.5-vl-72b"), "qwen2.5-vl-72b", 224 * 224, 64, b)
    assert scaled.rate_1 == pytest.approx(s.rate_1 * f3 / f72) and scaled.start_s == s.start_s
    assert said.startswith("qwen2.5-vl-72b at 224 px, 64 tokens: 26.") and "scaled by FLOPs" in said
    # the command: in FP8 it fits one H200, in bf16 it says what would fit; an absolute deadline; one shorter
    # than the engines' start
    assert main(["plan", "--images", "1000", "--deadline", "8h", "--gpu", "h200", "--arch", "qwen2.5-vl-72b",
                 "--quantization", "fp8"]) == 0  # fmt: skip
    assert "not measured for this model" in capsys.readouterr().out
    assert main(["plan", "--images", "1000", "--deadline", "8h", "--gpu", "h200", "--arch", "qwen2.5-vl-72b"]) == 2
    err = capsys.readouterr().err
    assert "qwen2.5-vl-72b on one h200: its weights take ~137 GiB" in err and "quantization fp8" in err
    assert main(["plan", "--images", "10", "--deadline", "2099-01-01T00:00:00+00:00", "--gpu", "h200"]) == 0
    assert main(["plan", "--images", "10", "--deadline", "20s", "--gpu", "h200"]) == 2
    assert "the engines alone take ~1 min" in capsys.readouterr().err
