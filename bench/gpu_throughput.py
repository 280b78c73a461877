"""GPU benchmark: raw single-process vLLM vs. captionflow's inference stage vs. the whole flow.

One invocation on one GPU host, the same N images and the same work per image for all three:

  A. raw vLLM offline: one ``vllm.LLM`` in one process; every image decoded with PIL in that
     process, then one ``LLM.generate`` over all of them (what a plain script does);
  B. captionflow's inference stage (Ray Data LLM, GPU preset) over the preprocessed dataset;
  C. the whole flow, ``captionflow run`` (ingest, preprocess, inference, evaluate), in a new process.

Model: a full-size architecture stand-in (``captionflow build-model --arch``, default
Qwen2.5-VL-3B) with vLLM's random weights (``load_format="dummy"``), or ``--model DIR`` with real
weights. Every request: the same chat messages, greedy, ``ignore_eos`` and ``--max-tokens`` (64),
so every image costs the same; the same ``max_pixels`` (default 224x224, the goals' basis);
preprocessing keeps 640x480 images at their size (``max_image_side`` 640), so all three send the
same pixels to the image processor.

Each phase runs in its own process (the GPU is free between them) while this process samples GPU
utilisation and memory through NVML. Throughput is reported two ways:
  - steady (``images_per_s``): all images / (engine ready -> last result), so start-up is left
    out and the pipeline's fill is kept. A: from ``LLM()`` returning (then every image is decoded
    in-process and ``generate()`` runs). B, C: from the moment the first engine front end can take
    requests (the "vLLM engine accepting requests at" line captionflow's worker hook writes, Unix
    time); also ``images_per_s_from_engine_log``, from the engine core's earlier "init engine ...
    took" line (the basis before 2026-11-23; 5-8 s earlier, against B and C);
  - wall (``images_per_s_wall``): images / (phase start -> last result; C: -> process exit),
    start-up included (vLLM import, engine load and compile, Ray, Prefect), which N=2,000 does
    not amortise.
  - between 10% and 90% of the results (``images_per_s_10_90``, GPU figures in ``gpu_10_90``): the
    pipeline's steady state proper, without its fill (the first decode wave) and its drain (the
    last engine finishing its queue). For A this window is not the engine's: ``generate`` adds every
    input (rendering each, which paces the engine) before it collects any output, so its results
    arrive in a burst of what the core had finished meanwhile. ``engine_finished`` times A's outputs
    by the engine core's own clock instead.
  - the single-engine ceiling (A's ``ceiling``, ``ceiling_images_per_s``): after A, the same engine
    gets every request rendered first (mirrored images, new to its caches), all added at once, and
    drains them; its 10-90% rate by the engine core's clock, with the GPU figures of that window.
    ``steady_vs_ceiling`` is B's steady rate over it. ``--no-ceiling`` skips it.
``ratios`` (the headline) are steady ratios; ``ratios_wall`` include start-up; ``per_gpu_vs_seed``
is each phase's steady images/s per GPU over the seeds' 6.3. ``gpu_trace`` keeps each phase's GPU
busy %, GPU memory and host CPU busy % second by second. Each verdict run keeps ``timeline_s`` (when its log
first says each step: flow begins, checkpoint in the warm engines, dataset starts, a warm run's first request
block built and its gate open, first block back, first row in the driver, ...) and ``ray_data_progress`` (Ray
Data's reports every 10 s of the captioning dataset: per operator rows done, tasks running and why more are held
back, rows queued).

    python bench/gpu_throughput.py                 # N=2000, 224x224, all three phases
    python bench/gpu_throughput.py --n 500 --phases raw,stage
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from a checkout
SEED_IMAGES_PER_S_PER_GPU = 6.3  # the seeds' headline (issue #7): 12.6 images/s on 2 GPUs, Qwen2.5-VL-3B

SYSTEM_PROMPT = "You are a helpful assistant that writes short, factual image captions."
PROMPT = "Describe this image in one sentence."


# ---------------------------------------------------------------- GPU sampling (this process)
class GpuSampler:
    """Samples utilisation (%) and memory used (bytes) of every GPU, and the host's CPU busy %, every
    ``period`` seconds."""

    def __init__(self, period: float = 0.25):
        import psutil

        self._cpu = psutil.cpu_percent
        self._cpu(None)
        self.period, self.samples, self._stop = period, [], threading.Event()
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
            self.names = [pynvml.nvmlDeviceGetName(h) for h in self._handles]
        except Exception as e:  # no NVML: no utilisation figures, the benchmark still runs
            self._nvml, self._handles, self.names = None, [], [f"no NVML: {e}"]
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            t = time.time()
            if self._nvml:
                util = [self._nvml.nvmlDeviceGetUtilizationRates(h).gpu for h in self._handles]
                mem = [self._nvml.nvmlDeviceGetMemoryInfo(h).used for h in self._handles]
                self.samples.append((t, sum(util) / max(len(util), 1), sum(mem), self._cpu(None)))
            else:
                self.samples.append((t, None, None, self._cpu(None)))
            self._stop.wait(self.period)

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
        for t, util, mem, cpu in self.samples:
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
        return {
            "gpu_busy_pct": round(sum(x[1] for x in s) / len(s), 1) if gpu else None,
            "gpu_mem_peak_gib": round(max(x[2] for x in s) / 2**30, 2) if gpu else None,
            "host_cpu_busy_pct": round(sum(x[3] for x in s) / len(s), 1),
            "samples": len(s),
        }


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


# ---------------------------------------------------------------- phase A: raw vLLM (child process)
def phase_raw(a: argparse.Namespace) -> dict:
    from captionflow.pipeline.presets import PRESETS

    preset = PRESETS[a.device]

    t_start = time.time()
    from PIL import Image
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    t_import = time.time()
    kwargs = {
        "max_num_seqs": preset.max_num_seqs,
        "max_model_len": preset.max_model_len,
        "limit_mm_per_prompt": {"image": 1, "video": 0},
        "mm_processor_kwargs": {"max_pixels": a.max_pixels},
        **preset.engine_kwargs,
        **json.loads(a.engine_kwargs),
        "disable_log_stats": False,  # each output then carries the engine core's timestamps (``engine_rates``)
    }
    llm = LLM(model=a.model, **kwargs)
    t_engine = time.time()
    tok = AutoTokenizer.from_pretrained(a.model)
    messages = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPT}]},
    ]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    files = sorted(Path(a.images).iterdir())
    inputs = []
    for f in files:  # decode in this process, as a plain script does
        with Image.open(f) as im:
            inputs.append({"prompt": prompt, "multi_modal_data": {"image": im.convert("RGB")}})
    finished: list[float] = []

    class Recorder:  # vLLM's progress-bar hook (a tqdm stand-in): update() once per finished request
        def __init__(self, iterable=None, *args, total=None, desc="", **kw):
            self.n, self.total, self.desc, self.postfix, self._t0 = 0, total, desc, "", time.time()
            self._iterable = iterable

        def __iter__(self):
            return iter(self._iterable if self._iterable is not None else ())

        def __len__(self):
            return len(self._iterable)

        @property
        def format_dict(self):
            return {"elapsed": max(time.time() - self._t0, 1e-9)}

        def update(self, n=1):
            self.n += n
            if "rocess" in str(self.desc):
                finished.extend([time.time()] * n)

        def refresh(self, *a, **k):
            pass

        def close(self):
            pass

        def set_description(self, *a, **k):
            pass

    sp = SamplingParams(max_tokens=a.max_tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate(inputs, sp, use_tqdm=Recorder)  # max_pixels: set for the engine above, as in B and C
    t_end = time.time()
    out_tok = sum(len(o.outputs[0].token_ids) for o in outs)
    in_tok = sum(len(o.prompt_token_ids) for o in outs) / len(outs)
    # vLLM's offline generate() processes every input (in this process) before it collects the first
    # output, so "first result to last" is not observable here: A's steady window is its whole
    # working time once the engine is up (decode, image processing and generation).
    t_first = min(finished) if finished else t_end
    r = rates(len(outs), t_start, t_first, t_end, t_engine, len(outs), out_tok, [(t, 1) for t in sorted(finished)])
    r.update(
        {
            "import_s": round(t_import - t_start, 2),
            "engine_start_s": round(t_engine - t_import, 2),
            "mean_input_tokens": round(in_tok, 1),
            "output_tokens": out_tok,
            "engine_kwargs": kwargs,
            # the same outputs timed when the engine core finished them: generate() collects outputs only after it
            # added every input, so the times above bunch up what the core had finished while inputs were added
            "engine_finished": engine_rates(outs),
        }
    )
    if a.ceiling:
        from PIL import ImageOps

        mirrored = [
            {**x, "multi_modal_data": {"image": ImageOps.mirror(x["multi_modal_data"]["image"])}} for x in inputs
        ]
        r["ceiling"] = drain_full_queue(llm, mirrored, sp)
    return r


def _core_clock_offset() -> float:
    """Unix time minus the engine core's clock (``time.monotonic``, one clock for every process of a Linux host)."""
    return time.time() - time.monotonic()


