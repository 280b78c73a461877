"""Caption text as the COCO scorers take it, without Java: lower-cased words, PTB's punctuation dropped."""

from __future__ import annotations

import re

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
