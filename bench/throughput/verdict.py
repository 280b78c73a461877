"""The GPU benchmark's verdict phase: wall seconds from ``captionflow run`` to its leaderboard row, cold, with warm
caches and through warm engines (one service, checkpoints swapped), with each run's timeline read from its log."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench.throughput.flow import flow_command, layout_options
from bench.throughput.measure import ROOT, GpuSampler, commit_times, engine_stats, run_phase, save_engine_logs


# ---------------------------------------------------------------- the verdict: run start -> leaderboard row
def _verdict_images(a: argparse.Namespace) -> str:
    """The first ``--verdict-n`` images of the bench's folder, hard-linked into a folder of their own, with
    reference captions (``captions.jsonl``, ``references``) for the sequential verdict's CIDEr-D."""
    folder = Path(a.work) / f"images-{a.verdict_n}"
    files = sorted(f for f in Path(a.images).iterdir() if f.suffix != ".jsonl")[: a.verdict_n]
    if not (folder.is_dir() and len(list(folder.glob("*.jpg"))) == len(files)):
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        for f in files:
            os.link(f, folder / f.name)
    refs = "".join(json.dumps({"file_name": f.name, "captions": references(i)}) + "\n" for i, f in enumerate(files))
    (folder / "captions.jsonl").write_text(refs)
    return str(folder)


WORDS = (
    ["red", "blue", "green", "yellow", "black", "white", "brown", "grey"],
    ["dog", "cat", "horse", "bird", "car", "bus", "bicycle", "boat", "kite", "train"],
    ["stands", "sits", "runs", "waits", "rests", "lies", "plays", "parks"],
    ["grass", "road", "beach", "field", "street", "park", "snow", "lake"],
)


def references(i: int) -> list[str]:
    """Three reference captions of image ``i``, from a few templates (seeded by ``i``)."""
    import random

    c, t, v, p = (random.Random(i * 4 + k).choice(w) for k, w in enumerate(WORDS))
    return [f"a {c} {t} {v} on the {p}", f"the {c} {t} {v} near the {p}", f"a {t} that {v} by the {p}"]


def _checkpoints(a: argparse.Namespace) -> list[str]:
    """Three checkpoints of the bench's architecture with different (random) weights, one per verdict phase
    (each phase evaluates a checkpoint the golden set has not seen): the verdict loads, compiles and swaps real
    safetensors files."""
    model = Path(a.model)
    if (model / "config.json").exists() and any(model.glob("*.safetensors")) and a.model_b:
        return [str(model), a.model_b, a.model_c or a.model_b]
    device = "cuda" if a.device == "gpu" else "cpu"
    return [random_checkpoint(str(model), Path(a.work) / f"checkpoint-seed{seed}", seed, device) for seed in (0, 1, 2)]


def random_checkpoint(model: str, out: Path, seed: int, device: str) -> str:
    """A checkpoint of ``model``'s architecture with random weights of ``seed`` at ``out`` (kept when there)."""
    if not (out / "model.safetensors.index.json").exists():
        shutil.rmtree(out, ignore_errors=True)
        t0 = time.time()
        code = "import sys; from captionflow.builtin.standin import write_random_weights as w; w(*sys.argv[1:4])"
        # in a child process: no CUDA context left in this one while the phases run
        subprocess.run([sys.executable, "-c", code, model, str(out), str(seed), device], cwd=ROOT, check=True)
        print(f"random checkpoint {out} in {time.time() - t0:.0f} s", flush=True)
    return str(out)


