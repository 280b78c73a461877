"""Stage 3, inference: a caption for every accepted row, through Ray Data LLM and the vLLM engine, and the run's
sequential verdict as the captions come.

The pass itself (the run folder's lease, the ledger's commits, reuse, the engines warm or cold, the passes) is
``caption_pass.CaptionPass``; this stage says what takes its captions as they come: the sequential verdict on
CIDEr-D or CLIPScore (``sequential_verdict``) or the judge beside the captioner for a verdict on the judge's score
or the pairwise win (``judging_alongside``).
"""

from __future__ import annotations

import concurrent.futures
import logging
from typing import Optional

from captionflow.config import RunConfig
from captionflow.data.layout import caption_failures, read_captions
from captionflow.data.storage import Store
from captionflow.engines.engine import EngineSettings
from captionflow.errors import BaselineError, DatasetError
from captionflow.evaluation.cider import FixedIdfCider
from captionflow.evaluation.sequential import VERDICT_SCORES, PrefixVerdict, paired_differences
from captionflow.model_source import ClipModel, ResolvedModel
from captionflow.results import InferenceResult, Manifest
from captionflow.runs.baseline import baseline_order, baseline_verdict, resolve_baseline
from captionflow.runs.ledger import Progress
from captionflow.stages.caption_pass import CaptionPass, CaptionVerdict, Consumer, caption_run_parts
from captionflow.stages.clip_score import PrefixClipScore
from captionflow.stages.judge import SequentialJudging, alongside, judge_score_judging
from captionflow.stages.pairwise import pairwise_judging

__all__ = ["caption_run_parts", "run_inference", "sequential_verdict", "judging_alongside"]

log = logging.getLogger("captionflow.inference")


def run_inference(
    cfg: RunConfig,
    manifest: Manifest,
    model: ResolvedModel,
    engine: EngineSettings,
    progress: Optional[Progress] = None,
    clip: Optional[ClipModel] = None,
    judge: Optional[ResolvedModel] = None,
    judge_engine: Optional[EngineSettings] = None,
) -> InferenceResult:
    """Caption every accepted row not yet captioned (``caption_pass.CaptionPass``), the captions going as they come
    to the run's sequential verdict, if any: on CIDEr-D or CLIPScore (``clip``: the CLIP checkpoint of a CLIPScore
    verdict; ``sequential_verdict``), or on the judge's score or the pairwise win (``judge``, ``judge_engine``),
    judged as they are made where it can (``judging_alongside``). Rows that still failed after every pass are
    counted; more than ``max_failure_rate`` of them raises RowsFailed (with the result)."""

    def consumer(p: CaptionPass) -> Optional[Consumer]:
        if cfg.verdict != "sequential":
            return None
        gpu = engine.preset.name == "gpu"
        verdict = sequential_verdict(cfg, p.store, p.run, p.shards, p.ids, clip, gpu)
        if verdict is not None:
            return CaptionVerdict(verdict)
        return judging_alongside(cfg, p.store, p.run, engine, p.ids, judge, judge_engine)

    return CaptionPass(cfg, manifest, model, engine, progress).run_with(consumer)


def judging_alongside(
    cfg: RunConfig,
    store: Store,
    run: tuple[str, ...],
    engine: EngineSettings,
    ids: set[str],
    judge: Optional[ResolvedModel],
    judge_engine: Optional[EngineSettings],
) -> Optional[SequentialJudging]:
    """For a sequential verdict on the judge's score or the pairwise win, its judge judging the captions of
    ``ids`` as they are made, so that the captioning stops once the verdict is in (``judge.SequentialJudging``); None
    (said in the log) where it cannot (``judge.alongside``: the run captions the full set, and the judge or pairwise
    stage's judging stops once sure) or there is no baseline yet. BaselineError for a baseline without what the
    verdict needs, before any engine starts."""
    if cfg.verdict != "sequential" or cfg.verdict_score not in ("judge", "pairwise"):
        return None
    what = "pairwise judge" if cfg.verdict_score == "pairwise" else "judge's score"
    why = alongside(cfg, engine, judge, judge_engine)
    if why:
        log.info("verdict sequential on the %s: %s, so the full set is captioned and the judging stops once sure",
                 what, why)  # fmt: skip
        return None
    make = pairwise_judging if cfg.verdict_score == "pairwise" else judge_score_judging
    return make(cfg, store, run, ids, caption_failures(store, run), judge, judge_engine)


