"""The engine's prompt for one image and a text, from the checkpoint's chat template, rendered once.

Every request of a run has the same shape: a system prompt, then one user turn of an image and a text. The
chat template is rendered once per checkpoint, with marker strings in place of the system prompt and the
text, in the message form Hugging Face processors document for images (``{"type": "image"}`` then
``{"type": "text"}``), by the checkpoint's own processor (``apply_chat_template``); a second rendering with
other markers must equal the first with the markers swapped, else the template does not insert the texts as
they are and this refuses it. Each request's prompt is then three strings around the two texts
(``ImagePrompt.render``): no chat template per request, no vLLM or transformers where requests are built,
and the engine's front end gets a prompt and an image array ready to use (docs/sizing.md).

``render_image_prompt`` needs transformers (the driver has it); ``ImagePrompt`` needs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from captionflow.errors import ModelError

MARKS = (("\x1fcaptionflow-system-1\x1f", "\x1fcaptionflow-text-1\x1f"), ("\x1fSYSTEM-2\x1f", "\x1fTEXT-2\x1f"))
# The files a checkpoint's chat template and processor come from (what the rendering depends on).
TEMPLATE_FILES = (
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer_config.json",
    "processor_config.json",
    "preprocessor_config.json",
    "special_tokens_map.json",
)


class ChatTemplateError(ModelError):
    """The checkpoint's chat template cannot be rendered once for every request."""


@dataclass(frozen=True)
class ImagePrompt:
    """The rendered chat template around its two texts: ``head + system + middle + text + tail``."""

    head: str
    middle: str
    tail: str

    def render(self, system: str, text: str) -> str:
        return f"{self.head}{system}{self.middle}{text}{self.tail}"


def image_messages(system: str, text: str) -> list[dict]:
    return [
        {"role": "system", "content": system},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]},
    ]


def render_image_prompt(model_path: str) -> ImagePrompt:
    """``model_path``'s chat template as an ``ImagePrompt`` (``ChatTemplateError`` when it cannot be one)."""
    from transformers import AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(model_path)

        def render(system: str, text: str) -> str:
            return processor.apply_chat_template(
                image_messages(system, text), tokenize=False, add_generation_prompt=True
            )

        (s1, t1), (s2, t2) = MARKS
        out = render(s1, t1)
    except Exception as e:
        raise ChatTemplateError(
            f"{model_path}: its processor's chat template does not render a system prompt and one image with a "
            f"text ({type(e).__name__}: {str(e)[:300]})"
        ) from None
    if out.count(s1) != 1 or out.count(t1) != 1 or out.index(s1) > out.index(t1):
        raise ChatTemplateError(
            f"{model_path}: its chat template does not place the system prompt and the text once each, in order"
        )
    head, rest = out.split(s1)
    middle, tail = rest.split(t1)
    prompt = ImagePrompt(head, middle, tail)
    if render(s2, t2) != prompt.render(s2, t2):
        raise ChatTemplateError(f"{model_path}: its chat template changes the texts it is given (not supported)")
    return prompt