def _flow_timed(
    a, name: str, images: str, model: str, engine_kwargs: str, env: dict, root="out-verdict", extra=()
) -> dict:
    """``captionflow run`` of ``model`` (``extra``: more options), timed: to its first and last caption and to its
    leaderboard row (the verdict), with its log's timeline."""
    out = Path(a.work) / root  # the golden set's output root: preprocessed by the first phase
    summary = Path(a.work) / f"verdict-{name}-summary.json"
    cmd = flow_command(a, images, out, model, summary, engine_kwargs) + ["--compile-cache-dir", env["CF_BENCH_CC"]]
    cmd += list(extra)
    log = Path(a.work) / f"phase-verdict-{name}.log"
    if os.environ.get("CF_BENCH_PYSPY") and re.search(os.environ.get("CF_BENCH_PYSPY_RUNS", ""), name):
        # py-spy of the run's driver (wall clock, idle threads too), samples in order; CF_BENCH_PYSPY_RUNS: of the
        # runs whose name it matches (a regular expression)
        spy = [os.environ["CF_BENCH_PYSPY"], "record", "--idle", "--threads", "-r", "100", "-f", "speedscope"]
        cmd = spy + ["-o", str(Path(a.work) / f"pyspy-verdict-{name}.json"), "--"] + cmd  # bench/pyspy_timeline.py
    t0 = time.time()
    with open(log, "w") as fh:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, env=env, timeout=a.phase_timeout)
    t1 = time.time()
    if proc.returncode != 0:
        return {"error": f"exit {proc.returncode}", "log_tail": log.read_text(errors="replace")[-4000:]}
    s = json.loads(summary.read_text())
    stamps, _, _ = commit_times(s["run_dir"])
    from captionflow.report.markdown import ROWS, row_file

    row = out / ROWS / row_file(*s["run_dir"].rstrip("/").split("/")[-3:])  # this run's own row
    text = log.read_text(errors="replace")
    res = {
        "verdict_s": round(t1 - t0, 2),
        "first_caption_after_s": round(stamps[0][0] - t0, 2) if stamps else None,
        "last_caption_after_s": round(stamps[-1][0] - t0, 2) if stamps else None,
        "leaderboard_row_after_s": round(row.stat().st_mtime - t0, 2) if row.exists() else None,
        "timeline_s": timeline(text, t0),
        "ray_data_progress": ray_data_progress(text, t0),
        "captioned": s["counts"]["captioned"],
        "engines": s.get("engines"),
        "timings_s": s.get("timings_s"),
        # captions committed in each second after the command's start: waves of requests show as bursts
        "captions_per_s": per_second(stamps, t0),
        "run_dir": s["run_dir"],
        "leaderboard_row": str(row),
    }
    seq = (s.get("metrics") or {}).get("sequential")
    if seq:  # the sequential verdict: what it decided, on how many images of the order's prefix
        keep = ("decision", "decided_by", "images_used", "images_total", "alpha", "margin", "mean_difference",
                "lower", "upper", "score", "against")  # fmt: skip
        res["sequential"] = {k: seq.get(k) for k in keep}
    if a.engine_stats:  # each engine's running and waiting requests, second by second, over the run
        res["engine_seconds"] = engine_seconds(t0, t1)
    return res


def _sequential(a, res: dict, got: dict, images: str, ckpt: str, kwargs: str, env: dict, root: str) -> dict:
    """The sequential verdict through the warm engines: checkpoint ``ckpt`` (swapped in) against a baseline whose
    captions are the golden set's first references (external captions, ``captionflow evaluate``), a difference
    planted so large that the verdict is sure long before the set ends. ``ckpt``'s captions of the set go first."""
    repeats = got.get("warm_engines_repeats") or []
    for earlier in (res.get("warm_cache") or {}, *repeats[0::2]):  # B's runs: warm_cache, the odd repeats
        if earlier.get("run_dir"):
            shutil.rmtree(earlier["run_dir"], ignore_errors=True)
            Path(earlier["leaderboard_row"]).unlink(missing_ok=True)
    baseline = _teacher(a, images, env, root)
    if isinstance(baseline, dict):
        return baseline
    seq = ["--verdict", "sequential", "--verdict-against", baseline]
    return _flow_timed(a, "warm-sequential", images, ckpt, kwargs, env, root, seq)


