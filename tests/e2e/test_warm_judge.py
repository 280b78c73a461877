"""A sequential pairwise verdict on warm engines: a service that keeps the judge's engines beside the captioner's
(`captionflow serve --pairwise-against ... --judge-model ...`), real Ray Serve, Ray Data, vLLM on CPU, a real Prefect
API. A new checkpoint is swapped into the captioner's engine; each caption goes on to the judge's engine as it is
made, so the captioning stops once the verdict is in, and the pairwise stage after it finds the judgements
committed. Attribution (a caption only from the run's checkpoint, a judgement only from its judge):
tests/captionflow/service/test_feed.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest
from golden import caption_ids, golden_set, judged_rows
from warm_service import CLI, start_service

pytestmark = pytest.mark.slow
N = 64


def _cli(env, *args: str) -> str:
    r = subprocess.run([*CLI, *args], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return r.stdout + r.stderr


def _status(env) -> dict:
    out = _cli(env, "serve", "--status")
    return json.loads(out[out.index("{") : out.rindex("}") + 1])


def test_a_warm_pairwise_verdict_judges_each_caption_as_it_is_made_and_stops_the_captioning(env, tmp_path):
    from captionflow.builtin.model import build_builtin_model

    data, teacher = golden_set(tmp_path, N)
    common = ["--dataset", str(data), "--output", str(tmp_path / "out")]
    _cli(env, "evaluate", str(teacher), "--name", "teacher", *common, "--summary-json", str(tmp_path / "t.json"))
    baseline = json.loads((tmp_path / "t.json").read_text())["run_dir"]
    judge = ["--judge-model", "builtin", "--pairwise-against", baseline]  # the built-in model judges
    serve = start_service(env, tmp_path / "serve.log", *judge)
    try:
        assert "the judge builtin, 1 engine" in (tmp_path / "serve.log").read_text()
        ckpt = build_builtin_model(tmp_path / "ckpt-2", seed=1)  # swapped into the captioner's engine
        args = ["run", "--device", "cpu", *common, "--model", str(ckpt), *judge, "--max-tokens", "6"]
        args += ["--verdict-against", baseline, "--warm-engines", "require", "--summary-json"]
        # a wide margin on the win rate (docs/evaluation.md suggests 0.03-0.05), so that 64 images are enough
        sequential = ["--verdict", "sequential", "--verdict-score", "pairwise", "--verdict-margin", "0.2"]
        out = _cli(env, *args, str(tmp_path / "w.json"), *sequential)
        engines = _status(env)["engines"]
        run = json.loads((tmp_path / "w.json").read_text())
        captioned, before = caption_ids(run["run_dir"]), judged_rows(run["metrics"]["pairwise"]["pairwise_dir"])
        # the same run in full-set mode: the rest captioned, then judged by the pairwise stage on the judge's engine
        full_out = _cli(env, *args, str(tmp_path / "full.json"), "--verdict", "full")
        after = _status(env)["engines"]
    finally:
        os.killpg(serve.pid, signal.SIGKILL)
        serve.wait(timeout=60)
    assert run["engines"] == "warm (swapped)"
    assert "the warm engine service's judge engines judge the captions as they are made" in out
    v = run["metrics"]["sequential"]
    assert v["score"] == "pairwise win rate" and v["decision"] != "continue" and v["images_used"] < N // 2
    assert v["images_used"] <= len(captioned) < N and len(set(captioned)) == len(captioned)  # stopped, once each
    assert run["counts"]["failed"] == 0 and run["passes"][-1]["stopped"] is True
    # the judgements committed beside the captions, both orders of an image at most once each, of captions made;
    # the pairwise stage after the captioning found them and the verdict in
    pairwise = run["metrics"]["pairwise"]
    pairs = [r["image_id"] for r in before]
    assert len(set(pairs)) == len(pairs) and {p.rpartition("#")[0] for p in pairs} <= set(captioned)
    assert v["images_used"] <= pairwise["judged"] <= len(captioned) and pairwise["failed"] == 0
    # by the service's engines: the checkpoint in the captioner's, the judge in the judge's, which judged each of
    # the captions it was sent in both orders
    assert engines["captionflow-0"]["model_path"] == str(ckpt) and engines["captionflow-0"]["rows"] >= len(captioned)
    assert engines["captionflow-judge-0"]["rows"] == 2 * engines["captionflow-0"]["rows"]

    full = json.loads((tmp_path / "full.json").read_text())
    assert full["run_dir"] == run["run_dir"] and full["resumed_from"] == len(captioned)
    everything = caption_ids(full["run_dir"])
    assert len(everything) == len(set(everything)) == N and set(captioned) <= set(everything)
    judged = full["metrics"]["pairwise"]
    pairs = [r["image_id"] for r in judged_rows(judged["pairwise_dir"])]
    assert judged["judged"] == N and judged["failed"] == 0 and len(pairs) == len(set(pairs)) == 2 * N
    assert "the service's judge engines judge (builtin)" in full_out
    # every pair not judged before was judged by the judge's warm engine, none by engines of the stage's own
    assert after["captionflow-judge-0"]["rows"] - engines["captionflow-judge-0"]["rows"] == 2 * N - len(before)
