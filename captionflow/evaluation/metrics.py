"""Caption metrics: reference-free statistics and COCO reference metrics (pycocoevalcap scorers)."""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from typing import Optional

from captionflow.evaluation.cider import FixedIdfCider
from captionflow.evaluation.tokens import caption_words, simple_tokenize


def ptb_tokenize(texts: dict[str, list[str]]) -> dict[str, list[str]]:
    """pycocoevalcap's PTBTokenizer (Stanford CoreNLP on the JVM): the COCO standard, needs Java."""
    from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

    return PTBTokenizer().tokenize({k: [{"caption": t} for t in v] for k, v in texts.items()})


SHARE_IMAGES = 500  # images per process when the scorers run in several (at most one per core, and 16)


def scorer_processes(images: int) -> int:
    """How many processes score ``images`` images: one per ``SHARE_IMAGES`` of them, at most one per core of
    this process and 16 (under 1,000 images: one, no pool). 5,000 64-token captions took 14.9 s in one process
    on a GPU host, after 16 engines had captioned them in ~5 s; on 2 cores, 2 processes take 0.63 of one's time."""
    import os

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(16, cores, images // SHARE_IMAGES))


def reference_metrics(
    captions: dict[str, str], references: dict[str, list[str]], java: bool = False, processes: Optional[int] = None
) -> tuple[dict, dict]:
    """BLEU-1..4, ROUGE-L and CIDEr (pycocoevalcap's CIDEr-D scorer), plus METEOR with ``java``.

    Returns (aggregate, per_image) where per_image maps image_id -> {metric: score}. CIDEr's IDF comes from all of
    ``references`` (the whole golden set's, also where only some of its images have captions: a run the sequential
    verdict stopped early is on the scale of a full one, ``cider.FixedIdfCider``), BLEU is the corpus's. Text is
    tokenised by ``simple_tokenize`` (no Java) or, with ``java``, by the PTB tokenizer. Without Java,
    ``processes`` (default ``scorer_processes``) share the images out and score their shares at once, with the
    same numbers as one process (``_scored_in_shares``).
    """
    from pycocoevalcap.bleu.bleu import Bleu
    from pycocoevalcap.rouge.rouge import Rouge

    ids = sorted(i for i in captions if references.get(i))
    if not ids:
        return {}, {}
    if java:
        every = ptb_tokenize({i: r for i, r in references.items() if r})
        gts = {i: every[i] for i in ids}
        res = ptb_tokenize({i: [captions[i]] for i in ids})
        cider, texts = FixedIdfCider(every, tokenize=str), {i: res[i][0] for i in ids}
    else:
        gts = {i: [simple_tokenize(r) for r in references[i]] for i in ids}
        res = {i: [simple_tokenize(captions[i])] for i in ids}
        cider, texts = FixedIdfCider(references), {i: captions[i] for i in ids}
    processes = scorer_processes(len(ids)) if processes is None else processes
    if not java and processes > 1:
        return _scored_in_shares(ids, gts, res, texts, cider, processes)
    agg: dict[str, float] = {}
    per: dict[str, dict] = {i: {} for i in ids}
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):  # Bleu prints its internals
        bleu, bleu_each = Bleu(4).compute_score(gts, res)
    for n in range(4):
        agg[f"bleu_{n + 1}"] = float(bleu[n])
        for i, v in zip(ids, bleu_each[n]):
            per[i][f"bleu_{n + 1}"] = float(v)
    import numpy as np

    each_cider = cider.scores(texts)
    agg["cider"] = float(np.mean(np.array([each_cider[i] for i in ids])))
    for i in ids:
        per[i]["cider"] = each_cider[i]
    scorers = [("rouge_l", Rouge())]
    if java:
        from pycocoevalcap.meteor.meteor import Meteor

        scorers.append(("meteor", Meteor()))
    for name, scorer in scorers:
        score, each = scorer.compute_score(gts, res)
        agg[name] = float(score)
        for i, v in zip(ids, each):
            per[i][name] = float(v)
    agg["n_scored"] = len(ids)
    return agg, per


_SHARED: dict = {}  # what the scoring processes read: set before they are forked, so never pickled to them


