"""LoRA adapters end to end on CPU: `captionflow run --model ADAPTER` over the built-in base, each adapter's captions
its own (not the base's, not another adapter's), in a run folder and a leaderboard row of its own; what an adapter
cannot be (a judge) refused in one line before any engine starts; compared, in one pass (killed -9 and resumed,
exactly once); on a warm engine service with LoRA slots, without a swap."""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pyarrow.parquet as pq
import pytest
from warm_service import CLI, start_service

from captionflow.builtin.demo_data import DEMO_CAPTIONS, ensure_demo_dataset

pytestmark = pytest.mark.slow


def _kill_tree(pid: int) -> None:
    """SIGKILL a process and every descendant (its Ray, the vLLM engine): a dead node."""
    procs = psutil.Process(pid).children(recursive=True) + [psutil.Process(pid)]
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(signal.SIGKILL)
    psutil.wait_procs(procs, timeout=30)


def _run(env, *args) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, "run", "--device", "cpu", *args], env=env, capture_output=True, text=True, timeout=900)


def test_two_adapters_and_their_base_caption_as_three_checkpoints(env, tmp_path):
    from captionflow.builtin.adapter import build_adapter
    from captionflow.builtin.model import build_builtin_model
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
    # batches), each into its own run folder, with the captions of its own run above. The first compare is killed
    # (-9, with its Ray and engine) once a shard is committed; the second finishes each checkpoint's rest, exactly once
    out2 = tmp_path / "compared"
    compare = [*CLI, "compare", "builtin", *map(str, adapters.values()), "--device", "cpu", "--dataset", str(data),
               "--output", str(out2)]  # fmt: skip
    small = ["--batch-size", "2", "--commit-rows", "2", "--max-concurrent-batches", "1"]
    killed = subprocess.Popen([*compare, *small], env=env, stdout=open(tmp_path / "killed.log", "w"),  # noqa: SIM115
                              stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    pattern, deadline = "runs/*/*/*/captions/*.parquet", time.time() + 600
    while not list(out2.glob(pattern)):
        assert killed.poll() is None and time.time() < deadline, (tmp_path / "killed.log").read_text()[-3000:]
        time.sleep(0.2)
    _kill_tree(killed.pid)
    before = [i for f in out2.glob(pattern) for i in pq.read_table(f).column("image_id").to_pylist()]
    assert 0 < len(before) < 18, "the kill should land mid-pass"
    r = subprocess.run([*compare, "--summary-json", str(tmp_path / "compare.json")], env=env, capture_output=True,
                       text=True, timeout=900)  # fmt: skip
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    compared = json.loads((tmp_path / "compare.json").read_text())
    shared = compared["shared_pass"]
    assert shared["captioned"] == [6, 6, 6] and sum(shared["resumed_from"]) == len(before)
    assert [(p["sent"], p["ok"]) for p in shared["passes"]] == [(18 - len(before),) * 2]  # one pass, the rest
    assert [run["engines"] for run in compared["runs"]] == ["per-run"] * 3  # each run: its captions were there
    assert [run["resumed_from"] for run in compared["runs"]] == [6, 6, 6]
    for name, run in zip(("base", "step-100", "step-200"), compared["runs"]):
        assert Path(run["run_dir"]).relative_to(out2) == Path(summaries[name]["run_dir"]).relative_to(out)
        ids = [i for f in Path(run["run_dir"], "captions").glob("*.parquet")
               for i in pq.read_table(f).column("image_id").to_pylist()]  # fmt: skip
        assert len(ids) == len(set(ids)) == 6, name  # each image once: nothing lost or committed twice
        rows = pq.read_table(run["run_dir"] + "/captions").to_pylist()
        assert {r["image_id"]: r["caption"] for r in rows} == captions[name], name
    assert len(compared["leaderboard"]) == 3

    # a warm engine service on the base with two LoRA slots: each adapter's run and the base's use its engines as they
    # are (no weights reloaded), each with the captions of its own cold run above
    serve = start_service(env, tmp_path / "serve.log", "--lora-slots", "2", "--lora-rank", "8")
    try:
        warm = {}
        # then a full checkpoint swapped into the LoRA engines, and step-100 again: its base swapped back, checked,
        # and the adapter's captions over it as before (a base not reloaded under LoRA's layers would change them)
        full = build_builtin_model(tmp_path / "step-2000", seed=1)
        models = {"base": "builtin", "full": full, "step-100-again": adapters["step-100"]}
        for name in ("step-100", "step-200", "base", "full", "step-100-again"):
            root = tmp_path / ("warm-again" if name.endswith("again") else "warm")  # not its captions above again
            model = str(models.get(name) or adapters[name])
            r = _run(env, "--dataset", str(data), "--output", str(root), "--model", model,
                     "--summary-json", str(tmp_path / f"warm-{name}.json"))  # fmt: skip
            assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
            warm[name] = json.loads((tmp_path / f"warm-{name}.json").read_text())
        # a compare while the service runs: no shared pass beside it (its engines hold the GPUs), each run uses it
        r = subprocess.run([*CLI, "compare", *map(str, adapters.values()), "--device", "cpu", "--dataset", str(data),
                            "--output", str(tmp_path / "compared-warm"), "--summary-json",
                            str(tmp_path / "compare-warm.json")], env=env, capture_output=True, text=True,
                           timeout=900)  # fmt: skip
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        compared_warm = json.loads((tmp_path / "compare-warm.json").read_text())
        status = subprocess.run([*CLI, "serve", "--status"], env=env, capture_output=True, text=True, timeout=300)
        info = json.loads(status.stdout[status.stdout.index("{") :])
    finally:
        subprocess.run([*CLI, "serve", "--stop"], env=env, capture_output=True, text=True, timeout=300)
        serve.wait(timeout=120)
    assert info["swaps"] == 2 and info["lora_rank"] == 8, info  # to the full checkpoint and back, nothing else
    assert compared_warm["shared_pass"] is None
    assert [run["engines"] for run in compared_warm["runs"]] == ["warm (loaded)"] * 2
    assert [s["engines"] for s in warm.values()] == ["warm (loaded)"] * 3 + ["warm (swapped)"] * 2
    for name, s in warm.items():
        assert s["counts"]["captioned"] == 6, name
        rows = pq.read_table(s["run_dir"] + "/captions").to_pylist()
        got = {r["image_id"]: r["caption"] for r in rows}
        if name == "full":
            assert got != captions["base"]  # the swap changed the weights
        else:
            assert got == captions[name.removesuffix("-again")], name

    # the judge judges with a full checkpoint: an adapter as the judge is one line, before any engine
    r = _run(env, "--dataset", str(data), "--output", str(out), "--model", str(adapters["step-100"]), "--judge")
    assert r.returncode != 0 and "judge_model:" in r.stderr and "is a LoRA adapter" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
