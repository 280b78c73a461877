"""Front ends sharing one vLLM engine core (``front_ends``): the real CPU engine, real Ray Data, real Prefect."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from cli_runs import assert_same_captions, captions, run_cli

from captionflow.workers import core_group

pytestmark = pytest.mark.slow


def _host_lines(log: str, what: str) -> list[str]:
    return [line for line in log.splitlines() if "shared engine core" in line and what in line]


def test_front_ends_sharing_one_core_caption_as_one_engine_does_and_give_it_back(plain_golden_run, tmp_path):
    common, alone = plain_golden_run
    shared, log = run_cli([*common, "--output", str(tmp_path / "shared"), "--front-ends", "2"], tmp_path, "shared")
    assert_same_captions(shared, alone, 8)
    # two front ends, one engine core
    assert len(_host_lines(log, " starts ")) == 1 and len(_host_lines(log, " joins ")) == 1
    assert len(_host_lines(log, "started in")) == 1
    # the core outlives the run by LINGER_S at most, then its host gives the GPU (here the CPU) back
    folders = [p.parent for p in core_group.groups_root().glob("*/state.json")]
    deadline = time.monotonic() + core_group.LINGER_S + 60
    while time.monotonic() < deadline:
        states = [json.loads((f / "state.json").read_text()) for f in folders]
        if all(not core_group._alive(s.get("host")) for s in states):
            break
        time.sleep(2)
    assert all(not core_group._alive(s.get("host")) and s["core"] is None for s in states), states


def test_a_core_killed_mid_run_is_started_again_and_every_image_is_captioned_once(prefect_api, tmp_path):
    from captionflow.builtin.synthetic import make_images

    data = make_images(tmp_path / "many", 120, size=(224, 168))
    started = time.time()
    args = ["--dataset", str(data), "--output", str(tmp_path / "out"), "--device", "cpu", "--front-ends", "2"]
    args += ["--batch-size", "2", "--commit-rows", "2", "--max-tokens", "512", "--ignore-eos"]
    proc, log, summary = run_cli(args, tmp_path, "killed", wait=False)
    core = None
    deadline = time.monotonic() + 600
    while core is None and time.monotonic() < deadline and proc.poll() is None:
        for f in core_group.groups_root().glob("*/state.json"):
            state = json.loads(f.read_text())
            if state.get("core") and state["spawned_at"] >= started and core_group._alive(state["core"][0]):
                core = state["core"][0][0]
        time.sleep(0.5)
    assert core is not None, (tmp_path / "killed.log").read_text()[-4000:]
    time.sleep(8)  # some rows committed, most still to do
    os.kill(core, signal.SIGKILL)
    proc.wait(timeout=900)
    log.close()
    text = (tmp_path / "killed.log").read_text()
    assert proc.returncode == 0, text[-4000:]
    assert _host_lines(text, "the engine core died") and _host_lines(text, "is gone; this front end exits")
    assert any("generation 2" in line for line in _host_lines(text, "started in")), text[-4000:]
    s = json.loads(summary.read_text())
    ids = [r["image_id"] for r in captions(s["run_dir"])]
    assert len(ids) == len(set(ids)) == 120 and s["counts"]["captioned"] == 120
