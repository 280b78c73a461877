"""The pairwise judge: a VLM sees an image, its references and two captions - this run's and a baseline
run's - and answers which is better, in both orders, through structured output (A / B / tie and a short reason).

The baseline (``pairwise_against``) is ``previous`` or ``best`` (the comparable runs of the leaderboard: same
dataset, same generation settings), a checkpoint (its model source or fingerprint prefix, on this dataset with
these generation settings) or a run folder on this dataset. Judgements are committed like captions
(``runs/.../pairwise/<fp>/scores``, keyed ``<image_id>#ab`` / ``#ba``) under a fingerprint of the judge, its
settings, the prompt and the baseline run folder: a caption in a run folder never changes once committed, so
(image, both captions, judge, prompt) is covered, and a rerun or a resumed run judges only what is missing.
"""

from __future__ import annotations

import functools
import time
from typing import Optional

from captionflow.config import RunConfig
from captionflow.data.fingerprint import digest
from captionflow.data.layout import SCORES, caption_failures, read_captions, shard_paths
from captionflow.data.lease import Lease
from captionflow.data.storage import Store
from captionflow.engines.engine import EngineSettings
from captionflow.evaluation.pairwise_scores import per_image_scores
from captionflow.evaluation.sequential import VERDICT_SCORES, PrefixVerdict
from captionflow.evaluation.significance import win_rate
from captionflow.model_source import ResolvedModel
from captionflow.results import InferenceResult, Manifest, PairwiseResult
from captionflow.runs.baseline import baseline_order, baseline_verdict, resolve_baseline
from captionflow.runs.ledger import Ledger
from captionflow.stages.judge import JudgeTask, SequentialJudging, judge_passes, parse_rate
from captionflow.workers.llm_rows import (
    ORDERS,
    PAIRWISE_MAX_TOKENS,
    PAIRWISE_REGEX,
    PAIRWISE_SCHEMA,
    PAIRWISE_SYSTEM,
    both_orders,
    pair_id,
    pairwise_fixed_schema,
    pairwise_out,
    pairwise_prompt,
    pairwise_request,
    split_pair_id,
)


def pairwise_run_parts(
    run: tuple[str, ...], judge: ResolvedModel, engine: EngineSettings, baseline_run_dir: str
) -> tuple[str, ...]:
    fp = digest(
        {
            "model": judge.fingerprint,
            "engine": engine.output_params(),
            "regex": PAIRWISE_REGEX,
            "system": PAIRWISE_SYSTEM,
            "prompt": pairwise_prompt("{a}", "{b}", ["{reference}"]),
            "baseline": baseline_run_dir.rstrip("/"),
        }
    )
    return (*run, "pairwise", fp)


def run_pairwise(
    cfg: RunConfig, manifest: Manifest, inference: InferenceResult, judge: ResolvedModel, engine: EngineSettings
) -> PairwiseResult:
    t0 = time.perf_counter()
    store = Store(cfg.output)
    run = tuple(inference.run_parts)
    base = resolve_baseline(store, run, cfg.pairwise_against)
    if base is None:
        return PairwiseResult(
            cfg.pairwise_against, judge.source, "", "", "", 0, 0, 0.0, 0, 0, 0, 0.0, None, [], 0.0,
            note=f"no earlier run on this dataset with these generation settings to take as {cfg.pairwise_against!r}",
        )  # fmt: skip
    candidate, baseline = read_captions(store, run), read_captions(Store(base["run_dir"]), ())
    common = set(candidate) & set(baseline)
    todo = {pair_id(i, o) for i in common for o in ORDERS}
    parts = pairwise_run_parts(run, judge, engine, base["run_dir"])
    passes = []
    judging = None
    if cfg.verdict == "sequential" and cfg.verdict_score == "pairwise" and common:
        images = store.dataset_ids(shard_paths(store, manifest))
        failures = caption_failures(store, run)
        judging = pairwise_judging(cfg, store, run, images, failures, judge, engine, resolved=(base, baseline))
    verdict = judging.verdict if judging else None
    what = f"the pairwise judge folder {store.url(*parts)}"
    with Lease(store, "/".join(parts), what=what, wait_s=cfg.lease_wait_s) as lease:
        ledger = Ledger(
            store, parts, SCORES, PAIRWISE_SCHEMA, cfg.commit_rows, lease=lease,
            stall_timeout_s=cfg.stall_timeout_s, what="pairwise judge",
        )  # fmt: skip
        done = ledger.committed()
        # a rerun or resume (or the captioning's pass, judging alongside) continues the same order's prefix
        if not (judging and judging.resume(store)) and todo - done:
            passes = judge_passes(
                cfg, manifest, judge, engine, ledger, todo, done, pairwise_task(candidate, baseline),
                order=[pair_id(i, o) for i in verdict.order for o in ORDERS] if verdict else None,
                stop=judging.observe if judging else None,
            )  # fmt: skip
    t = store.read_unique(store.ls(*parts, SCORES, suffix=".parquet"))
    rows = [r for r in (t.to_pylist() if t is not None else []) if r["image_id"] in todo]
    per_image = per_image_scores(rows)
    both = {i: s for i, s in per_image.items() if len(s) == len(ORDERS)}
    shares = [sum(s.values()) / len(ORDERS) for s in both.values()]
    failed = len(todo) - len(rows)
    if verdict is not None:  # the images whose judgements failed for good leave its order: the rest decides
        verdict.finish(set(verdict.order) - set(both))
    if verdict and verdict.stopped_early:  # the judgements it did not need are not failures: the last pass's are
        failed = passes[-1].failed if passes and passes[-1].stopped else 0
    return PairwiseResult(
        against=cfg.pairwise_against,
        judge_model=judge.source,
        baseline_model=base["model"],
        baseline_run_dir=base["run_dir"],
        pairwise_dir=store.url(*parts),
        judged=len(both),
        failed=failed,
        parse_rate=parse_rate(store, parts, len(rows)),
        wins=sum(1 for x in shares if x == 1.0),
        losses=sum(1 for x in shares if x == 0.0),
        ties=sum(1 for x in shares if 0.0 < x < 1.0),
        consistency=sum(1 for s in both.values() if s["ab"] == s["ba"]) / len(both) if both else 0.0,
        stats=win_rate(shares, n_resamples=cfg.bootstrap_resamples or 1000, seed=cfg.seed),
        passes=passes,
        seconds=round(time.perf_counter() - t0, 2),
        verdict=verdict.record() if verdict else None,
    )


