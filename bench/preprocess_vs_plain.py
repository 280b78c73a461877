"""Benchmark: ingest + preprocess (streaming Ray Data) vs. a plain single-process PIL loop.

Both do the same work per image: read, decode, check, normalise (RGB, EXIF, bound the long side
to 448 px), JPEG-encode. The plain loop runs before and after the pipeline; the baseline is the
mean of the two (this VM's speed drifts within minutes). Each side runs in its own subprocess so that
its peak memory is its own (the pipeline's is the sum over the driver and every Ray process, sampled
every 0.5 s). The pipeline side also records when the first batch of results reaches the stage's driver loop
(``first_result_s``: Ray Data's and the workers' start-up plus one task) and the rate after it.

    python bench/preprocess_vs_plain.py --n 2000 20000 [--warm]

``--warm`` runs the pipeline a second time in the same Ray session (Ray Data's helper actors are
detached and stay up, as on a long-lived cluster) and reports it apart; the ratio and peak RSS of
the table stay those of the first, cold run.
Prints a short table; writes JSON (default bench/results/preprocess_vs_plain-cpu.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


_CPU_SEEN: dict[int, tuple[str, float, int]] = {}  # pid -> (name, CPU seconds, minor page faults) when last sampled


def _tree_rss_sampler(stop: threading.Event, peak: list[int]) -> None:
    """Every 0.5 s: the summed RSS of this process and its descendants (peak kept in ``peak[0]``, this
    process's own in ``peak[1]``: the driver's share, which grows with the number of inputs), and each one's
    CPU time so far, so that a process that exits before the end (Ray Data's actors do, when their
    pool shuts down) still counts up to its last sample."""
    import psutil

    me = psutil.Process()
    while not stop.is_set():
        total = 0
        for p in [me] + me.children(recursive=True):
            try:
                rss = p.memory_info().rss
                total += rss
                if p is me:
                    peak[1] = max(peak[1], rss)
                _CPU_SEEN[p.pid] = _cpu_of(p, me)
            except (psutil.Error, OSError):
                pass
        peak[0] = max(peak[0], total)
        time.sleep(0.5)  # one pass costs ~4 ms of this process's CPU with ~15 Ray processes


def _cpu_of(p, me) -> tuple[str, float, int]:
    t = p.cpu_times()
    name = "driver" if p.pid == me.pid else p.name()
    if name.startswith("ray::"):  # workers are named after what they run now
        name = "map workers" if "MapWorker" in name else "ray worker"  # the stage's actor pool vs. others
    with open(f"/proc/{p.pid}/stat") as f:  # minflt: the 10th field (Linux)
        minflt = int(f.read().rsplit(")", 1)[1].split()[7])
    return name, t.user + t.system, minflt


def _cpu_by_process() -> dict[int, tuple[str, float, int]]:
    """CPU seconds (user + system) so far of this process and every descendant, by pid, with a short
    name; processes gone since the sampler saw them count with their last sample."""
    import psutil

    me = psutil.Process()
    out = dict(_CPU_SEEN)
    for p in [me] + me.children(recursive=True):
        try:
            out[p.pid] = _cpu_of(p, me)
        except (psutil.Error, OSError):
            pass
    return out


def _cpu_delta(before: dict, after: dict) -> dict[str, float]:
    """CPU seconds spent between two snapshots, summed by process name."""
    spent: dict[str, float] = {}
    for pid, (name, secs, _) in after.items():
        spent[name] = spent.get(name, 0.0) + secs - before.get(pid, (name, 0.0, 0))[1]
    return {k: round(v, 2) for k, v in sorted(spent.items(), key=lambda kv: -kv[1]) if v >= 0.05}


def _map_worker_faults(before: dict, after: dict) -> int:
    """Minor page faults of the stage's actor pool between two snapshots."""
    return sum(
        flt - before.get(pid, (name, 0.0, 0))[2] for pid, (name, _, flt) in after.items() if name == "map workers"
    )


