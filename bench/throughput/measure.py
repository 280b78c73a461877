"""How the GPU benchmark measures: GPU and host sampling through NVML, rates from result times, and what the
engines' and the flow's logs say (when each engine was ready and accepting, per-engine batches, engine statistics)."""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SEED_IMAGES_PER_S_PER_GPU = 6.3  # the seeds' headline (issue #7): 12.6 images/s on 2 GPUs, Qwen2.5-VL-3B

SYSTEM_PROMPT = "You are a helpful assistant that writes short, factual image captions."
PROMPT = "Describe this image in one sentence."


# ---------------------------------------------------------------- GPU sampling (this process)
def visible_gpus(nvml) -> list[tuple[int, object]]:
    """(NVML index, handle) of each GPU this process's CUDA programs may use: ``CUDA_VISIBLE_DEVICES`` (indices or
    UUIDs) where set, else every GPU NVML sees. NVML itself ignores that variable, so a sampler that averaged every
    GPU on a 4-GPU host read a one-GPU run as ~23% busy while its GPU was ~90% busy."""
    count = nvml.nvmlDeviceGetCount()
    everyone = [(i, nvml.nvmlDeviceGetHandleByIndex(i)) for i in range(count)]
    spec = os.environ.get("CUDA_VISIBLE_DEVICES")
    if spec is None:
        return everyone
    chosen = []
    for item in (x.strip() for x in spec.split(",")):
        if not item:
            continue
        if item.isdigit():
            if int(item) >= count:
                break  # CUDA stops at the first invalid entry
            chosen.append(everyone[int(item)])
            continue
        found = [(i, h) for i, h in everyone if str(nvml.nvmlDeviceGetUUID(h)).startswith(item)]
        if not found:
            break
        chosen.append(found[0])
    return chosen


def process_label(name: str, cmdline: list[str]) -> str:
    """What a process is, for the CPU profile: Ray's and vLLM's process titles (``ray::Actor.method``,
    ``VLLM::EngineCore``) without their arguments, else the executable's name (a Python driver: its script)."""
    first = cmdline[0] if cmdline else name
    if first.startswith(("ray::", "VLLM::")):
        return first.split()[0][:60]
    if name.startswith("python") and "-c" in cmdline:
        return "python -c"
    if name.startswith("python") and len(cmdline) > 1:
        script = next((c for c in cmdline[1:] if not c.startswith("-")), "")
        return f"python {Path(script).name or script}"[:60]
    return name[:60]


def process_cpu_snapshot() -> dict[int, tuple[str, float]]:
    """Every process's label and CPU seconds (user + system) so far."""
    import psutil

    snap = {}
    for p in psutil.process_iter(["pid", "name", "cmdline", "cpu_times"]):
        try:
            times = p.info["cpu_times"]
            if times is None:
                continue
            label = process_label(p.info["name"] or "", p.info["cmdline"] or [])
            snap[p.info["pid"]] = (label, times.user + times.system)
        except Exception:
            continue
    return snap


def cpu_by_process(before: tuple[float, dict], after: tuple[float, dict], top: int = 12) -> list[dict]:
    """Cores each kind of process used between two snapshots (CPU seconds / wall seconds), the busiest first, under
    its label at the second (a Ray worker's title changes when it takes an actor); a process that started in between
    counts from zero."""
    (t0, a), (t1, b) = before, after
    cores: dict[str, list] = {}
    for pid, (label, sec) in b.items():
        prev = a.get(pid)
        used = sec - prev[1] if prev else sec
        entry = cores.setdefault(label, [0.0, 0])
        entry[0] += max(used, 0.0)
        entry[1] += 1
    dt = max(t1 - t0, 1e-9)
    ranked = sorted(cores.items(), key=lambda kv: -kv[1][0])[:top]
    return [{"process": k, "count": n, "cores": round(v / dt, 2)} for k, (v, n) in ranked if v / dt >= 0.05]


