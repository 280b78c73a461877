"""LoRA adapters end to end on CPU: `captionflow run --model ADAPTER` over the built-in base, each adapter's captions
its own (not the base's, not another adapter's), in a run folder and a leaderboard row of its own; what an adapter
cannot be (a judge) refused in one line before any engine starts."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from warm_service import CLI

from captionflow.builtin.demo_data import DEMO_CAPTIONS, ensure_demo_dataset

pytestmark = pytest.mark.slow


def _run(env, *args) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, "run", "--device", "cpu", *args], env=env, capture_output=True, text=True, timeout=900)


def test_two_adapters_and_their_base_caption_as_three_checkpoints(env, tmp_path):
    from captionflow.builtin.adapter import build_adapter
    from captionflow.model_source import resolve_model

    data = tmp_path / "golden"
    data.mkdir()
    for name in sorted(DEMO_CAPTIONS)[:6]:
        shutil.copy2(ensure_demo_dataset() / name, data / name)
    adapters = {f"step-{s}": build_adapter(tmp_path / f"step-{s}", seed=s) for s in (100, 200)}
    out = tmp_path / "out"
    summaries, captions = {}, {}
    for name, model in {"base": "builtin", **{k: str(v) for k, v in adapters.items()}}.items():
        r = _run(env, "--dataset", str(data), "--output", str(out), "--model", model,
                 "--summary-json", str(tmp_path / f"{name}.json"))  # fmt: skip
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        summaries[name] = s = json.loads((tmp_path / f"{name}.json").read_text())
        assert s["counts"]["captioned"] == 6, name
        rows = pq.read_table(s["run_dir"] + "/captions").to_pylist()
        assert {r["model_fingerprint"] for r in rows} == {resolve_model(model).fingerprint}, name
        captions[name] = {r["image_id"]: r["caption"] for r in rows}

    assert len({s["run_dir"] for s in summaries.values()}) == 3  # a run folder each: nothing reused across them
    for a, b in (("base", "step-100"), ("base", "step-200"), ("step-100", "step-200")):
        assert all(captions[a][i] != captions[b][i] for i in captions[a]), (a, b)
    run = json.loads(Path(summaries["step-100"]["run_dir"], "run.json").read_text())
    assert run["model"] == str(adapters["step-100"]) and run["engine_kwargs"]["enable_lora"] is True
    board = subprocess.run([*CLI, "leaderboard", "--output", str(out), "--json"], env=env, capture_output=True,
                           text=True, check=True)  # fmt: skip
    assert {r["model"] for r in json.loads(board.stdout)} == {"builtin", *map(str, adapters.values())}

    # the judge judges with a full checkpoint: an adapter as the judge is one line, before any engine
    r = _run(env, "--dataset", str(data), "--output", str(out), "--model", str(adapters["step-100"]), "--judge")
    assert r.returncode != 0 and "judge_model:" in r.stderr and "is a LoRA adapter" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