def _cold_pairwise(a, images: str, ckpt: str, kwargs: str, env: dict, root: str = "out-verdict-p") -> dict:
    """The sequential verdict on the pairwise judge's win, engines started for the run (no warm engines): checkpoint
    ``ckpt`` judged by itself against the teacher's captions, the judge's engines beside the captioner's
    (``judge.SequentialJudging``: half of each GPU's engines each), the captioning stopped with the verdict. The
    stand-in's random judge answers mostly by position: the pairs tie and the verdict is "equivalent" within the
    margin 0.45. Then the same checkpoint's full set (``--verdict full``, the captioning of every image and the
    pairwise judging of all of them, in turn), on a fresh output root: what the verdict spared."""
    out = {}
    for mode, folder in (("sequential", root), ("full", root + "-full")):
        shutil.rmtree(Path(a.work) / folder, ignore_errors=True)
        baseline = _teacher(a, images, env, folder)
        if isinstance(baseline, dict):
            out[mode] = baseline
            continue
        extra = ["--verdict", mode, "--pairwise-against", baseline, "--warm-engines", "off"]
        if mode == "sequential":
            extra += ["--verdict-score", "pairwise"]  # the win rate's default margin, 0.03
        out[mode] = _flow_timed(a, f"cold-pairwise-{mode}", images, ckpt, kwargs, env, folder, extra)
        summary = Path(a.work) / f"verdict-cold-pairwise-{mode}-summary.json"
        if "error" not in out[mode]:
            pair = json.loads(summary.read_text()).get("metrics", {}).get("pairwise") or {}
            out[mode]["pairwise"] = {k: pair.get(k) for k in ("judged", "failed", "wins", "losses", "ties", "seconds")}
    return out


def _teacher(a, images: str, env: dict, root: str):
    """The baseline of the sequential verdicts: the golden set's first references as external captions
    (``captionflow evaluate``) under the output root ``root``; its run folder, or the error (a dict)."""
    rows = [json.loads(x) for x in Path(images, "captions.jsonl").read_text().splitlines()]
    return external_captions(a, images, [{"file_name": r["file_name"], "caption": r["captions"][0]} for r in rows],
                             "teacher", root, env)  # fmt: skip


def external_captions(a, images: str, rows: list[dict], name: str, root: str, env: dict):
    """``rows`` (file name, caption) imported as external captions named ``name`` (``captionflow evaluate``) under
    the output root ``root``; their run folder, or the error (a dict)."""
    captions = Path(a.work) / f"{name}.jsonl"
    captions.write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = Path(a.work) / f"verdict-{name}-summary.json"
    cmd = [sys.executable, "-m", "flows.cli", "evaluate", str(captions), "--name", name, "--dataset", images]
    cmd += ["--output", str(Path(a.work) / root), "--summary-json", str(summary)]
    cmd += ["--max-image-side", str(a.max_image_side)]  # the golden set as the runs preprocess it: the same dataset
    log = Path(a.work) / f"phase-verdict-{name}.log"
    with open(log, "w") as fh:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, env=env, timeout=a.phase_timeout)
    if proc.returncode != 0:
        return {"error": f"{name}: exit {proc.returncode}", "log_tail": log.read_text(errors="replace")[-4000:]}
    return json.loads(summary.read_text())["run_dir"]


def per_second(stamps: list[tuple[float, int]], t0: float) -> list[int]:
    """Rows of ``stamps`` ((time, rows) of each commit) in each whole second after ``t0``, up to the last."""
    if not stamps:
        return []
    counts = [0] * (int(stamps[-1][0] - t0) + 1)
    for t, rows in stamps:
        counts[max(0, int(t - t0))] += rows
    return counts


def engine_seconds(t0: float, t1: float, ray_tmp: str = "/tmp/ray") -> list[dict]:
    """``engine_stats`` over a run (``t0`` to ``t1``), per engine: [seconds after t0, running, waiting, generated
    tokens/s] each. The lines come in bursts (several stamped with one second): read them for the counts."""
    return [
        {"log": name, "seconds": [[round(t - t0), running, waiting, round(tps)] for t, tps, running, waiting in rows]}
        for name, rows in engine_stats(t0 - 1, t1 + 1, ray_tmp).items()
    ]