def both_orders_of(pending: list[str]) -> tuple[list[str], functools.partial]:
    """The images of pending judgements (``<image_id>#ab|#ba``), in the order of their first pending judgement,
    and the row -> pending requests function."""
    images = list(dict.fromkeys(split_pair_id(p)[0] for p in pending))
    return images, functools.partial(both_orders, pending=frozenset(pending))


def pairwise_task(candidate: Optional[dict], baseline: dict) -> JudgeTask:
    """Which of two captions of an image is better, in both orders (``candidate``: this run's captions, image id ->
    caption; None: the row's, alongside captioning; ``baseline``: the baseline run's)."""
    return JudgeTask(
        regex=PAIRWISE_REGEX,
        max_tokens=PAIRWISE_MAX_TOKENS,
        request=functools.partial(pairwise_request, candidate=candidate, baseline=baseline),
        out=pairwise_out,
        fixed=pairwise_fixed_schema,
        schema=PAIRWISE_SCHEMA,
        fan_out=both_orders_of,
    )


def pairwise_judging(
    cfg: RunConfig,
    store: Store,
    run: tuple[str, ...],
    images: set[str],
    failed: set[str],
    judge: ResolvedModel,
    engine: EngineSettings,
    resolved: Optional[tuple[dict, dict]] = None,
) -> Optional[SequentialJudging]:
    """The judging of the pairwise win verdict (``pairwise_verdict``) over ``images``; None while there is no
    baseline yet (the pairwise stage says so). ``resolved``: the baseline run and its captions, where the caller
    has read them already (the pairwise stage)."""
    base, baseline = resolved or (resolve_baseline(store, run, cfg.pairwise_against), None)
    if base is None:
        return None
    if baseline is None:
        baseline = read_captions(Store(base["run_dir"]), ())
    verdict = pairwise_verdict(cfg, run, base, images & set(baseline), failed)
    shares = JudgedShares()
    values = lambda rows: shares.add([r for r in rows if not r["error"]])
    parts = pairwise_run_parts(run, judge, engine, base["run_dir"])
    task = pairwise_task(None, baseline)
    return SequentialJudging(judge, engine, verdict, parts, "pairwise judge", values, task)


def pairwise_verdict(
    cfg: RunConfig, run: tuple[str, ...], base: dict, images: set[str], failed: set[str]
) -> PrefixVerdict:
    """The sequential verdict on the pairwise judge (``verdict sequential``, ``verdict_score pairwise``): the
    dataset's ``images`` the baseline captioned, but those whose caption ``failed``, judged in an order seeded by
    the dataset and the baseline run (``baseline_order``); an image's value is this run's share of its two
    judgements (1 won both, 0.5 split or tied, 0 lost both), its difference from an even split the share minus
    0.5: the interval is for the expected win rate minus 0.5."""
    return baseline_verdict(
        cfg,
        base,
        baseline_order(run, base, images - failed, images),
        lambda shares: {i: s - 0.5 for i, s in shares.items()},
        VERDICT_SCORES["pairwise"],
    )


class JudgedShares:
    """Judgement rows (``<image_id>#ab|#ba``) as they commit -> each image's share once both its orders are in."""

    def __init__(self):
        self.judged: dict[str, dict[str, float]] = {}

    def add(self, rows: list[dict]) -> dict[str, float]:
        """The images whose second judgement is among ``rows``, with their shares."""
        complete = {}
        for image_id, orders in per_image_scores(rows).items():
            seen = self.judged.setdefault(image_id, {})
            seen.update(orders)
            if len(seen) == len(ORDERS):
                complete[image_id] = sum(seen.values()) / len(ORDERS)
        return complete