def side_plain(images: str) -> dict:
    import resource

    from captionflow.workers.images import Rejected, normalise_image

    files = sorted(Path(images).iterdir())
    t0, c0, f0 = time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    ok = 0
    for f in files:
        try:
            normalise_image(f.read_bytes(), 448)
            ok += 1
        except Rejected:
            pass
    return {
        "seconds": time.perf_counter() - t0,
        "images": len(files),
        "accepted": ok,
        "cores": 1,
        "cpu_s_total": round(time.process_time() - c0, 1),
        "page_faults_per_image": round((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / len(files), 1),
    }


def side_pipeline(images: str, out: str, warm: bool = False, peak: list | None = None) -> dict:
    import ray.data

    from captionflow.config import RunConfig
    from captionflow.data.sources import ingest
    from captionflow.engines.session import ray_session
    from captionflow.stages.preprocess import preprocess

    cfg = RunConfig(dataset=images, output=out, device="cpu")
    t0 = time.perf_counter()
    ray_session(cfg)
    t_ray = time.perf_counter() - t0
    # when each batch of results reaches the stage's driver loop: start-up vs. steady rate
    arrivals: list[tuple[float, int]] = []
    iter_batches = ray.data.Dataset.iter_batches

    def timed_iter_batches(self, *args, **kwargs):
        for batch in iter_batches(self, *args, **kwargs):
            arrivals.append((time.perf_counter(), batch.num_rows))
            yield batch

    ray.data.Dataset.iter_batches = timed_iter_batches
    cpu0 = _cpu_by_process()
    t1 = time.perf_counter()
    m = preprocess(ingest(cfg), cfg)
    seconds = time.perf_counter() - t1
    cpu1 = _cpu_by_process()
    cpu_s = _cpu_delta(cpu0, cpu1)
    cores = os.cpu_count()
    after_first = sum(n for _, n in arrivals[1:]) / max(1e-9, arrivals[-1][0] - arrivals[0][0]) / cores
    result = {
        "seconds": seconds,
        "ray_init_s": t_ray,
        "images": m.counts.listed,
        "accepted": m.counts.accepted,
        "cores": cores,
        "first_result_s": round(arrivals[0][0] - t1, 2),
        "first_batch_rows": arrivals[0][1],
        "img_s_per_core_after_first_result": round(after_first, 1),
        "cpu_s_by_process": cpu_s,
        "cpu_s_total": round(sum(cpu_s.values()), 1),
        "page_faults_per_image_map_workers": round(_map_worker_faults(cpu0, cpu1) / m.counts.listed, 1),
    }
    if warm:  # the same again in this Ray session (Ray Data's helper actors already up), fresh output root
        result["peak_rss_mb_first_run"] = peak[0] / 2**20
        result["driver_peak_rss_mb_first_run"] = peak[1] / 2**20
        arrivals.clear()
        cpu0 = _cpu_by_process()
        t1 = time.perf_counter()
        m = preprocess(
            ingest(cfg.model_copy(update={"output": out + "-warm"})), cfg.model_copy(update={"output": out + "-warm"})
        )
        warm_s = time.perf_counter() - t1
        cpu_s = _cpu_delta(cpu0, _cpu_by_process())
        result["warm"] = {
            "seconds": warm_s,
            "img_s_per_core": round(m.counts.listed / warm_s / cores, 1),
            "first_result_s": round(arrivals[0][0] - t1, 2),
            "cpu_s_by_process": cpu_s,
        }
    return result


def run_side(side: str, images: str, out: str, warm: bool = False) -> dict:
    code = (
        f"import json,sys,threading; sys.path.insert(0,{str(ROOT)!r}); import bench.preprocess_vs_plain as b;"
        "stop=threading.Event(); peak=[0, 0];"
        "t=threading.Thread(target=b._tree_rss_sampler,args=(stop,peak),daemon=True);"
        f"t.start(); r=b.side_{side}({images!r}" + (f",{out!r},{warm!r},peak" if side == "pipeline" else "") + ");"
        "stop.set(); t.join(); r['peak_rss_mb']=peak[0]/2**20; r['driver_peak_rss_mb']=peak[1]/2**20;"
        "print('RESULT'+json.dumps(r))"
    )
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT")), None)
    if line is None:
        raise RuntimeError(f"{side} failed:\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")
    return json.loads(line[6:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, nargs="+", default=[2000, 20000])
    ap.add_argument(
        "--warm",
        action="store_true",
        help="also run the pipeline a second time in the same Ray session (reported apart as 'warm')",
    )
    ap.add_argument("--json", default=str(ROOT / "bench" / "results" / "preprocess_vs_plain-cpu.json"))
    args = ap.parse_args()
    from captionflow.builtin.synthetic import make_images

    results = {"host": platform.node(), "cpus": os.cpu_count(), "runs": []}
    for n in args.n:
        work = Path(tempfile.mkdtemp(prefix=f"cf-pre-{n}-"))
        t = time.perf_counter()
        make_images(work / "images", n)
        gen_s = time.perf_counter() - t
        # The plain loop runs before and after the pipeline and its mean is the baseline: this VM's
        # speed drifts by 15-20% within minutes, and a single plain run put the ratio anywhere in that band.
        plain = run_side("plain", str(work / "images"), "")
        pipe = run_side("pipeline", str(work / "images"), str(work / "out"), args.warm)
        plain_after = run_side("plain", str(work / "images"), "")
        rates = [p["images"] / p["seconds"] for p in (plain, plain_after)]
        row = {
            "n": n,
            "generate_s": round(gen_s, 1),
            "plain_img_s_per_core": round(sum(rates) / 2, 1),
            "plain_img_s_before_after": [round(r, 1) for r in rates],
            "pipeline_img_s_per_core": round(pipe["images"] / pipe["seconds"] / pipe["cores"], 1),
            "pipeline_img_s_per_core_incl_ray_start": round(
                pipe["images"] / (pipe["seconds"] + pipe["ray_init_s"]) / pipe["cores"], 1
            ),
            "plain_peak_rss_mb": round(max(plain["peak_rss_mb"], plain_after["peak_rss_mb"])),
            "pipeline_peak_rss_mb": round(pipe.get("peak_rss_mb_first_run", pipe["peak_rss_mb"])),
            "driver_peak_rss_mb": round(pipe.get("driver_peak_rss_mb_first_run", pipe["driver_peak_rss_mb"])),
            "plain": plain,
            "plain_after": plain_after,
            "pipeline": pipe,
        }
        row["ratio_per_core"] = round(row["pipeline_img_s_per_core"] / row["plain_img_s_per_core"], 3)
        if "warm" in pipe:
            row["warm_ratio_per_core"] = round(pipe["warm"]["img_s_per_core"] / row["plain_img_s_per_core"], 3)
        results["runs"].append(row)
    if len(results["runs"]) >= 2:
        first, last = results["runs"][0], results["runs"][-1]
        results["rss_ratio_largest_vs_smallest"] = round(
            last["pipeline_peak_rss_mb"] / first["pipeline_peak_rss_mb"], 3
        )
        # what the driver holds per input (listing, work items, duplicate map): its peak's growth per input
        results["driver_rss_kb_per_input"] = round(
            (last["driver_peak_rss_mb"] - first["driver_peak_rss_mb"]) * 1024 / max(1, last["n"] - first["n"]), 2
        )
    print(
        f"{'N':>7} {'plain img/s/core':>17} {'pipeline img/s/core':>20} {'ratio':>6} {'plain RSS MB':>13}"
        f" {'pipeline RSS MB':>16} {'first result s':>15} {'after it img/s/core':>20}"
    )
    for r in results["runs"]:
        print(
            f"{r['n']:>7} {r['plain_img_s_per_core']:>17} {r['pipeline_img_s_per_core']:>20} {r['ratio_per_core']:>6}"
            f" {r['plain_peak_rss_mb']:>13} {r['pipeline_peak_rss_mb']:>16} {r['pipeline']['first_result_s']:>15}"
            f" {r['pipeline']['img_s_per_core_after_first_result']:>20}"
        )
    for r in results["runs"]:
        if "warm_ratio_per_core" in r:
            print(
                f"N={r['n']} again in the same Ray session: {r['pipeline']['warm']['img_s_per_core']} img/s/core,"
                f" ratio {r['warm_ratio_per_core']}, first result {r['pipeline']['warm']['first_result_s']} s"
            )
    for r in results["runs"]:
        print(
            f"N={r['n']} minor page faults per image: plain {r['plain']['page_faults_per_image']},"
            f" pipeline's actor pool {r['pipeline']['page_faults_per_image_map_workers']}"
        )
    if "rss_ratio_largest_vs_smallest" in results:
        print(
            "pipeline peak RSS, largest N / smallest N:",
            results["rss_ratio_largest_vs_smallest"],
            f"; the driver's peak grows {results['driver_rss_kb_per_input']} KB per input",
        )
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    print("wrote", args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
