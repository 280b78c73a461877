"""Caption health heuristics: each fault found where it is, and not in plain captions."""

from __future__ import annotations

import pytest

from captionflow.evaluation.caption_health import CHECKS, EXAMPLES, caption_health, faults

PROMPTS = ("Describe this image in one sentence.", "You are a helpful assistant that writes short captions.")


@pytest.mark.parametrize(
    "caption, expected",
    [
        ("A brown dog runs along the beach at sunset.", []),
        ("Two people sitting on a bench in a park.", []),
        ("I'm sorry, but I can't see the image you provided.", ["refusal"]),
        ("As an AI, I do not have the ability to view pictures.", ["refusal"]),
        ("<think>The user wants a caption.</think> A cat on a sofa.", ["reasoning_leak"]),
        ("Okay, so the image shows a red car in a street.", ["reasoning_leak"]),
        ("Step 1: look at the picture. A red car.", ["reasoning_leak"]),
        ("Describe this image in one sentence. A cat on a sofa.", ["prompt_echo"]),
        ("describe this image in one sentence", ["prompt_echo"]),
        ("Un chien brun court sur la plage au coucher du soleil.", ["non_target_language"]),
        ("一只棕色的狗在海滩上奔跑", ["non_target_language"]),
        ("I'm sorry. 我看不到图片。请再试一次好吗", ["refusal", "non_target_language"]),
    ],
)
def test_faults(caption, expected):
    assert faults(caption, PROMPTS) == expected


def test_a_short_caption_without_function_words_is_not_called_foreign():
    assert faults("Red car.", PROMPTS) == [] and faults("Sunset", PROMPTS) == []


def test_a_terse_english_caption_is_not_called_foreign_and_latin_script_foreign_ones_are():
    """It flagged English captions without a function word (#70 N8)."""
    for english in ("Red car parked beside green tree outside house", "Brown dog running across grassy field today"):
        assert faults(english, PROMPTS) == [], english
    for other in ("Ein brauner Hund rennt über die Wiese am Fluss", "Un perro marrón corre sobre la hierba verde"):
        assert faults(other, PROMPTS) == ["non_target_language"], other


def test_counts_rates_and_bounded_examples():
    rows = [{"image_id": f"r{i}", "caption": "I cannot help with that."} for i in range(5)]
    rows += [{"image_id": "ok", "caption": "A cat on a mat."}]
    h = caption_health(rows, PROMPTS)
    assert h["n_captions"] == 6 and set(h["counts"]) == set(CHECKS)
    assert h["counts"]["refusal"] == 5 and h["rates"]["refusal"] == pytest.approx(5 / 6)
    assert sum(h["counts"].values()) == 5
    assert [e["image_id"] for e in h["examples"]["refusal"]] == [f"r{i}" for i in range(EXAMPLES)]
    named = caption_health(rows, PROMPTS, names={"r0": "IMG_0001.jpg"})["examples"]["refusal"]  # by file name
    assert named[0]["file"] == "IMG_0001.jpg" and "file" not in named[1]
    assert caption_health([], PROMPTS)["rates"]["refusal"] == 0.0
