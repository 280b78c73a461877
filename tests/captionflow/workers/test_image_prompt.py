"""The chat template rendered once per checkpoint: the same prompt as rendering it for every request."""

from __future__ import annotations

import shutil

import pytest

from captionflow.workers.image_prompt import ChatTemplateError, image_messages, render_image_prompt


@pytest.mark.parametrize(
    ("system", "text"),
    [("You caption images.", "Describe the image."), ("", "Caption A: 'x'\nCaption B: 'y'"), ("s {{ }} %", "é\n")],
)
def test_the_prompt_rendered_once_equals_the_template_rendered_per_request(builtin_model_dir, system, text):
    from transformers import AutoProcessor

    prompt = render_image_prompt(str(builtin_model_dir))
    processor = AutoProcessor.from_pretrained(str(builtin_model_dir))
    want = processor.apply_chat_template(image_messages(system, text), tokenize=False, add_generation_prompt=True)
    assert prompt.render(system, text) == want
    assert "<|vision_start|><|image_pad|><|vision_end|>" in prompt.middle  # the image's place, once


def test_a_template_that_changes_the_text_is_refused(builtin_model_dir, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(builtin_model_dir, model)
    template = (model / "chat_template.jinja").read_text()
    assert "{{ content['text'] }}" in template
    for changed, why in [("upper", "does not place"), ("replace('2', 'two')", "changes the texts")]:
        changed_template = template.replace("content['text'] }}", f"content['text'] | {changed} }}}}")
        (model / "chat_template.jinja").write_text(changed_template)
        with pytest.raises(ChatTemplateError, match=why):
            render_image_prompt(str(model))
