"""Warm engines: a service started once, two checkpoints captioned through it (the second swapped into the
running engine), captions equal to cold runs', every row attributed to its checkpoint, the service stopped
and its processes gone; and a run whose service dies mid-run ends with the reason, never hangs."""

from __future__ import annotations

import json
import os
import re
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
from captionflow.service.feed import GATE
from captionflow.service.replica import SWAP_DELAY_ENV

pytestmark = pytest.mark.slow


def _images(folder: Path, n: int) -> Path:
    folder.mkdir(parents=True)
    demo = ensure_demo_dataset()
    for name in sorted(DEMO_CAPTIONS)[:n]:
        shutil.copy2(demo / name, folder / name)
    return folder


def _run(env, *args) -> dict:
    """The run's summary, with what it printed under "_output"."""
    out = Path(args[args.index("--summary-json") + 1])
    r = subprocess.run([*CLI, "run", "--device", "cpu", *args], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return {**json.loads(out.read_text()), "_output": r.stdout + r.stderr}


def _captions(summary: dict) -> dict[str, dict]:
    return {r["image_id"]: r for r in pq.read_table(summary["run_dir"] + "/captions").to_pylist()}


def _flow_run_failed_with(text: str) -> bool:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.sorting import FlowRunSort

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(sort=FlowRunSort.START_TIME_DESC, limit=20)
    return any(r.state is not None and r.state.is_failed() and text in (r.state.message or "") for r in runs)


def test_two_checkpoints_through_warm_engines_then_a_service_that_dies_mid_run_and_a_cold_rerun_equal_to_them(
    env, tmp_path
):
    """One service serves checkpoint A, then B swapped into its running engines, and stops cleanly. A second
    service, started on B, is killed mid-run: the run ends with the reason, and a rerun finishes it with its own
    (cold) engines. Every caption of B - swapped in, loaded, cold - is the same."""
    from captionflow.builtin.model import build_builtin_model
    from captionflow.data.fingerprint import model_fingerprint

    data = _images(tmp_path / "golden", 6)
    ckpt_b = build_builtin_model(tmp_path / "step-2000", seed=1)
    # long captions: the second service must die mid-run (with short ones the other images were captioned between
    # the first committed shard and the kill once); B's warm run has the same generation settings, to compare
    long = ["--max-tokens", "512", "--ignore-eos"]
    # two engines, as a run with --concurrency 2 would have: a swap must reach both. Each swap takes 15 s longer,
    # so that B's first requests are built while B is still being swapped in: it must send nothing before B is in.
    slow_swap = {**env, SWAP_DELAY_ENV: "15"}
    serve = start_service(slow_swap, tmp_path / "serve.log", "--concurrency", "2")
    children = [p.pid for p in psutil.Process(serve.pid).children(recursive=True)]
    try:
        # a batch per image, so that both engines caption
        common = ["--dataset", str(data), "--output", str(tmp_path / "out"), "--batch-size", "1"]
        a = _run(env, *common, "--summary-json", str(tmp_path / "a.json"))
        b = _run(env, *common, *long, "--model", str(ckpt_b), "--summary-json", str(tmp_path / "b.json"))
        status = subprocess.run([*CLI, "serve", "--status"], env=env, capture_output=True, text=True, timeout=300)
        info = json.loads(status.stdout[status.stdout.index("{") :])
        assert info["swaps"] == 1 and len(info["apps"]) == 2, status.stdout + status.stderr
        engines = list(info["engines"].values())
    finally:
        stop = subprocess.run([*CLI, "serve", "--stop"], env=env, capture_output=True, text=True, timeout=300)
        serve.wait(timeout=120)
    assert a["engines"] == "warm (loaded)" and b["engines"] == "warm (swapped)"
    assert a["counts"]["captioned"] == b["counts"]["captioned"] == 6
    # every row of B's one pass served by B's weights, whichever engine captioned it (a row an engine served
    # with A's weights is an error row, and would have needed a second pass)
    assert [(p["sent"], p["captioned"], p["failed"]) for p in b["passes"]] == [(6, 6, 0)]
    # ... because its driver, its requests built before the swap ended, waited for it
    waited = re.search(re.escape(GATE) + r" \(waited ([0-9.]+) s\)", b["_output"])
    assert waited and float(waited.group(1)) > 1.0, b["_output"][-3000:]
    warm_rows = _captions(b)
    fp_a, fp_b = model_fingerprint(Path(env["CAPTIONFLOW_CACHE"]) / "models" / "builtin-v2"), model_fingerprint(ckpt_b)
    assert {r["model_fingerprint"] for r in _captions(a).values()} == {fp_a}
    assert {r["model_fingerprint"] for r in warm_rows.values()} == {fp_b} and fp_a != fp_b
    # both engines hold B and captioned (12 rows: A's 6 and B's 6 between them)
    assert [e["model_fingerprint"] for e in engines] == [fp_b, fp_b], engines
    assert all(e["rows"] > 0 for e in engines) and sum(e["rows"] for e in engines) == 12, engines
    assert {r["caption"] for r in warm_rows.values()} != {r["caption"] for r in _captions(a).values()}
    # stopped: the command said so, its process and every process it started are gone, its address file too
    assert stop.returncode == 0 and "stopped" in stop.stdout, stop.stdout + stop.stderr
    assert serve.returncode == 0, (tmp_path / "serve.log").read_text()[-3000:]
    assert not (Path(env["CAPTIONFLOW_CACHE"]) / "service.json").exists()
    time.sleep(5)
    assert not [pid for pid in children if psutil.pid_exists(pid)]

    # a service started on B, killed with its Ray while a run of B uses it
    out = tmp_path / "died"
    serve = start_service(env, tmp_path / "serve-2.log", "--model", str(ckpt_b))
    log = tmp_path / "run.log"
    args = ["--dataset", str(data), "--output", str(out), "--model", str(ckpt_b), *long]
    one_by_one = ["--batch-size", "1", "--commit-rows", "1", "--max-concurrent-batches", "1"]
    run = subprocess.Popen(
        [*CLI, "run", "--device", "cpu", *args, *one_by_one],
        env=env,
        stdout=open(log, "w"),  # noqa: SIM115
        stderr=subprocess.STDOUT,
    )
    pattern = "runs/*/*/*/captions/*.parquet"
    deadline = time.time() + 600
    while not list(out.glob(pattern)):
        assert run.poll() is None and time.time() < deadline, log.read_text()[-3000:]
        time.sleep(0.1)
    os.killpg(serve.pid, signal.SIGKILL)  # the service and its Ray, at once
    t0 = time.time()
    rc = run.wait(timeout=180)  # ends, within Ray's reconnect window: never hangs
    assert rc == 1 and time.time() - t0 < 120
    assert "warm engine service (pid" in log.read_text() and "stopped during the run" in log.read_text()
    # ended by captionflow before Ray's quick exit: one captionflow line, and the flow run Failed with the reason
    # (it stayed Running forever)
    assert "captionflow: run failed: the warm engine service" in log.read_text()
    assert _flow_run_failed_with("stopped during the run"), log.read_text()[-3000:]
    committed = [i for f in out.glob(pattern) for i in pq.read_table(f).column("image_id").to_pylist()]

    # no service now: its own engines, which take the rest in batches (how a run batches is not in its folder's key)
    s = _run(env, *args, "--summary-json", str(tmp_path / "again.json"))
    assert s["engines"] == "per-run" and s["resumed_from"] == len(set(committed)) < 6
    ids = [i for f in out.glob(pattern) for i in pq.read_table(f).column("image_id").to_pylist()]
    assert len(ids) == len(set(ids)) == s["counts"]["accepted"] == 6
    # B's captions: those the loaded service made before it died and those the cold engines made after, the same
    # as those B swapped into the first service made
    assert {k: r["caption"] for k, r in _captions(s).items()} == {k: r["caption"] for k, r in warm_rows.items()}
