"""The row functions Ray workers run: light to import, and no image bytes carried past the request."""

import io
import subprocess
import sys

import numpy as np
from PIL import Image

from captionflow.workers.image_prompt import ImagePrompt
from captionflow.workers.llm_rows import (
    CAPTION_SCHEMA,
    JUDGE_SCHEMA,
    JUDGE_SYSTEM,
    PAIRWISE_REGEX,
    PAIRWISE_SCHEMA,
    both_orders,
    candidate_score,
    caption_fixed_schema,
    caption_request,
    judge_fixed_schema,
    judge_out,
    judge_request,
    pairwise_fixed_schema,
    pairwise_out,
    pairwise_request,
    to_caption,
)

PROMPT = ImagePrompt("<s>", "</s><u><image>", "</u><a>")


def _jpeg() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 6), (200, 10, 10)).save(buf, format="JPEG")
    return buf.getvalue()


def test_worker_modules_do_not_import_prefect():
    # A Ray worker imports the module of every function it runs: these must stay free of Prefect.
    code = (
        "import sys, captionflow.workers.llm_rows, captionflow.workers.decode; "
        "print(sorted(m for m in ('prefect', 'ray', 'vllm', 'torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_inference_and_judge_hand_ray_the_light_functions():
    import captionflow.engines.processor as processor
    import captionflow.stages.caption_pass as caption_pass
    import captionflow.stages.judge as judge

    assert caption_pass.caption_request.__module__ == "captionflow.workers.llm_rows"
    assert processor.read_pending_rows.__module__ == "captionflow.workers.llm_rows"
    assert judge.judge_request.__module__ == "captionflow.workers.llm_rows"


def test_caption_request_is_ready_for_the_engine_and_drops_the_image_bytes():
    jpeg = _jpeg()
    row = {"image_id": "abc", "image": jpeg}
    req = caption_request(
        row,
        image_prompt=PROMPT,
        system_prompt="sys",
        prompt="Describe.",
        sampling={"max_tokens": 4},
        fail_ids=frozenset(),
    )
    assert "image" not in row  # Ray Data LLM carries the row through every stage: the bytes leave it here
    assert req["prompt"] == "<s>sys</s><u><image>Describe.</u><a>"
    image = req["multimodal_data"]["image"]
    assert image.dtype == np.uint8 and image.shape == (6, 8, 3)  # height x width x RGB, as decoded
    assert np.array_equal(image, np.asarray(Image.open(io.BytesIO(jpeg)).convert("RGB")))
    assert req["sampling_params"] == {"max_tokens": 4}
    failing = caption_request(
        {"image_id": "abc", "image": jpeg},
        image_prompt=PROMPT,
        system_prompt="s",
        prompt="p",
        sampling={"temperature": 0.0},
        fail_ids=frozenset({"abc"}),
    )
    assert failing["sampling_params"]["temperature"] == -1.0


def test_judge_request_drops_the_image_and_quotes_caption_and_references():
    row = {"image_id": "x", "image": _jpeg(), "references": ["a red square"]}
    req = judge_request(row, captions={"x": "a red box"}, image_prompt=PROMPT, sampling={"max_tokens": 8})
    assert "image" not in row
    assert req["prompt"].startswith(f"<s>{JUDGE_SYSTEM}</s><u><image>Caption to judge: 'a red box'")
    assert "- a red square" in req["prompt"] and req["prompt"].endswith("</u><a>")


def test_output_rows_have_the_fixed_schemas():
    ok = to_caption(
        {"image_id": "a", "generated_text": "hi", "num_generated_tokens": 4, "num_input_tokens": 9},
        max_tokens=4,
        model_fp="m",
        attempt=0,
    )
    assert ok["finish_reason"] == "length" and set(caption_fixed_schema(ok, model_fp="m", attempt=0)) == set(
        CAPTION_SCHEMA.names
    )
    err = caption_fixed_schema({"image_id": "a", "__inference_error__": "boom"}, model_fp="m", attempt=1)
    assert err["finish_reason"] == "error" and err["error"] == "boom" and set(err) == set(CAPTION_SCHEMA.names)
    judged = judge_out({"image_id": "a", "generated_text": '{"score": 4, "reason": "ok"}'}, attempt=0)
    assert (judged["score"], judged["error"]) == (4, "")
    bad = judge_out({"image_id": "a", "generated_text": "nope"}, attempt=0)
    assert bad["score"] is None and bad["error"].startswith("unparseable")
    assert set(judge_fixed_schema({"image_id": "a", "__inference_error__": "x"}, attempt=0)) == set(JUDGE_SCHEMA.names)


def test_pairwise_sends_each_pending_order_with_the_captions_swapped():
    row = {"image_id": "x", "image": _jpeg(), "references": ["a red square"]}
    rows = both_orders(row, pending=frozenset({"x#ab", "x#ba", "y#ab"}))
    assert [r["image_id"] for r in rows] == ["x#ab", "x#ba"]
    assert both_orders(row, pending=frozenset({"x#ba"}))[0]["image_id"] == "x#ba"  # only what is missing
    texts = []
    for r in rows:
        req = pairwise_request(
            r, candidate={"x": "mine"}, baseline={"x": "theirs"}, image_prompt=PROMPT, sampling={"max_tokens": 9}
        )
        assert "image" not in r
        texts.append(req["prompt"].split("<image>", 1)[1])
    assert texts[0].startswith("Caption A: 'mine'\nCaption B: 'theirs'") and "- a red square" in texts[0]
    assert texts[1].startswith("Caption A: 'theirs'\nCaption B: 'mine'")


def test_a_pairwise_answer_counts_for_the_caption_in_the_position_named():
    assert candidate_score("A", "ab") == 1.0 and candidate_score("B", "ab") == 0.0
    assert candidate_score("A", "ba") == 0.0 and candidate_score("B", "ba") == 1.0  # the captions were swapped
    assert candidate_score("tie", "ba") == 0.5
    out = pairwise_out({"image_id": "x#ba", "generated_text": '{"winner": "B", "reason": "more precise"}'}, attempt=0)
    assert (out["winner"], out["candidate_score"], out["error"]) == ("B", 1.0, "")
    bad = pairwise_out({"image_id": "x#ab", "generated_text": '{"winner": "C", "reason": ""}'}, attempt=0)
    assert bad["candidate_score"] is None and bad["error"].startswith("unparseable")
    failed = pairwise_fixed_schema({"image_id": "x#ab", "__inference_error__": "boom"}, attempt=1)
    assert set(failed) == set(PAIRWISE_SCHEMA.names) and failed["error"] == "boom"


def test_every_answer_the_pairwise_regex_allows_is_json_that_parses():
    import re

    from captionflow.workers.llm_rows import parse_pairwise

    for winner in ("A", "B", "tie"):
        for reason in ("", "x" * 80, "a, b. c; d: (e) - f"):
            text = f'{{"winner": "{winner}", "reason": "{reason}"}}'
            assert re.fullmatch(PAIRWISE_REGEX, text)
            assert parse_pairwise(text) == (winner, reason)
    assert not re.fullmatch(PAIRWISE_REGEX, '{"winner": "A", "reason": "a \\"quote\\""}')


def test_a_judge_after_the_captioner_takes_its_caption_and_image_and_passes_its_failures_on():
    """One pass of captioner then judge (stages/judge.SequentialJudging): the rows as Ray Data LLM hands them on."""
    import functools

    from captionflow.workers.llm_rows import (
        JUDGE_IMAGE,
        judged_fixed_schema,
        judged_out,
        judged_request,
        to_judged_caption,
    )

    prompt = PROMPT
    image = np.zeros((28, 28, 3), np.uint8)
    # the captioner's request keeps the array for the judge (the engine stage takes multimodal_data out of the row)
    cap = caption_request({"image_id": "x", "image": _jpeg(), "references": ["a ref"]}, image_prompt=prompt,
                          system_prompt="s", prompt="p", sampling={}, fail_ids=frozenset(), judged=True)  # fmt: skip
    assert cap[JUDGE_IMAGE] is cap["multimodal_data"]["image"]
    engine_out = {"image_id": "x", "references": ["a ref"], JUDGE_IMAGE: image, "generated_text": "a cat",
                  "num_generated_tokens": 2, "num_input_tokens": 9}  # fmt: skip
    row = to_judged_caption(engine_out, max_tokens=6, model_fp="m", attempt=0)
    assert row["caption"] == "a cat" and row["references"] == ["a ref"] and row[JUDGE_IMAGE] is image
    orders = both_orders(row)
    assert [r["image_id"] for r in orders] == ["x#ab", "x#ba"]
    request = functools.partial(pairwise_request, candidate=None, baseline={"x": "a dog"}, image_prompt=prompt,
                                sampling={})  # fmt: skip
    ba = judged_request(dict(orders[1]), request=request)
    assert "Caption A: 'a dog'\nCaption B: 'a cat'" in ba["prompt"] and ba["multimodal_data"]["image"] is image
    answered = {**orders[1], **ba, "generated_text": '{"winner": "B", "reason": "ok"}'}
    out = judged_out(answered, out=pairwise_out, attempt=0, pairs=True)
    assert out["image_id"] == "x" and out["caption"] == "a cat" and out["judged"]["image_id"] == "x#ba"
    assert out["judged"]["candidate_score"] == 1.0
    fixed = functools.partial(judged_fixed_schema, fixed=pairwise_fixed_schema, model_fp="m", attempt=0, pairs=True)
    assert fixed(out) is out
    # the judge failed: the caption stays, the judgement is an error row of the judge's schema
    judge_failed = fixed({**orders[0], "__inference_error__": "judge said no"})
    assert judge_failed["image_id"] == "x" and judge_failed["caption"] == "a cat" and not judge_failed["error"]
    assert judge_failed["judged"]["image_id"] == "x#ab" and judge_failed["judged"]["error"] == "judge said no"
    # the caption failed: no caption column; the judge's request passes it on unjudged, it is the captioner's error
    caption_failed = {"image_id": "y#ab", "prompt": "p", "__inference_error__": "engine said no"}
    assert judged_request(dict(caption_failed), request=request) == {}
    failed = fixed(caption_failed)
    assert failed["image_id"] == "y" and failed["error"] == "engine said no" and failed["judged"] is None
    assert failed["finish_reason"] == "error" and set(failed) == {*CAPTION_SCHEMA.names, "judged"}