# what a run's log says, by the first line that says it (Prefect's console lines carry the local time of day,
# Ray's the local date and time)
DAY_TIME = r"^(\d\d:\d\d:\d\d\.\d+) \| INFO "  # Prefect
DATE_TIME = r"^\S* ?(\d\d\d\d-\d\d-\d\d \d\d:\d\d:\d\d,\d+)\s+INFO "  # Ray
TIMELINE = {
    "flow_begins": re.compile(DAY_TIME + r".*Beginning flow run"),
    "preflight_done": re.compile(DAY_TIME + r".*Task run 'preflight-.*Finished"),
    "preprocess_done": re.compile(DAY_TIME + r".*Task run 'preprocess-.*Finished"),
    "warm_engines_loaded": re.compile(DAY_TIME + r".*warm engines: .* loaded into .* and checked"),
    "dataset_starts": re.compile(DATE_TIME + r".*Starting execution of Dataset"),
    # a warm run's driver handing its requests to the service (service/feed.py: GATE, FIRST_BACK)
    "warm_first_block_built": re.compile(DAY_TIME + r".*warm engines: first block of requests built"),
    "warm_gate_open": re.compile(DAY_TIME + r".*warm engines: the run's checkpoint is in the engines"),
    "warm_first_batch_back": re.compile(DAY_TIME + r".*warm engines: first block back"),
    "first_row_in_driver": re.compile(DAY_TIME + r".*inference: captioned \d+/"),
    "dataset_ends": re.compile(DATE_TIME + r".*Dataset .* execution finished"),
    "flow_ends": re.compile(DAY_TIME + r".*Flow run .* Finished in state"),
}
TIMELINE_LAST = {"warm_engines_loaded"}  # said once per engine: when the last one says it


def ray_stamp(stamp: str) -> float:
    """Unix time of a Ray log line's local date and time (``DATE_TIME``)."""
    import datetime as dt

    return dt.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def timeline(text: str, t0: float) -> dict:
    """Seconds after ``t0`` (the command's start) at which the run's log first says each of ``TIMELINE`` (last,
    for ``TIMELINE_LAST``)."""
    import datetime as dt

    day = dt.date.fromtimestamp(t0)
    out: dict = {}
    for line in text.splitlines():
        for key, pattern in TIMELINE.items():
            if key in out and key not in TIMELINE_LAST:
                continue
            m = pattern.search(line)
            if not m:
                continue
            stamp = m.group(1)
            if "-" in stamp:
                when = ray_stamp(stamp)
            else:
                when = dt.datetime.combine(day, dt.time.fromisoformat(stamp)).timestamp()
                if when < t0 - 3600:  # past midnight
                    when += 86400
            out[key] = round(when - t0, 2)
    return dict(sorted(out.items(), key=lambda kv: kv[1]))


RAY_DATA_SNAPSHOT = re.compile(DATE_TIME + r".*-- ======= Running Dataset: (\S+) =======")
RAY_DATA_OP = re.compile(r"-- (\S.*): (\d+)/(\d+)$")
RAY_DATA_TASKS = re.compile(r"--   Tasks: (\d+)( \[[^\]]*\])?; Actors: (\d+)[^;]*; Queued blocks: (\d+)")


def ray_data_progress(text: str, t0: float, limit: int = 12) -> list[dict]:
    """Ray Data's progress reports (every 10 s) of the run's last dataset (the captioning one), compact: seconds
    after ``t0``, then per operator "done/total, tasks running [why held back], actors, blocks queued"."""
    snaps: list[dict] = []
    op = None
    for line in text.splitlines():
        m = RAY_DATA_SNAPSHOT.search(line)
        if m:
            when = ray_stamp(m.group(1))
            snaps.append({"dataset": m.group(2), "t": round(when - t0, 1), "ops": {}})
            op = None
            continue
        if not snaps:
            continue
        m = RAY_DATA_OP.search(line)
        if m and "Total Progress" not in line:
            op = m.group(1)
            snaps[-1]["ops"][op] = f"{m.group(2)}/{m.group(3)}"
            continue
        m = RAY_DATA_TASKS.search(line)
        if m and op:
            held = (m.group(2) or "").strip()
            snaps[-1]["ops"][op] += (
                f", tasks {m.group(1)}{' ' + held if held else ''}, actors {m.group(3)}, queued {m.group(4)}"
            )
            op = None
    last = snaps[-1]["dataset"] if snaps else None
    return [{"t": x["t"], **x["ops"]} for x in snaps if x["dataset"] == last][:limit]


def _stop(proc: subprocess.Popen, wait_s: float) -> None:
    """SIGTERM, then SIGKILL if it has not ended within ``wait_s``."""
    proc.terminate()
    try:
        proc.wait(wait_s)
    except subprocess.TimeoutExpired:
        proc.kill()