def engine_rates(outs: list) -> dict | None:
    """Rates from when the engine core produced each request's last token (``RequestOutput.metrics``, the core's
    own timestamp; vLLM keeps it when its statistics are on): 10-90% of the results and first to last."""
    ends = sorted(o.metrics.last_token_ts for o in outs if getattr(o, "metrics", None) and o.metrics.last_token_ts)
    if len(ends) < max(10, len(outs) // 2):
        return None
    offset = _core_clock_offset()
    return {
        **rate_10_90([(t + offset, 1) for t in ends], len(ends)),
        "images_per_s_first_to_last": round(len(ends) / (ends[-1] - ends[0]), 2) if ends[-1] > ends[0] else None,
        "t_first": ends[0] + offset,
        "t_last": ends[-1] + offset,
    }


def drain_full_queue(llm, inputs: list, params) -> dict:
    """One engine draining a full queue, the single-engine ceiling: every request rendered first (vLLM's own
    renderer, in this process), then all added to an engine that is already up, then drained; rates from the
    engine core's own finish times (``engine_rates``). ``inputs``' images must be new to the engine (its prefix
    and encoder caches would otherwise skip their work)."""
    from vllm import RequestOutput

    t0 = time.time()
    rendered = llm._preprocess_cmpl(inputs)  # what generate() renders one by one
    t_rendered = time.time()
    llm._render_and_add_requests(prompts=rendered, params=[params] * len(rendered))
    t_added = time.time()
    outs = llm._run_engine(output_type=RequestOutput, use_tqdm=False)
    t_end = time.time()
    r = engine_rates(outs) or {}
    r.update(
        {
            "images": len(outs),
            "render_s": round(t_rendered - t0, 2),
            "add_s": round(t_added - t_rendered, 2),
            "added_to_last_s": round(t_end - t_rendered, 2),
            "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
        }
    )
    return r


# ---------------------------------------------------------------- phase B: the inference stage (child process)
def _run_config(a: argparse.Namespace, output: str):
    from captionflow.config import RunConfig

    layout = {"engines_per_gpu": a.engines_per_gpu}
    extra = {**json.loads(a.pipeline_config), **{k: v for k, v in layout.items() if v}}
    # the pipeline's own engine arguments (not the raw engine's) on top of those every phase gets
    engine_kwargs = {**json.loads(a.engine_kwargs), **extra.pop("engine_kwargs", {})}
    return RunConfig(
        dataset=a.images,
        output=output,
        model=a.model,
        device=a.device,
        max_tokens=a.max_tokens,
        cuda_mps=a.cuda_mps,
        ignore_eos=True,
        max_pixels=a.max_pixels,
        max_image_side=a.max_image_side,
        system_prompt=SYSTEM_PROMPT,
        prompt=PROMPT,
        engine_kwargs=engine_kwargs,
        commit_rows=32,
        **extra,
    )


def phase_stage(a: argparse.Namespace) -> dict:
    from captionflow.data.sources import ingest
    from captionflow.errors import RowsFailed
    from captionflow.model_source import resolve_model
    from captionflow.pipeline.engine import resolve_engine
    from captionflow.pipeline.inference import run_inference
    from captionflow.pipeline.preprocess import preprocess
    from captionflow.pipeline.processor import max_pending_requests
    from captionflow.pipeline.session import ray_session

    shutil.rmtree(Path(a.work) / "out-stage", ignore_errors=True)  # a fresh run: nothing to resume
    cfg = _run_config(a, str(Path(a.work) / "out-stage"))
    model = resolve_model(cfg.model, dummy_weights=cfg.dummy_weights())
    session = ray_session(cfg)
    manifest = preprocess(ingest(cfg), cfg)  # not timed: B is the inference stage alone
    engine = resolve_engine(cfg, model, session.preset(a.device), session.gpus(), session.started_here)
    import ray.data

    consumed = []  # the dataset(s) the stage's driver loop reads: their Ray Data stats go to a log
    iter_rows = ray.data.Dataset.iter_rows

    def recording_iter_rows(self, *args, **kwargs):
        consumed.append(self)
        return iter_rows(self, *args, **kwargs)

    ray.data.Dataset.iter_rows = recording_iter_rows
    t_start = time.time()
    try:
        res = run_inference(cfg, manifest, model, engine)
    except RowsFailed as e:
        res = e.result
    Path(a.work, "phase-stage-datastats.log").write_text("\n\n".join(d.stats() for d in consumed))
    stamps, out_tok, in_tok = commit_times(res.run_dir)
    r = pipeline_rates(res.captioned, t_start, stamps, out_tok)
    r["rows_per_engine"] = sorted(save_engine_logs(Path(a.work) / "phase-stage-engines.log").values())
    if "t10" in r:
        r["engine_load_10_90"] = engine_load(r["t10"], r["t90"], a.max_tokens)
    r.update(
        {
            "failed": res.failed,
            "mean_input_tokens": round(in_tok, 1),
            "output_tokens": out_tok,
            "engines": engine.concurrency,
            "engines_per_gpu": engine.engines_per_gpu,
            "batch_size": engine.batch_size,
            "max_concurrent_batches": engine.max_concurrent_batches,
            "max_pending_requests": max_pending_requests(engine),
            "engine_kwargs": engine.engine_kwargs,
            "cuda_mps": engine.mps,
        }
    )
    return r


# ---------------------------------------------------------------- phase C: the whole flow (CLI process)
def flow_command(a: argparse.Namespace, images: str, out: Path, model: str, summary: Path, engine_kwargs: str) -> list:
    """``captionflow run`` with the bench's settings (in a new process)."""
    cmd = [
        sys.executable,
        "-m",
        "flows.cli",
        "run",
        "--dataset",
        images,
        "--output",
        str(out),
        "--model",
        model,
        "--device",
        a.device,
        "--max-tokens",
        str(a.max_tokens),
        "--ignore-eos",
        "--max-pixels",
        str(a.max_pixels),
        "--max-image-side",
        str(a.max_image_side),
        "--system-prompt",
        SYSTEM_PROMPT,
        "--prompt",
        PROMPT,
        "--engine-kwargs",
        engine_kwargs,
        "--commit-rows",
        "32",
        "--summary-json",
        str(summary),
        "--cuda-mps",
        a.cuda_mps,
    ]
    return cmd + layout_options(a)


def layout_options(a: argparse.Namespace) -> list:
    """The engine layout's options (engines per GPU, more run parameters as a config file): the same
    for a run and for the warm service it uses (else the run would not match the service's engines)."""
    cmd = []
    if a.engines_per_gpu:
        cmd += ["--engines-per-gpu", str(a.engines_per_gpu)]
    if json.loads(a.pipeline_config):  # a YAML config file (JSON is YAML); the options above win
        extra = Path(a.work) / f"flow-config-{hashlib.sha256(a.pipeline_config.encode()).hexdigest()[:8]}.yaml"
        extra.write_text(a.pipeline_config)
        cmd += ["--config", str(extra)]
    return cmd


def phase_flow(a: argparse.Namespace) -> dict:
    out = Path(a.work) / "out-flow"
    shutil.rmtree(out, ignore_errors=True)  # a fresh run: nothing to resume, nothing cached
    summary = Path(a.work) / "flow-summary.json"
    cmd = flow_command(a, a.images, out, a.model, summary, a.engine_kwargs)
    t_start = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    t_end = time.time()
    if proc.returncode != 0:
        raise RuntimeError(f"captionflow run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    s = json.loads(summary.read_text())
    stamps, out_tok, in_tok = commit_times(s["run_dir"])
    r = pipeline_rates(s["counts"]["captioned"], t_start, stamps, out_tok)
    r["rows_per_engine"] = sorted(save_engine_logs(Path(a.work) / "phase-flow-engines.log").values())
    if "t10" in r:
        r["engine_load_10_90"] = engine_load(r["t10"], r["t90"], a.max_tokens)
    # the flow ends after evaluate: its wall time runs to the process's exit, not to the last caption
    r["wall_s"] = round(t_end - t_start, 2)
    r["images_per_s_wall"] = round(s["counts"]["captioned"] / (t_end - t_start), 2)
    r.update(
        {
            "failed": s["counts"]["failed"],
            "mean_input_tokens": round(in_tok, 1),
            "output_tokens": out_tok,
            "stage_timings_s": s.get("timings_s"),
            "quarantined": s["counts"]["quarantined"],
        }
    )
    return r


# ---------------------------------------------------------------- the verdict: run start -> leaderboard row
def _verdict_images(a: argparse.Namespace) -> str:
    """The first ``--verdict-n`` images of the bench's folder, hard-linked into a folder of their own."""
    folder = Path(a.work) / f"images-{a.verdict_n}"
    files = sorted(Path(a.images).iterdir())[: a.verdict_n]
    if not (folder.is_dir() and len(list(folder.iterdir())) == len(files)):
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        for f in files:
            os.link(f, folder / f.name)
    return str(folder)


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


def _flow_timed(a, name: str, images: str, model: str, engine_kwargs: str, env: dict, root="out-verdict") -> dict:
    out = Path(a.work) / root  # the golden set's output root: preprocessed by the first phase
    summary = Path(a.work) / f"verdict-{name}-summary.json"
    cmd = flow_command(a, images, out, model, summary, engine_kwargs) + ["--compile-cache-dir", env["CF_BENCH_CC"]]
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
    if a.engine_stats:  # each engine's running and waiting requests, second by second, over the run
        res["engine_seconds"] = engine_seconds(t0, t1)
    return res


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
    if "warm_engines" in todo:
        _warm_engines(a, res, images, ckpt_a, ckpt_c, kwargs, env, cc)
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
            keep = ("service_start_s", "warm_engines", "warm_engines_a_first", "warm_engines_repeats")
            res.update({k: got[k] for k in keep if k in got})
        if a.warm_layouts:
            res.setdefault("warm_layouts", []).append({"layout": layout, **got})
        # what is done so far, should the lease end before the phase does
        (Path(a.work) / "verdict-partial.json").write_text(json.dumps(res, indent=2))
        done = got.get("warm_engines") or {}
        if done.get("run_dir"):  # the next layout captions C again
            shutil.rmtree(done["run_dir"], ignore_errors=True)
            Path(done["leaderboard_row"]).unlink(missing_ok=True)


def _warm_layout(a, res: dict, images: str, ckpt_a: str, ckpt_c: str, kwargs: str, env: dict, cc: Path, suffix: str):
    got: dict = {}
    serve_log = Path(a.work) / f"phase-verdict-serve{suffix}.log"
    serve_cmd = [sys.executable, "-m", "flows.cli", "serve", "--model", ckpt_a, "--device", a.device]
    serve_cmd += ["--max-pixels", str(a.max_pixels), "--max-image-side", str(a.max_image_side)]
    serve_cmd += ["--engine-kwargs", kwargs, "--compile-cache-dir", str(cc), "--idle-timeout", "900"]
    serve_cmd += ["--cuda-mps", a.cuda_mps] + layout_options(a)
    t0 = time.time()
    with open(serve_log, "w") as fh:
        server = subprocess.Popen(serve_cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, env=env)
    try:
        while "warm engines ready" not in serve_log.read_text(errors="replace"):
            if server.poll() is not None or time.time() - t0 > a.phase_timeout:
                got["warm_engines"] = {"error": "the service did not start", "log_tail": serve_log.read_text()[-4000:]}
                break
            time.sleep(1)
        else:
            got["service_start_s"] = round(time.time() - t0, 2)
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
            save_engine_logs(Path(a.work) / f"phase-verdict-serve-engines{suffix}.log")  # the service's Ray
    finally:
        _stop(server, 120)
    return got


PHASES = {"raw": phase_raw, "stage": phase_stage, "flow": phase_flow}


# ---------------------------------------------------------------- orchestration
def prepare(a: argparse.Namespace) -> None:
    work = Path(a.work)
    if a.engine_stats:  # the phases' processes (and a local Ray's workers) inherit the interval
        a.engine_kwargs = json.dumps({**json.loads(a.engine_kwargs), "disable_log_stats": False})
        os.environ.setdefault("VLLM_LOG_STATS_INTERVAL", "1")
    if not a.images:
        from captionflow.builtin.synthetic import make_images

        folder = work / "images"
        if not (folder.is_dir() and len(list(folder.iterdir())) == a.n):
            make_images(folder, a.n)
        a.images = str(folder)
    if a.model == "builtin":
        from captionflow.builtin.model import ensure_builtin_model

        a.model = str(ensure_builtin_model())
    elif not a.model:
        from captionflow.builtin.standin import build_standin

        model_dir = work / f"standin-{a.arch}"
        if not model_dir.exists():
            build_standin(a.arch, model_dir)
        a.model = str(model_dir)
        a.engine_kwargs = json.dumps({"load_format": "dummy", **json.loads(a.engine_kwargs)})


def run_phase(name: str, a: argparse.Namespace, sampler: GpuSampler) -> dict:
    """Run one phase in a child process; its result plus GPU figures over its steady window."""
    res_file = Path(a.work) / f"phase-{name}.json"
    res_file.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        __file__,
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=2000, help="synthetic 640x480 JPEGs (ignored with --images)")
    ap.add_argument("--images", help="a folder of images instead of synthetic ones")
    ap.add_argument("--arch", default="qwen2.5-vl-3b", help="stand-in architecture (without --model)")
    ap.add_argument(
        "--model",
        help="a checkpoint folder with real weights instead of the stand-in "
        "('builtin': the tiny built-in model, for a quick check on CPU)",
    )
    ap.add_argument("--device", choices=["gpu", "cpu"], default="gpu", help="the preset (cpu: a smoke test)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument(
        "--max-pixels",
        type=int,
        default=224 * 224,
        help="image processor budget, all phases (default 224x224, the basis of issue #7's goals and "
        "of the host's raw baseline; 200704 = 448x448, the GPU preset's own budget)",
    )
    ap.add_argument("--max-image-side", type=int, default=640, help="preprocess bound (B, C); 640 keeps 640x480")
    ap.add_argument("--engines-per-gpu", type=int, help="whole engines per GPU (default: one)")
    ap.add_argument("--engine-kwargs", default="{}", help="extra vLLM kwargs (JSON), all phases")
    ap.add_argument(
        "--engine-stats",
        action="store_true",
        help="vLLM's statistics on, logged every second (stage, flow: engine_load_10_90 says whether the engines "
        "were starved or full; costs their front ends a little CPU)",
    )
    ap.add_argument(
        "--pipeline-config",
        default="{}",
        help="more run parameters for B and C (JSON of RunConfig fields, e.g. "
        '\'{"max_concurrent_batches": 24, "batch_size": 32}\')',
    )
    ap.add_argument(
        "--cuda-mps",
        choices=["auto", "on", "off"],
        default="auto",
        help="the pipeline's cuda_mps parameter (stage, flow); raw vLLM runs without MPS",
    )
    ap.add_argument(
        "--phases",
        default="raw,stage,flow",
        help="raw, stage, flow (throughput, N images) and verdict (run start to leaderboard row, --verdict-n images)",
    )
    ap.add_argument("--verdict-n", type=int, default=5000, help="images of the verdict phase (the first of the set)")
    ap.add_argument(
        "--verdict-phases",
        default="cold,warm_cache,warm_engines,raw",
        help="which of the verdict's runs (a lease too short for all of them: the ones that changed)",
    )
    ap.add_argument(
        "--model-b",
        help="the verdict's second checkpoint (with --model); default: random-weight checkpoints of the stand-in",
    )
    ap.add_argument("--model-c", help="the verdict's third checkpoint (warm engines; default: --model-b)")
    ap.add_argument(
        "--warm-layouts",
        help="the warm-engine verdict for each of these engine layouts in turn (a JSON list of objects with "
        "name and any of engines_per_gpu, pipeline_config, engine_kwargs, over the options above), e.g. "
        '\'[{"name":"4x512"},{"name":"2x1024","engines_per_gpu":2,"pipeline_config":{"max_num_seqs":1024}}]\'',
    )
    ap.add_argument(
        "--warm-repeats",
        type=int,
        default=0,
        help="after each layout's warm-engine run of C, this many more on the same service, swapping B and C in turn "
        "(warm_engines_repeats): several verdicts for one service start",
    )
    ap.add_argument(
        "--prefect",
        choices=["server", "ephemeral"],
        default="server",
        help="the verdict's runs report to a Prefect server started once (as deployments' runs do), or each "
        "starts Prefect's temporary server",
    )
    ap.add_argument(
        "--no-ceiling",
        dest="ceiling",
        action="store_false",
        help="raw phase: skip the single-engine ceiling (every request rendered first, then drained)",
    )
    ap.add_argument("--phase-timeout", type=float, default=900)
    ap.add_argument("--work", help="working folder (default: a new temporary one)")
    ap.add_argument("--json", help="results file (default bench/results/gpu_throughput-<stage|verdict>-<gpu>.json)")
    ap.add_argument("--merge", action="store_true", help="keep the other phases already in --json")
    ap.add_argument("--child", choices=sorted(PHASES), help=argparse.SUPPRESS)
    a = ap.parse_args()

    if a.child:
        r = PHASES[a.child](a)
        Path(a.work, f"phase-{a.child}.json").write_text(json.dumps(r, indent=2))
        return 0

    a.work = a.work or tempfile.mkdtemp(prefix="cf-gpu-bench-")
    prepare(a)
    n_images = len(list(Path(a.images).iterdir()))
    results: dict = {
        "n": n_images,
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "model": a.model,
        "arch": None if "--model" in sys.argv else a.arch,
        "max_tokens": a.max_tokens,
        "max_pixels": a.max_pixels,
        "max_image_side": a.max_image_side,
        "options": {
            "engine_kwargs": json.loads(a.engine_kwargs),
            "pipeline_config": json.loads(a.pipeline_config),
            "engines_per_gpu": a.engines_per_gpu,
            "cuda_mps": a.cuda_mps,
        },
        # vLLM environment variables of the run (e.g. VLLM_USE_V2_MODEL_RUNNER=0): the engines inherit them
        "vllm_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("VLLM_")},
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    out = Path(a.json) if a.json else None
    if a.merge and out and out.exists():  # phases run by an earlier invocation on the same work folder
        earlier = json.loads(out.read_text())
        results = {**{k: v for k, v in earlier.items() if k in PHASES}, **results}
    with GpuSampler() as sampler:
        results["device"] = ", ".join(sampler.names)
        for name in a.phases.split(","):
            print(f"--- phase {name}", flush=True)
            results[name] = verdict(a, sampler) if name == "verdict" else run_phase(name, a, sampler)
            print(json.dumps({k: v for k, v in results[name].items() if k != "log_tail"}), flush=True)
            if "error" in results[name]:
                print(results[name]["log_tail"], flush=True)
            _finish(results)
            out = _write(results, out)
    _table(results)
    print("wrote", out)
    return 0


def _finish(results: dict) -> None:
    raw = results.get("raw") or {}
    ratios, wall, log_basis = {}, {}, {}
    for key, name in (("stage_vs_raw", "stage"), ("flow_vs_raw", "flow")):
        other = results.get(name) or {}
        if raw.get("images_per_s") and other.get("images_per_s"):
            ratios[key] = round(other["images_per_s"] / raw["images_per_s"], 3)
            wall[key] = round(other["images_per_s_wall"] / raw["images_per_s_wall"], 3)
            if other.get("images_per_s_from_engine_log"):
                log_basis[key] = round(other["images_per_s_from_engine_log"] / raw["images_per_s"], 3)
    results["ratios"], results["ratios_wall"] = ratios, wall
    # the pipeline against one engine draining a full queue, in this invocation: raw's ceiling pass, timed by the
    # engine core (the plain pass's 10-90% window, timed as generate() collects, bunches up outputs the core had
    # finished while inputs were still being added)
    ceiling = (raw.get("ceiling") or {}).get("images_per_s_10_90")
    stage = results.get("stage") or {}
    if ceiling and stage.get("images_per_s"):
        results["ceiling_images_per_s"] = ceiling
        results["steady_vs_ceiling"] = round(stage["images_per_s"] / ceiling, 3)
        if stage.get("images_per_s_10_90"):
            results["steady_10_90_vs_ceiling"] = round(stage["images_per_s_10_90"] / ceiling, 3)
    gpus = max(1, len(results.get("device", "").split(", ")))
    results["per_gpu_vs_seed"] = {
        name: round(results[name]["images_per_s"] / gpus / SEED_IMAGES_PER_S_PER_GPU, 2)
        for name in ("raw", "stage", "flow")
        if (results.get(name) or {}).get("images_per_s")
    }
    results["ratios_from_engine_log"] = log_basis
    results["ratio_basis"] = "steady-state images/s (first to last result); ratios_wall include start-up"


def _write(results: dict, out: Path | None) -> Path:
    if out is None:
        # one file per benchmark and device: gpu_throughput-<stage|verdict>-<device>.json (the latest run)
        gpu = results.get("device", "gpu").split(",")[0].replace("NVIDIA ", "").replace(" ", "-").lower()
        gpu = "h100" if gpu.startswith("h100") else "h200" if gpu.startswith("h200") else gpu or "gpu"
        kind = "verdict" if "verdict" in results else "stage"
        out = ROOT / "bench" / "results" / f"gpu_throughput-{kind}-{gpu}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    return out


def _table(results: dict) -> None:
    if "verdict" in results:
        v = results["verdict"]
        print(f"verdict (run start -> leaderboard row, {v.get('n')} images), s: {json.dumps(v.get('summary'))}")
        for lay in v.get("warm_layouts", []):
            w, tl = lay.get("warm_engines") or {}, (lay.get("warm_engines") or {}).get("timeline_s") or {}
            print(
                f"  warm layout {lay['layout'].get('name')!s:>16}: service start {lay.get('service_start_s')} s,"
                f" gate {tl.get('warm_gate_open')}, first caption {w.get('first_caption_after_s')},"
                f" last {w.get('last_caption_after_s')}, row {w.get('leaderboard_row_after_s')} ({w.get('engines')})"
                + (f" error: {w['error']}" if "error" in w else "")
            )
    cols = [n for n in ("raw", "stage", "flow") if n in results and "error" not in results[n]]
    rows = [
        ("images/s (steady)", "images_per_s"),
        ("images/s (10-90% of results)", "images_per_s_10_90"),
        ("images/s (incl. start-up)", "images_per_s_wall"),
        ("output tokens/s", "output_tokens_per_s"),
        ("first result after s", "start_to_first_result_s"),
        ("wall s", "wall_s"),
        ("mean input tokens", "mean_input_tokens"),
    ]
    print(f"{'':28}" + "".join(f"{c:>12}" for c in cols))
    for label, key in rows:
        print(f"{label:28}" + "".join(f"{results[c].get(key)!s:>12}" for c in cols))
    print(f"{'GPU busy % (steady)':28}" + "".join(f"{results[c]['gpu_steady']['gpu_busy_pct']!s:>12}" for c in cols))
    print(
        f"{'GPU busy % (10-90%)':28}"
        + "".join(f"{(results[c].get('gpu_10_90') or {}).get('gpu_busy_pct')!s:>12}" for c in cols)
    )
    finished = (results.get("raw") or {}).get("engine_finished") or {}
    if finished.get("images_per_s_10_90"):  # raw's 10-90% row above is as generate() collected
        print(f"{'raw by the engine clock 10-90%':28}{finished['images_per_s_10_90']!s:>12}")
    ceiling = (results.get("raw") or {}).get("ceiling") or {}
    if ceiling.get("images_per_s_10_90"):
        print(
            f"{'ceiling images/s (10-90%)':28}{ceiling['images_per_s_10_90']!s:>12}"
            f"  (GPU busy {(ceiling.get('gpu_10_90') or {}).get('gpu_busy_pct')}%,"
            f" rendered in {ceiling.get('render_s')} s,"
            f" added in {ceiling.get('add_s')} s)"
        )
    print(
        f"{'host CPU busy % (steady)':28}"
        + "".join(f"{results[c]['gpu_steady'].get('host_cpu_busy_pct')!s:>12}" for c in cols)
    )
    print(
        f"{'GPU memory peak GiB':28}"
        + "".join(f"{results[c]['gpu_whole_phase']['gpu_mem_peak_gib']!s:>12}" for c in cols)
    )
    print(
        f"device: {results.get('device')}  n={results['n']}  ratios: {json.dumps(results.get('ratios'))}"
        f"  steady_vs_ceiling: {results.get('steady_vs_ceiling')} (10-90%: {results.get('steady_10_90_vs_ceiling')})"
        f"  incl. start-up: {json.dumps(results.get('ratios_wall'))}"
        f"  per GPU vs the seed's {SEED_IMAGES_PER_S_PER_GPU} img/s: {json.dumps(results.get('per_gpu_vs_seed'))}"
    )


if __name__ == "__main__":
    sys.exit(main())