class GpuSampler:
    """Samples utilisation (%) and memory used (bytes) of each visible GPU (``visible_gpus``), and the host's CPU
    busy %, every ``period`` seconds, and every process's CPU time every ``process_period`` seconds. Figures are per
    GPU (``per_gpu``) and their mean (busy) or sum (memory); ``cpu_by_process``: cores per kind of process."""

    def __init__(self, period: float = 0.25, process_period: float = 2.0):
        import psutil

        self._cpu = psutil.cpu_percent
        self._cpu(None)
        self.period, self.samples, self._stop = period, [], threading.Event()
        self.process_period, self.processes = process_period, []  # [(time, process_cpu_snapshot())]
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            gpus = visible_gpus(pynvml)
            self.indices = [i for i, _ in gpus]
            self._handles = [h for _, h in gpus]
            self.names = [pynvml.nvmlDeviceGetName(h) for h in self._handles]
        except Exception as e:  # no NVML: no utilisation figures, the benchmark still runs
            self._nvml, self._handles, self.indices, self.names = None, [], [], [f"no NVML: {e}"]
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            t = time.time()
            if self._nvml and self._handles:
                util = [self._nvml.nvmlDeviceGetUtilizationRates(h).gpu for h in self._handles]
                mem = [self._nvml.nvmlDeviceGetMemoryInfo(h).used for h in self._handles]
                self.samples.append((t, sum(util) / len(util), sum(mem), self._cpu(None), util, mem))
            else:
                self.samples.append((t, None, None, self._cpu(None), [], []))
            if not self.processes or t - self.processes[-1][0] >= self.process_period:
                self.processes.append((t, process_cpu_snapshot()))
            self._stop.wait(self.period)

    def _snapshot_near(self, t: float):
        return min(self.processes, key=lambda x: abs(x[0] - t)) if self.processes else None

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def trace(self, t0: float, t1: float, step: float = 1.0) -> list[list[float]]:
        """[seconds since t0, GPU busy %, GPU memory GiB, host CPU busy %], one row per ``step`` seconds
        (means over the samples in each step): the phase's utilisation over time, for the JSON."""
        rows: dict[int, list] = {}
        for t, util, mem, cpu, *_ in self.samples:
            if t0 <= t <= t1 and util is not None:
                rows.setdefault(int((t - t0) // step), []).append((util, mem, cpu))
        return [
            [
                round(k * step, 1),
                round(sum(x[0] for x in v) / len(v), 1),
                round(max(x[1] for x in v) / 2**30, 2),
                round(sum(x[2] for x in v) / len(v), 1),
            ]
            for k, v in sorted(rows.items())
        ]

    def window(self, t0: float, t1: float) -> dict:
        s = [x for x in self.samples if t0 <= x[0] <= t1]
        if not s:
            return {"gpu_busy_pct": None, "gpu_mem_peak_gib": None, "host_cpu_busy_pct": None, "samples": 0}
        gpu = s[0][1] is not None
        per_gpu = [
            {
                "gpu": index,
                "busy_pct": round(sum(x[4][k] for x in s) / len(s), 1),
                "mem_peak_gib": round(max(x[5][k] for x in s) / 2**30, 2),
            }
            for k, index in enumerate(self.indices if gpu else [])
        ]
        return {
            "gpu_busy_pct": round(sum(x[1] for x in s) / len(s), 1) if gpu else None,  # the visible GPUs' mean
            "gpu_mem_peak_gib": round(max(x[2] for x in s) / 2**30, 2) if gpu else None,  # their sum
            "per_gpu": per_gpu,
            "host_cpu_busy_pct": round(sum(x[3] for x in s) / len(s), 1),
            "samples": len(s),
            "cpu_by_process": self.cpu_by_process(t0, t1),
        }

    def cpu_by_process(self, t0: float, t1: float) -> list[dict]:
        a, b = self._snapshot_near(t0), self._snapshot_near(t1)
        return cpu_by_process(a, b) if a and b and b[0] > a[0] else []


def mid_window(finished: list[tuple[float, int]], n: int, lo: float = 0.1, hi: float = 0.9) -> tuple[float, float]:
    """When ``lo`` and ``hi`` of the ``n`` results had arrived (``finished``: sorted (time, rows)): the
    pipeline's steady state, after its fill (engines starting, the first decode wave) and before its
    drain (the last engine finishing its queue)."""
    t_lo = t_hi = finished[-1][0]
    done = 0
    for t, k in finished:
        before, done = done, done + k
        if before < lo * n <= done:
            t_lo = t
        if before < hi * n <= done:
            t_hi = t
    return t_lo, t_hi


def rate_10_90(finished: list[tuple[float, int]], n: int) -> dict:
    """The window between 10% and 90% of the ``n`` results (``finished``: sorted (time, rows)) and the rate in
    it; empty if the window has no length."""
    t10, t90 = mid_window(finished, n)
    return {"t10": t10, "t90": t90, "images_per_s_10_90": round(0.8 * n / (t90 - t10), 2)} if t90 > t10 else {}


def rates(
    n: int,
    t_start: float,
    t_first: float,
    t_last: float,
    t_steady: float,
    n_steady: int,
    out_tokens: int,
    finished: list[tuple[float, int]] | None = None,
) -> dict:
    """Rates of one phase: ``n_steady`` images finished in (t_steady, t_last]; wall from t_start.
    With ``finished`` (sorted (time, rows) of every result), also the rate between 10% and 90% of
    the results (``images_per_s_10_90``, window ``t10``-``t90``)."""
    steady_s = t_last - t_steady
    mid = rate_10_90(finished, n) if finished else {}
    return {
        **mid,
        "images": n,
        "start_to_first_result_s": round(t_first - t_start, 2),
        "wall_s": round(t_last - t_start, 2),
        "images_per_s": round(n_steady / steady_s, 2) if steady_s > 0 else None,
        "images_per_s_wall": round(n / (t_last - t_start), 2),
        "output_tokens_per_s": round(out_tokens * n_steady / n / steady_s, 1) if steady_s > 0 else None,
        "steady_window_s": round(steady_s, 2),
        "t_start": t_start,
        "t_first": t_first,
        "t_last": t_last,
        "t_steady": t_steady,
    }


def commit_times(run_dir: str) -> tuple[list[tuple[float, int]], int, float]:
    """(commit time, rows) of each caption shard, total output tokens, mean input tokens."""
    import pyarrow.parquet as pq

    shards = sorted(Path(run_dir, "captions").glob("part-*.parquet"))
    stamps, out_tok, in_tok, rows = [], 0, 0, 0
    for p in shards:
        t = pq.read_table(p, columns=["num_output_tokens", "num_input_tokens"])
        stamps.append((int(p.name.split("-")[1]) / 1e9, t.num_rows))
        out_tok += sum(t.column("num_output_tokens").to_pylist())
        in_tok += sum(t.column("num_input_tokens").to_pylist())
        rows += t.num_rows
    return sorted(stamps), out_tok, in_tok / max(rows, 1)


def _worker_logs(ray_tmp: str) -> list[Path]:
    """The worker log files of the newest local Ray session (vLLM engines log there)."""
    sessions = sorted(Path(ray_tmp).glob("session_2*"), key=lambda p: p.stat().st_mtime)
    return sorted((sessions[-1] / "logs").glob("worker-*")) if sessions else []


_READY = re.compile(r"(\d\d)-(\d\d) (\d\d:\d\d:\d\d) \[core\.py:\d+\] init engine \(profile")


def _logged_times(parse, since: float, ray_tmp: str) -> list[float]:
    """The times ``parse(line)`` finds (None: not such a line) in the workers' log files of the
    newest local Ray session, from ``since`` on, sorted."""
    times = []
    for f in _worker_logs(ray_tmp):
        with open(f, errors="replace") as fh:
            times += [t for t in map(parse, fh) if t is not None and t >= since]
    return sorted(times)


def engine_ready_times(since: float, ray_tmp: str = "/tmp/ray") -> list[float]:
    """When each vLLM engine core finished starting: its "init engine ... took" line (whole seconds,
    local time, so up to 1 s early)."""
    year = time.localtime().tm_year

    def parse(line: str) -> float | None:
        m = _READY.search(line)
        return time.mktime(time.strptime(f"{year}-{m[1]}-{m[2]} {m[3]}", "%Y-%m-%d %H:%M:%S")) if m else None

    return _logged_times(parse, since - 1, ray_tmp)


def engine_accepting_times(since: float, ray_tmp: str = "/tmp/ray") -> list[float]:
    """When each engine front end (AsyncLLM) was ready to take requests: captionflow's worker hook
    logs it with the Unix time (captionflow/compat/vllm_warmup.py)."""
    from captionflow.compat.vllm_warmup import ACCEPTING

    return _logged_times(
        lambda line: float(line.rsplit(ACCEPTING, 1)[1].split()[0]) if ACCEPTING in line else None, since, ray_tmp
    )


_ENGINE_LOG = re.compile(
    r"init engine|Available KV|GPU KV cache|Maximum concurrency|Avg prompt throughput|"
    r"Elapsed time for batch|max_num_batched_tokens|Model loading took|HF processor|render stage|warm-up samples|"
    r"sampler warm-up|built ahead|Error|error"
)


_BATCH_DONE = re.compile(r"Elapsed time for batch \S+ with size (\d+)")


def save_engine_logs(dest: Path, ray_tmp: str = "/tmp/ray") -> dict[str, int]:
    """The vLLM engines' own lines (start-up, KV cache, throughput) from the newest Ray session; returns
    the rows each engine actor finished (from Ray Data LLM's per-batch lines), by worker process id."""
    rows: dict[str, int] = {}
    with open(dest, "w") as out:
        for f in _worker_logs(ray_tmp):
            with open(f, errors="replace") as fh:
                for line in fh:
                    if _ENGINE_LOG.search(line):
                        out.write(f"{f.name[-12:]}: {line[:400].rstrip()}\n")
                    m = _BATCH_DONE.search(line)
                    if m:
                        pid = f.stem.rsplit("-", 1)[-1]
                        rows[pid] = rows.get(pid, 0) + int(m[1])
    return rows


_STATS = re.compile(
    r"(\d\d)-(\d\d) (\d\d:\d\d:\d\d) \[loggers\.py:\d+\] .*?Avg prompt throughput: ([\d.]+) tokens/s, "
    r"Avg generation throughput: ([\d.]+) tokens/s, Running: (\d+) reqs, Waiting: (\d+) reqs"
)


def engine_stats(t_from: float, t_to: float, ray_tmp: str = "/tmp/ray") -> dict[str, list[tuple]]:
    """vLLM's statistics lines (``--engine-stats``: one a second per busy engine) stamped from ``t_from`` to
    ``t_to``, by worker log (one per engine): (time, generated tokens/s, running, waiting) each."""
    year = time.localtime().tm_year
    out = {}
    for f in _worker_logs(ray_tmp):
        rows = []
        with open(f, errors="replace") as fh:
            for line in fh:
                m = _STATS.search(line)
                if not m:
                    continue
                t = time.mktime(time.strptime(f"{year}-{m[1]}-{m[2]} {m[3]}", "%Y-%m-%d %H:%M:%S"))
                if t_from <= t <= t_to:
                    rows.append((t, float(m[5]), int(m[6]), int(m[7])))
        if rows:
            out[f.name] = rows
    return out


def engine_load(t10: float, t90: float, max_tokens: int, ray_tmp: str = "/tmp/ray") -> dict | None:
    """What each engine core did between 10% and 90% of the results, from vLLM's own statistics lines
    (``--engine-stats``: one a second per engine): requests running and waiting (median), the share of
    seconds with none waiting (the engine starved: whatever feeds it is slower), and its generation
    rate in images/s (output tokens / ``max_tokens`` over the window; a line covers one second). None without
    such lines."""
    per_engine = [
        {
            "log": name,
            "seconds": len(rows),
            "running_median": statistics.median([r[2] for r in rows]),
            "waiting_median": statistics.median([r[3] for r in rows]),
            "none_waiting_share": round(sum(r[3] == 0 for r in rows) / len(rows), 2),
            # tokens over the window, not per line: an idle engine logs no line
            "images_per_s": round(sum(r[1] for r in rows) / max(t90 - t10, 1) / max(max_tokens, 1), 1),
        }
        for name, rows in engine_stats(t10 - 1, t90, ray_tmp).items()
    ]
    if not per_engine:
        return None
    return {"engines": per_engine, "images_per_s": round(sum(e["images_per_s"] for e in per_engine), 1)}


def pipeline_rates(n: int, t_start: float, stamps: list[tuple[float, int]], out_tok: int) -> dict:
    """B and C: the steady window starts when the first engine front end can take requests (as A's
    starts when ``LLM()`` returns), so it holds every image and the pipeline's fill. Also given:
    ``images_per_s_from_engine_log``, from the first engine core's "init engine ... took" line, which
    comes 5-8 s earlier (the engine core then still loads the HF processor before it answers). Without
    either log line, from the first committed shard."""
    ready, accepting = engine_ready_times(t_start), engine_accepting_times(t_start)
    t0 = accepting[0] if accepting else ready[0] if ready else None
    if t0 is None:
        r = rates(n, t_start, stamps[0][0], stamps[-1][0], stamps[0][0], n - stamps[0][1], out_tok, stamps)
        r["steady_from"] = "first committed shard (no engine log found)"
        return r
    r = rates(n, t_start, stamps[0][0], stamps[-1][0], t0, n, out_tok, stamps)
    r["steady_from"] = "first engine accepting requests" if accepting else "first engine ready (init engine log)"
    if ready:
        r["engines_ready_after_s"] = [round(t - t_start, 1) for t in ready]
        r["images_per_s_from_engine_log"] = round(n / max(stamps[-1][0] - ready[0], 1e-9), 2)
    if accepting:
        r["engines_accepting_after_s"] = [round(t - t_start, 1) for t in accepting]
    return r


def run_phase(name: str, a: argparse.Namespace, sampler: GpuSampler) -> dict:
    """Run one phase in a child process; its result plus GPU figures over its steady window."""
    res_file = Path(a.work) / f"phase-{name}.json"
    res_file.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        str(ROOT / "bench" / "gpu_throughput.py"),  # its --child runs the phase
        "--child",
        name,
        "--device",
        a.device,
        "--work",
        a.work,
        "--images",
        a.images,
        "--model",
        a.model,
        "--max-tokens",
        str(a.max_tokens),
        "--max-pixels",
        str(a.max_pixels),
        "--max-image-side",
        str(a.max_image_side),
        "--engine-kwargs",
        a.engine_kwargs,
        "--cuda-mps",
        a.cuda_mps,
        "--pipeline-config",
        a.pipeline_config,
    ]
    if a.engines_per_gpu:
        cmd += ["--engines-per-gpu", str(a.engines_per_gpu)]
    if not a.ceiling:
        cmd += ["--no-ceiling"]
    t0 = time.time()
    log = Path(a.work) / f"phase-{name}.log"
    try:
        with open(log, "w") as fh:
            proc = subprocess.run(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, timeout=a.phase_timeout)
    except subprocess.TimeoutExpired:
        return {
            "error": f"timed out after {a.phase_timeout} s",
            "log_tail": log.read_text(errors="replace")[-4000:],
            "elapsed_s": round(time.time() - t0, 1),
        }
    if proc.returncode != 0 or not res_file.exists():
        tail = log.read_text(errors="replace")[-4000:]
        return {"error": f"exit {proc.returncode}", "log_tail": tail, "elapsed_s": round(time.time() - t0, 1)}
    r = json.loads(res_file.read_text())
    r["gpu_steady"] = sampler.window(r["t_steady"], r["t_last"])
    if "t10" in r:  # results flowing: between the pipeline's fill and its drain
        r["gpu_10_90"] = sampler.window(r["t10"], r["t90"])
    for timed in ("engine_finished", "ceiling"):  # raw: the same windows by the engine core's clock
        if "t10" in (r.get(timed) or {}):
            r[timed]["gpu_10_90"] = sampler.window(r[timed]["t10"], r[timed]["t90"])
    r["gpu_whole_phase"] = sampler.window(t0, time.time())
    r["gpu_trace"] = {
        "columns": ["s since phase start", "GPU busy %", "GPU memory GiB", "host CPU busy %"],
        "rows": sampler.trace(t0, time.time()),
    }
    return r