@contextlib.contextmanager
def prefect_server(a: argparse.Namespace):
    """A Prefect server for the verdict's runs, as a deployment's runs have one (``--prefect ephemeral``: none,
    each ``captionflow run`` starts Prefect's temporary server of its own). Yields its API URL, or None."""
    if a.prefect == "ephemeral":
        yield None
        return
    import socket
    import urllib.request

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    home = Path(a.work) / "prefect-home"
    shutil.rmtree(home, ignore_errors=True)
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env.pop("PREFECT_API_URL", None)
    log = open(Path(a.work) / "prefect-server.log", "w")  # noqa: SIM115 - closed below
    cmd = [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)]
    server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/api"
    try:
        deadline = time.time() + 180
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if server.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"the Prefect server did not start: {Path(log.name).read_text()[-2000:]}")
            time.sleep(1)
        yield url
    finally:
        _stop(server, 60)
        log.close()


def verdict(a: argparse.Namespace, sampler: GpuSampler) -> dict:
    """Wall seconds from ``captionflow run`` to its leaderboard row, ``--verdict-n`` images: cold (empty
    compile caches), a new checkpoint at a new path with the caches warm, a new checkpoint through warm
    engines (hot swap; the service started beforehand, its start reported apart), and the raw script's wall
    time on the same images, start-up included. The runs report to a Prefect server started once before the
    phases, as a deployment's runs do (``--prefect ephemeral``: each run starts a temporary one)."""
    with prefect_server(a) as api:
        res = _verdict(a, sampler, {"PREFECT_API_URL": api} if api else {})
    res["prefect"] = "server" if a.prefect == "server" else "ephemeral (one per run)"
    return res


def _verdict(a: argparse.Namespace, sampler: GpuSampler, prefect_env: dict) -> dict:
    images = _verdict_images(a)
    ckpt_a, ckpt_b, ckpt_c = _checkpoints(a)
    for root in ("out-verdict", "out-verdict-c"):
        shutil.rmtree(Path(a.work) / root, ignore_errors=True)
    kwargs = json.dumps({k: v for k, v in json.loads(a.engine_kwargs).items() if k != "load_format"})
    cc = Path(a.work) / "compile-cache"
    shutil.rmtree(cc, ignore_errors=True)
    env = {
        **os.environ,
        "CF_BENCH_CC": str(cc),
        # every compile cache of the engines under one folder, so that "cold" empties them all
        "TORCHINDUCTOR_CACHE_DIR": str(cc / "inductor"),
        "TRITON_CACHE_DIR": str(cc / "triton"),
        "CAPTIONFLOW_CACHE": str(Path(a.work) / "cf-cache"),  # its own service file
        **prefect_env,
    }
    res: dict = {"n": len(list(Path(images).iterdir())), "checkpoints": [ckpt_a, ckpt_b, ckpt_c]}
    todo = set(a.verdict_phases.split(","))
    if "cold" in todo:
        res["cold"] = _flow_timed(a, "cold", images, ckpt_a, kwargs, env)
        save_engine_logs(Path(a.work) / "phase-verdict-cold-engines.log")  # the run's own Ray: the newest
        (Path(a.work) / "verdict-partial.json").write_text(json.dumps(res, indent=2))
    if "warm_cache" in todo:
        res["warm_cache"] = _flow_timed(a, "warm-cache", images, ckpt_b, kwargs, env)
    if "cold_pairwise" in todo:
        res["cold_pairwise"] = _cold_pairwise(a, images, ckpt_b, kwargs, env)
    if "warm_engines" in todo:
        _warm_engines(a, res, images, ckpt_a, ckpt_c, kwargs, env, cc)
    if "warm_pairwise" in todo:
        res["warm_pairwise"] = _warm_pairwise(a, images, ckpt_a, ckpt_b, kwargs, env, cc)
        (Path(a.work) / "verdict-partial.json").write_text(json.dumps(res, indent=2))
    if "noise" in todo:
        from bench.throughput.noise import noise

        res["noise"] = noise(a, images, [ckpt_a, ckpt_b], kwargs, env, cc)
        (Path(a.work) / "verdict-partial.json").write_text(json.dumps(res, indent=2))
    raw = {}
    if "raw" in todo:
        args = argparse.Namespace(
            **{**vars(a), "images": images, "model": ckpt_a, "engine_kwargs": kwargs, "ceiling": False}
        )
        raw = run_phase("raw", args, sampler)
        keep = ("wall_s", "import_s", "engine_start_s", "images_per_s", "error", "log_tail")
        res["raw"] = {k: raw.get(k) for k in keep}
    # the verdict: run start to its leaderboard row (the answer is known then); the command's exit after it is
    # each phase's verdict_s
    res["summary"] = {
        "cold_s": res.get("cold", {}).get("leaderboard_row_after_s"),
        "warm_cache_s": res.get("warm_cache", {}).get("leaderboard_row_after_s"),
        "warm_engines_s": res.get("warm_engines", {}).get("leaderboard_row_after_s"),
        "warm_engines_repeats_s": [r.get("leaderboard_row_after_s") for r in res.get("warm_engines_repeats", [])],
        "warm_sequential_s": res.get("warm_sequential", {}).get("leaderboard_row_after_s"),
        "warm_sequential_images_used": (res.get("warm_sequential", {}).get("sequential") or {}).get("images_used"),
        "cold_pairwise_s": {
            k: v.get("leaderboard_row_after_s") for k, v in (res.get("cold_pairwise") or {}).items() if "error" not in v
        },
        "cold_pairwise_captioned": {k: v.get("captioned") for k, v in (res.get("cold_pairwise") or {}).items()},
        "warm_pairwise_s": res.get("warm_pairwise", {}).get("leaderboard_row_after_s"),
        "warm_pairwise_captioned": res.get("warm_pairwise", {}).get("captioned"),
        "noise": (res.get("noise") or {}).get("summary"),
        "raw_wall_s": raw.get("wall_s"),
        "exit_s": {k: res[k].get("verdict_s") for k in ("cold", "warm_cache", "warm_engines") if k in res},
    }
    return res


