"""Caption metrics: reference-free statistics and COCO reference metrics (pycocoevalcap scorers)."""

from __future__ import annotations

import re
import statistics
from collections.abc import Iterable
from typing import Optional

# Words (with an apostrophe suffix: "don't") and single other characters, except the punctuation PTBTokenizer
# (pycocoevalcap.tokenizer) removes after tokenising: of its set ('' ' `` ` -LRB- -RRB- -LCB- -RCB- . ? ! , : - --
# ... ;) only single characters can come out of this pattern, and those are excluded in it.
_TOKEN = re.compile(r"[a-z0-9]+(?:'[a-z]+)?|[^\sa-z0-9'`.?!,:;\-]")


def caption_words(text: str) -> list[str]:
    """Lower-case, split words from punctuation, drop PTB's punctuation set; no Java needed."""
    return _TOKEN.findall(text.lower())


def simple_tokenize(text: str) -> str:
    """``caption_words`` joined by spaces (the form pycocoevalcap's scorers take)."""
    return " ".join(caption_words(text))


def ptb_tokenize(texts: dict[str, list[str]]) -> dict[str, list[str]]:
    """pycocoevalcap's PTBTokenizer (Stanford CoreNLP on the JVM): the COCO standard, needs Java."""
    from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

    return PTBTokenizer().tokenize({k: [{"caption": t} for t in v] for k, v in texts.items()})


def reference_metrics(
    captions: dict[str, str], references: dict[str, list[str]], java: bool = False
) -> tuple[dict, dict]:
    """BLEU-1..4, ROUGE-L and CIDEr (pycocoevalcap's CIDEr-D scorer), plus METEOR with ``java``.

    Returns (aggregate, per_image) where per_image maps image_id -> {metric: score}. All images
    are scored in one call per metric (CIDEr's IDF comes from the whole reference set). Text is
    tokenised by ``simple_tokenize`` (no Java) or, with ``java``, by the PTB tokenizer.
    """
    from pycocoevalcap.bleu.bleu import Bleu
    from pycocoevalcap.cider.cider import Cider
    from pycocoevalcap.rouge.rouge import Rouge

    ids = sorted(i for i in captions if references.get(i))
    if not ids:
        return {}, {}
    if java:
        gts = ptb_tokenize({i: references[i] for i in ids})
        res = ptb_tokenize({i: [captions[i]] for i in ids})
    else:
        gts = {i: [simple_tokenize(r) for r in references[i]] for i in ids}
        res = {i: [simple_tokenize(captions[i])] for i in ids}
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
    scorers = [("rouge_l", Rouge()), ("cider", Cider())]
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
