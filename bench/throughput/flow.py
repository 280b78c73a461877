"""Phase C of the GPU benchmark: the whole flow, ``captionflow run``, in a new process; the options a run and the
warm service it uses share."""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench.throughput.measure import (
    PROMPT,
    ROOT,
    SYSTEM_PROMPT,
    commit_times,
    engine_load,
    pipeline_rates,
    save_engine_logs,
)


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