def _warm_engines(a, res: dict, images: str, ckpt_a: str, ckpt_c: str, kwargs: str, env: dict, cc: Path) -> None:
    """A service on checkpoint A, then a run of checkpoint C (swapped in); with ``--warm-layouts``, that for each
    engine layout in turn (the first gives ``warm_engines``, every one ``warm_layouts``), C's captions removed
    between them so that each layout captions the whole set."""
    layouts = json.loads(a.warm_layouts) if a.warm_layouts else [{"name": "as given"}]
    for i, layout in enumerate(layouts):
        la = argparse.Namespace(
            **{
                **vars(a),
                "engines_per_gpu": layout.get("engines_per_gpu", a.engines_per_gpu),
                "pipeline_config": json.dumps({**json.loads(a.pipeline_config), **layout.get("pipeline_config", {})}),
            }
        )
        lkwargs = json.dumps({**json.loads(kwargs), **layout.get("engine_kwargs", {})})
        got = _warm_layout(la, res, images, ckpt_a, ckpt_c, lkwargs, env, cc, suffix="" if i == 0 else f"-{i}")
        if i == 0:
            keep = (
                "service_start_s",
                "warm_engines",
                "warm_engines_a_first",
                "warm_engines_repeats",
                "warm_sequential",
            )
            res.update({k: got[k] for k in keep if k in got})
        if a.warm_layouts:
            res.setdefault("warm_layouts", []).append({"layout": layout, **got})
        # what is done so far, should the lease end before the phase does
        (Path(a.work) / "verdict-partial.json").write_text(json.dumps(res, indent=2))
        done = got.get("warm_engines") or {}
        if done.get("run_dir"):  # the next layout captions C again
            shutil.rmtree(done["run_dir"], ignore_errors=True)
            Path(done["leaderboard_row"]).unlink(missing_ok=True)


