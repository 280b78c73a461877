"""Phase B of the GPU benchmark: captionflow's inference stage (Ray Data LLM, the run's preset) over the
preprocessed dataset, in a child process."""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

from bench.throughput.measure import PROMPT, SYSTEM_PROMPT, commit_times, engine_load, pipeline_rates, save_engine_logs


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
        # a stage that gets no result for 10 min fails with the watchdog's account (the run's default, 30 min, let
        # a hung multi-GPU stage sit 12+ min with no line in the phase's log); --pipeline-config may say otherwise
        **{"stall_timeout_s": 600, **extra},
    )


def phase_stage(a: argparse.Namespace) -> dict:
    import logging

    from captionflow.data.sources import ingest
    from captionflow.engines.engine import resolve_engine
    from captionflow.engines.processor import max_pending_requests
    from captionflow.engines.session import ray_session
    from captionflow.errors import RowsFailed
    from captionflow.model_source import resolve_model
    from captionflow.stages.inference import run_inference
    from captionflow.stages.preprocess import preprocess
    from captionflow.stages.shared_pass import SharedPass

    # captionflow's own lines (the stall watchdog's minute-by-minute account above all) into the phase's log
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    shutil.rmtree(Path(a.work) / "out-stage", ignore_errors=True)  # a fresh run: nothing to resume
    cfg = _run_config(a, str(Path(a.work) / "out-stage"))
    models = [resolve_model(m, dummy_weights=cfg.dummy_weights()) for m in a.model.split(",")]
    model, cfg = models[0], cfg.model_copy(update={"model": models[0].source})
    session = ray_session(cfg)
    manifest = preprocess(ingest(cfg), cfg)  # not timed: B is the inference stage alone
    together = models if len(models) > 1 else ()  # adapters of one base: one shared pass (stages/shared_pass.py)
    engine = resolve_engine(cfg, model, session.preset(a.device), session.gpus(), session.started_here, together)
    import ray.data

    consumed = []  # the dataset(s) the stage's driver loop reads: their Ray Data stats go to a log
    iter_rows = ray.data.Dataset.iter_rows

    def recording_iter_rows(self, *args, **kwargs):
        consumed.append(self)
        return iter_rows(self, *args, **kwargs)

    ray.data.Dataset.iter_rows = recording_iter_rows
    t_start = time.time()
    try:
        results = (
            SharedPass(cfg, manifest, models, engine).run()
            if together
            else [run_inference(cfg, manifest, model, engine)]
        )
    except RowsFailed as e:
        results = [e.result]
    Path(a.work, "phase-stage-datastats.log").write_text("\n\n".join(d.stats() for d in consumed))
    timed = [commit_times(res.run_dir) for res in results]  # each checkpoint's run folder
    stamps, out_tok = sorted(s for t in timed for s in t[0]), sum(t[1] for t in timed)
    in_tok = sum(t[2] for t in timed) / len(timed)
    r = pipeline_rates(sum(x.captioned for x in results), t_start, stamps, out_tok)
    r["checkpoints"] = len(results)  # rows = images x checkpoints
    r["rows_per_engine"] = sorted(save_engine_logs(Path(a.work) / "phase-stage-engines.log").values())
    if "t10" in r:
        r["engine_load_10_90"] = engine_load(r["t10"], r["t90"], a.max_tokens)
    r.update(
        {
            "failed": sum(x.failed for x in results),
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
