"""Caption health: cheap heuristics for captions that are not captions (docs/evaluation.md).

Each caption is checked for four faults, independently (one caption can have several):

- ``refusal``: the model declines or talks about itself ("I'm sorry", "I cannot", "as an AI", "unable to see");
- ``reasoning_leak``: chain-of-thought or thinking markup in the answer (``<think>``, "Let me think",
  "Step 1:", "Okay, so the user");
- ``prompt_echo``: the caption repeats the instruction (the user prompt or system prompt, whole, or 80% of the
  prompt's words at the start of the caption);
- ``non_target_language``: not English: under 80% of the letters are ASCII (another script), or a caption of
  6+ words without a single common English function word and with two or more of another European language's
  (a terse English caption - "red car parked beside green tree outside house" - has none of either).

They are heuristics: a caption that quotes a sign reading "I'm sorry" is a false positive, a polite refusal in
other words a false negative. They count and show examples; they change no metric.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from typing import Optional

from captionflow.evaluation.tokens import caption_words

CHECKS = ("refusal", "reasoning_leak", "prompt_echo", "non_target_language")
EXAMPLES = 3  # per fault, in the report

# matched against the lower-cased caption (a case-insensitive pattern is several times slower on long captions)
_REFUSAL = re.compile(
    r"\b(i'?m sorry|i am sorry|i apologi[sz]e|i can(?:'|no)?t|i cannot|i'?m (?:not )?able to|i am unable|"
    r"i'?m unable|unable to (?:see|view|describe|help|assist|identify)|as an ai|as a language model|"
    r"i do not have the ability|i don'?t have the ability)\b"
)
_REASONING = re.compile(
    r"(</?think>|</?reasoning>|<\|begin_of_thought\|>|^\s*(?:let me think|let's think|okay,? so|alright,? so|"
    r"hmm,?|thinking:|reasoning:)|\bstep \d+\s*:|\bfirst,? i (?:need|will|should)\b|"
    r"\bthe user (?:wants|asks|is asking)\b)",
    re.MULTILINE,
)
_ENGLISH_FUNCTION_WORDS = frozenset(
    " ".join(
        (
            "a an the of in on at with and or is are was were be to for by from this that it its there their his",
            "her two three some one near under over behind next into",
        )
    ).split()
)


_ASCII_LETTER = re.compile(r"[A-Za-z]")
_ASCII_NON_LETTERS = bytes(b for b in range(128) if not chr(b).isalpha())
# French, Spanish, Italian, Portuguese, German and Dutch function words that are not English words
_OTHER_FUNCTION_WORDS = (
    frozenset(
        " ".join(
            (
                "le la les un une des du au aux et est sur dans avec pour par sous chez",
                "el los las una unos y sobre con por para del junto bajo entre",
                "il lo gli uno della delle nel sulla sul con per tra",
                "o os uma umas e com sob sobre pelo pela",
                "der die das ein eine einem einen und ist auf mit im am zum zur vor",
                "de het een en op met bij naast onder",
            )
        ).split()
    )
    - _ENGLISH_FUNCTION_WORDS
)


@functools.lru_cache(maxsize=64)
def _prompt_words(prompt: str) -> tuple[str, ...]:
    """A prompt's words, tokenised once however many captions are checked against it."""
    return tuple(caption_words(prompt))


def faults(caption: str, prompts: Iterable[str] = (), words: Optional[list[str]] = None) -> list[str]:
    """The faults of one caption (a subset of CHECKS, in that order); ``words``: its ``caption_words``, when the
    caller has them already."""
    found = []
    lowered = caption.lower()
    if _REFUSAL.search(lowered):
        found.append("refusal")
    if _REASONING.search(lowered):
        found.append("reasoning_leak")
    cap_words = words if words is not None else caption_words(caption)
    joined_cap = " ".join(cap_words)
    for p_words in (_prompt_words(p) for p in prompts):
        if not p_words or not cap_words:
            continue
        overlap = sum(1 for a, b in zip(cap_words, p_words) if a == b) / len(p_words)
        if overlap >= 0.8 or " ".join(p_words) in joined_cap:
            found.append("prompt_echo")
            break
    if caption.isascii():  # every letter ASCII (most captions: no per-character pass)
        n_letters = n_ascii = 1 if _ASCII_LETTER.search(caption) else 0
    else:  # counted in C: every letter by str.isalpha, the ASCII ones ([A-Za-z]) as the bytes left of the caption
        n_letters = sum(map(str.isalpha, caption))
        n_ascii = len(caption.encode("ascii", "ignore").translate(None, _ASCII_NON_LETTERS))
    if n_letters:
        ascii_share = n_ascii / n_letters
        said = set(cap_words)
        latin_but_foreign = (
            len(cap_words) >= 6 and not (said & _ENGLISH_FUNCTION_WORDS) and len(said & _OTHER_FUNCTION_WORDS) >= 2
        )
        if ascii_share < 0.8 or latin_but_foreign:
            found.append("non_target_language")
    return found


def caption_health(
    rows: Iterable[dict],
    prompts: Iterable[str] = (),
    words: Optional[list[list[str]]] = None,
    names: Optional[dict[str, str]] = None,
) -> dict:
    """Counts, rates and up to EXAMPLES examples per fault over caption rows (``image_id``, ``caption``);
    ``words``: each row's ``caption_words``, in order, when the caller has them already; ``names``: image id -> the
    name a user knows the image by (its file), for the examples."""
    prompts = [p for p in prompts if p]
    counts = dict.fromkeys(CHECKS, 0)
    examples: dict[str, list[dict]] = {k: [] for k in CHECKS}
    n = 0
    for i, row in enumerate(rows):
        n += 1
        for fault in faults(row["caption"], prompts, words[i] if words is not None else None):
            counts[fault] += 1
            if len(examples[fault]) < EXAMPLES:
                example = {"image_id": row["image_id"], "caption": row["caption"][:200]}
                if names and row["image_id"] in names:
                    example["file"] = names[row["image_id"]]
                examples[fault].append(example)
    return {
        "n_captions": n,
        "counts": counts,
        "rates": {k: (v / n if n else 0.0) for k, v in counts.items()},
        "examples": examples,
    }