@contextlib.contextmanager
def _service(a, ckpt: str, kwargs: str, env: dict, cc: Path, name: str, extra=()):
    """``captionflow serve`` of ``ckpt`` (``extra``: more options) for the phases' runs: yields the seconds it took
    to be ready, or the error (a dict); stopped after them."""
    serve_log = Path(a.work) / f"phase-verdict-{name}.log"
    serve_cmd = [sys.executable, "-m", "flows.cli", "serve", "--model", ckpt, "--device", a.device]
    serve_cmd += ["--max-pixels", str(a.max_pixels), "--max-image-side", str(a.max_image_side)]
    serve_cmd += ["--engine-kwargs", kwargs, "--compile-cache-dir", str(cc), "--idle-timeout", "900"]
    serve_cmd += ["--cuda-mps", a.cuda_mps] + layout_options(a) + list(extra)
    t0 = time.time()
    with open(serve_log, "w") as fh:
        server = subprocess.Popen(serve_cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, env=env)
    try:
        while "warm engines ready" not in serve_log.read_text(errors="replace"):
            if server.poll() is not None or time.time() - t0 > a.phase_timeout:
                yield {"error": "the service did not start", "log_tail": serve_log.read_text()[-4000:]}
                return
            time.sleep(1)
        yield round(time.time() - t0, 2)
        save_engine_logs(Path(a.work) / f"phase-verdict-{name}-engines.log")  # the service's Ray
    finally:
        _stop(server, 120)


def _warm_pairwise(a, images: str, ckpt_a: str, ckpt_b: str, kwargs: str, env: dict, cc: Path) -> dict:
    """The sequential verdict on the pairwise judge's win through warm engines: a service on checkpoint ``ckpt_a``
    that keeps the judge's engines too (``ckpt_a`` judges; half of each GPU's engines each), then a run of
    ``ckpt_b`` (swapped into the captioner's engines) against the teacher's captions, each caption judged as it is
    made (``feed.WarmRows.then``) and the captioning stopped with the verdict ("equivalent" within the win rate's
    default margin, 0.03: the stand-in's random judge ties most pairs, as in ``_cold_pairwise``)."""
    root = "out-verdict-wp"
    shutil.rmtree(Path(a.work) / root, ignore_errors=True)
    baseline = _teacher(a, images, env, root)
    if isinstance(baseline, dict):
        return baseline
    judge = ["--judge-model", ckpt_a, "--pairwise-against", baseline]
    with _service(a, ckpt_a, kwargs, env, cc, "serve-pairwise", judge) as started:
        if isinstance(started, dict):
            return started
        extra = [*judge, "--verdict", "sequential", "--verdict-score", "pairwise"]  # the default margin, 0.03
        got = _flow_timed(a, "warm-pairwise", images, ckpt_b, kwargs, env, root, [*extra, "--warm-engines", "require"])
        return {"service_start_s": started, **got}


def _warm_layout(a, res: dict, images: str, ckpt_a: str, ckpt_c: str, kwargs: str, env: dict, cc: Path, suffix: str):
    got: dict = {}
    with _service(a, ckpt_a, kwargs, env, cc, f"serve{suffix}") as started:
        if isinstance(started, dict):
            got["warm_engines"] = started
        else:
            got["service_start_s"] = started
            if "cold" not in res and "warm_cache" not in res and "warm_engines" not in res:
                # nothing preprocessed the golden set yet: a run of the loaded checkpoint A does (no swap)
                got["warm_engines_a_first"] = _flow_timed(a, "warm-engines-a", images, ckpt_a, kwargs, env)
            # a checkpoint the golden set has not seen (else its captions are already committed there)
            root = "out-verdict" if ckpt_c not in res["checkpoints"][:2] else "out-verdict-c"
            got["warm_engines"] = _flow_timed(a, f"warm-engines{suffix}", images, ckpt_c, kwargs, env, root)
            last = got["warm_engines"]
            for r in range(1, a.warm_repeats + 1):  # B, C, B, ...: each a swap; the checkpoint's captions go first
                if last.get("run_dir"):
                    shutil.rmtree(last["run_dir"], ignore_errors=True)
                    Path(last["leaderboard_row"]).unlink(missing_ok=True)
                ckpt = res["checkpoints"][1] if r % 2 else ckpt_c
                last = _flow_timed(a, f"warm-engines{suffix}-r{r}", images, ckpt, kwargs, env, root)
                got.setdefault("warm_engines_repeats", []).append(last)
                (Path(a.work) / "verdict-partial.json").write_text(json.dumps({**res, **got}, indent=2))
            if "warm_sequential" in a.verdict_phases.split(","):
                got["warm_sequential"] = _sequential(a, res, got, images, res["checkpoints"][1], kwargs, env, root)
                (Path(a.work) / "verdict-partial.json").write_text(json.dumps({**res, **got}, indent=2))
    return got