def _scored_in_shares(ids, gts, res, captions, cider: FixedIdfCider, processes: int) -> tuple[dict, dict]:
    """``reference_metrics`` over ``processes`` forked processes, each scoring a contiguous share of ``ids``:
    ROUGE-L per image, BLEU's counts per image (the corpus BLEU and each image's come from all of them at the
    end, in order), CIDEr-D per image by ``cider`` (the document frequencies of the whole set's references).
    Aggregates are the same means over the same per-image numbers as pycocoevalcap's single calls."""
    import multiprocessing

    import numpy as np
    from pycocoevalcap.bleu.bleu_scorer import BleuScorer

    _SHARED.update(ids=ids, gts=gts, res=res, captions=captions, cider=cider)
    step = -(-len(ids) // processes)
    shares = [(lo, min(lo + step, len(ids))) for lo in range(0, len(ids), step)]
    try:
        # fork: the shares read _SHARED as it is; the pool's processes only run pycocoevalcap's scorers
        with multiprocessing.get_context("fork").Pool(len(shares)) as pool:
            parts = pool.map(_score_share, shares)
    finally:
        _SHARED.clear()
    bleu = BleuScorer(n=4)
    rouge, cider = [], {}
    for share_rouge, crefs, ctest, share_cider in parts:
        rouge += share_rouge
        bleu.crefs += crefs
        bleu.ctest += ctest
        cider.update(share_cider)
    bleu_all, bleu_each = bleu.compute_score(option="closest", verbose=0)
    agg: dict[str, float] = {f"bleu_{n + 1}": float(bleu_all[n]) for n in range(4)}
    agg["rouge_l"] = float(np.mean(np.array(rouge)))
    agg["cider"] = float(np.mean(np.array([cider[i] for i in ids])))
    per = {
        i: {
            **{f"bleu_{n + 1}": float(bleu_each[n][k]) for n in range(4)},
            "rouge_l": float(rouge[k]),
            "cider": cider[i],
        }
        for k, i in enumerate(ids)
    }
    agg["n_scored"] = len(ids)
    return agg, per


def _score_share(bounds: tuple[int, int]) -> tuple[list, list, list, dict]:
    from pycocoevalcap.bleu.bleu_scorer import BleuScorer
    from pycocoevalcap.rouge.rouge import Rouge

    share = _SHARED["ids"][bounds[0] : bounds[1]]
    gts, res = _SHARED["gts"], _SHARED["res"]
    rouge = Rouge()
    bleu = BleuScorer(n=4)
    for i in share:
        bleu += (res[i][0], gts[i])
    return (
        [float(rouge.calc_score(res[i], gts[i])) for i in share],
        bleu.crefs,
        bleu.ctest,
        _SHARED["cider"].scores({i: _SHARED["captions"][i] for i in share}),
    )


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return float(s[lo] + (s[hi] - s[lo]) * (k - lo))


def repetition(text: str, n: int = 3) -> float:
    """Share of repeated word n-grams in one caption (0 = none repeated)."""
    return word_repetition(caption_words(text), n)


def word_repetition(words: list[str], n: int = 3) -> float:
    """``repetition`` of a caption's words (``caption_words``')."""
    total = len(words) - n + 1
    return 1.0 - len(set(zip(*(words[i:] for i in range(n))))) / total if total > 0 else 0.0


def length_stats(
    captions: Iterable[str],
    finish_reasons: Iterable[str],
    n_failed: int,
    words: Optional[list[list[str]]] = None,
) -> dict:
    """``words``: each caption's ``caption_words``, when the caller has them already."""
    caps = list(captions)
    reasons = list(finish_reasons)
    tokens = words if words is not None else [caption_words(c) for c in caps]
    word_counts = [len(t) for t in tokens]
    chars = [len(c) for c in caps]
    vocab = {w for t in tokens for w in t}
    n = len(caps)
    total = n + n_failed

    def dist(v: list[int]) -> dict:
        return {
            "mean": statistics.fmean(v) if v else 0.0,
            "p5": _pct(v, 0.05),
            "median": _pct(v, 0.5),
            "p95": _pct(v, 0.95),
            "max": max(v) if v else 0,
        }

    return {
        "n_captions": n,
        "words": dist(word_counts),
        "chars": dist(chars),
        "empty_rate": sum(1 for c in caps if not c.strip()) / n if n else 0.0,
        "truncated_rate": sum(1 for r in reasons if r == "length") / n if n else 0.0,
        "repetition_rate": statistics.fmean(word_repetition(t) for t in tokens) if caps else 0.0,
        "vocabulary_size": len(vocab),
        "failure_rate": n_failed / total if total else 0.0,
    }
