"""Per-image CIDEr-D with the document frequencies of a whole golden set's references, fixed up front.

pycocoevalcap's CIDEr takes its IDF (and the log of the set's size) from the images scored in one call, so an
image's score changes with the company it is scored in. A sequential verdict scores a growing prefix of the set
and compares each image with a baseline scored on the whole set: both must be scored on the same scale. Here the
document frequencies come from every image's references once, and each image's score is pycocoevalcap's own
(``CiderScorer.compute_cider``) under them: on the whole set it equals ``metrics.reference_metrics``' per-image
CIDEr (tests/captionflow/evaluation/test_cider.py), and a prefix's scores are those same numbers.
"""

from __future__ import annotations

from collections.abc import Callable

from captionflow.evaluation.tokens import simple_tokenize

BOUNDS = (0.0, 10.0)  # an image's CIDEr-D: 10 x a mean of clipped cosines (each <= 1) over n-gram sizes and references


class FixedIdfCider:
    """``tokenize``: text -> the space-joined tokens the scorer takes (``simple_tokenize``; the identity for text the
    PTB tokenizer has tokenised already)."""

    def __init__(self, references: dict[str, list[str]], tokenize: Callable[[str], str] = simple_tokenize):
        from pycocoevalcap.cider.cider_scorer import CiderScorer, cook_refs

        self._tokenize = tokenize
        self._ids = [i for i in sorted(references) if references[i]]
        self._refs = {i: cook_refs([tokenize(r) for r in references[i]]) for i in self._ids}
        whole = CiderScorer(n=4, sigma=6.0)
        whole.crefs = [self._refs[i] for i in self._ids]
        whole.compute_doc_freq()
        self._df = whole.document_frequency

    def __contains__(self, image_id: str) -> bool:
        return image_id in self._refs

    def scores(self, captions: dict[str, str]) -> dict[str, float]:
        """image id -> CIDEr-D of its caption, for the captions of images with references."""
        from pycocoevalcap.cider.cider_scorer import CiderScorer, cook_test

        ids = [i for i in captions if i in self._refs]
        if not ids:
            return {}
        scorer = CiderScorer(n=4, sigma=6.0)
        chosen = set(ids)
        scorer.ctest = [cook_test(self._tokenize(captions[i])) for i in ids]
        # compute_cider pairs ctest with the first len(ctest) crefs and takes log(len(crefs)) as the IDF's N: the
        # images scored first, then every other image's references, so that N is the whole set's
        scorer.crefs = [self._refs[i] for i in ids] + [self._refs[i] for i in self._ids if i not in chosen]
        scorer.document_frequency = self._df
        return {i: float(v) for i, v in zip(ids, scorer.compute_cider())}