def sequential_verdict(
    cfg: RunConfig,
    store: Store,
    run: tuple[str, ...],
    shards: list[str],
    ids: set[str],
    clip: Optional[ClipModel] = None,
    gpu: bool = False,
) -> Optional[PrefixVerdict]:
    """The run's sequential verdict against ``verdict_against`` (``evaluation/sequential.py``): the golden set's
    images with a baseline caption (and references, for CIDEr-D), in an order seeded by the dataset and the baseline
    run, each scored (both sides, as the prefix reaches it) by ``verdict_score``: CIDEr-D with the IDF of all the
    references (``evaluation/cider.py``) or CLIPScore by ``clip`` (``clip_score.PrefixClipScore``; on the driver's
    GPU for a ``gpu`` run). None (the full
    set, said in the log) while no baseline exists yet, and for a judge or pairwise verdict (their judge decides:
    ``judging_alongside``, or the judge or pairwise stage); DatasetError for a dataset the score cannot score."""
    if cfg.verdict_score in ("judge", "pairwise"):  # their judge decides (judging_alongside)
        return None
    baseline = resolve_baseline(store, run, cfg.verdict_against, what="verdict_against")
    if baseline is None:
        log.info("verdict sequential: no %s comparable run yet, so the full set is captioned", cfg.verdict_against)
        return None
    refs: dict[str, list[str]] = {}
    if cfg.verdict_score in ("auto", "cider"):
        data = store.read_tables(shards, columns=["image_id", "references"])
        refs = {i: r for i, r in zip(data["image_id"].to_pylist(), data["references"].to_pylist()) if r} if data else {}
    score = "clip" if cfg.verdict_score == "clip" else "cider" if refs else "clip" if clip else None
    if score is None:
        raise DatasetError(
            f"verdict sequential: the dataset {cfg.dataset} has no reference captions to score CIDEr-D against "
            "(give a caption_column, set clip_model for a CLIPScore verdict, or use verdict full)"
        )
    if score == "clip" and clip is None:  # preflight says so first; here for a caller without it
        raise DatasetError("verdict sequential: verdict_score clip needs clip_model")
    population = refs if score == "cider" else ids
    theirs = {i: c for i, c in read_captions(Store(baseline["run_dir"]), ()).items() if i in ids and i in population}
    if not theirs:
        raise BaselineError(f"verdict_against: the run {baseline['run_dir']} has no captions of this dataset's images")
    order = baseline_order(run, baseline, set(theirs) - caption_failures(store, run), theirs)
    if score == "cider":
        # the references' document frequencies are counted while the run's requests start (~1.7 s for 5,000
        # images on 2 cores); the first captions to score wait for them
        idf = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="captionflow-idf")
        cider = idf.submit(FixedIdfCider, refs)
        idf.shutdown(wait=False)
        scorer, extra = (lambda captions: cider.result().scores(captions)), {}
    else:
        scorer = PrefixClipScore(clip, store, shards, order, gpu)
        # where the bootstrap beside the verdict finds the baseline's CLIPScores by the same checkpoint
        extra = {
            "clip_model": clip.source,
            "baseline_scores": f"{baseline['run_dir'].rstrip('/')}/clip/{clip.fingerprint}",
        }
    return baseline_verdict(cfg, baseline, order, paired_differences(scorer, theirs), VERDICT_SCORES[score], extra)
