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
from warm_service import CLI, start_service

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

    # the three compared: captioned in one pass (each image's three requests side by side in the engine's
    # batches), each into its own run folder, with the captions of its own run above
    out2 = tmp_path / "compared"
    r = subprocess.run([*CLI, "compare", "builtin", *map(str, adapters.values()), "--device", "cpu", "--dataset",
                        str(data), "--output", str(out2), "--summary-json", str(tmp_path / "compare.json")],
                       env=env, capture_output=True, text=True, timeout=900)  # fmt: skip
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    compared = json.loads((tmp_path / "compare.json").read_text())
    shared = compared["shared_pass"]
    assert shared["captioned"] == [6, 6, 6] and shared["resumed_from"] == [0, 0, 0]
    assert [(p["sent"], p["ok"]) for p in shared["passes"]] == [(18, 18)]  # one pass, every checkpoint's rows
    assert [run["engines"] for run in compared["runs"]] == ["per-run"] * 3  # each run: its captions were there
    assert [run["resumed_from"] for run in compared["runs"]] == [6, 6, 6]
    for name, run in zip(("base", "step-100", "step-200"), compared["runs"]):
        assert Path(run["run_dir"]).relative_to(out2) == Path(summaries[name]["run_dir"]).relative_to(out)
        rows = pq.read_table(run["run_dir"] + "/captions").to_pylist()
        assert {r["image_id"]: r["caption"] for r in rows} == captions[name], name
    assert len(compared["leaderboard"]) == 3

    # a warm engine service on the base with two LoRA slots: each adapter's run and the base's use its engines as they
    # are (no weights reloaded), each with the captions of its own cold run above
    serve = start_service(env, tmp_path / "serve.log", "--lora-slots", "2", "--lora-rank", "8")
    try:
        warm = {}
        for name in ("step-100", "step-200", "base"):
            model = adapters.get(name, "builtin")
            r = _run(env, "--dataset", str(data), "--output", str(tmp_path / "warm"), "--model", str(model),
                     "--summary-json", str(tmp_path / f"warm-{name}.json"))  # fmt: skip
            assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
            warm[name] = json.loads((tmp_path / f"warm-{name}.json").read_text())
        status = subprocess.run([*CLI, "serve", "--status"], env=env, capture_output=True, text=True, timeout=300)
        info = json.loads(status.stdout[status.stdout.index("{") :])
    finally:
        subprocess.run([*CLI, "serve", "--stop"], env=env, capture_output=True, text=True, timeout=300)
        serve.wait(timeout=120)
    assert info["swaps"] == 0 and info["lora_rank"] == 8, info  # the base stayed loaded throughout
    for name, s in warm.items():
        assert s["engines"] == "warm (loaded)" and s["counts"]["captioned"] == 6, (name, s["engines"])
        rows = pq.read_table(s["run_dir"] + "/captions").to_pylist()
        assert {r["image_id"]: r["caption"] for r in rows} == captions[name], name

    # the judge judges with a full checkpoint: an adapter as the judge is one line, before any engine
    r = _run(env, "--dataset", str(data), "--output", str(out), "--model", str(adapters["step-100"]), "--judge")
    assert r.returncode != 0 and "judge_model:" in r.stderr and "is a LoRA adapter" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
