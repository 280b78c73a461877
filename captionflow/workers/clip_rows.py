"""The CLIPScore actor of the reference-free pass, run in Ray workers (no Prefect, no Ray imports).

CLIPScore (Hessel et al., 2021): ``2.5 * max(cos(image embedding, caption embedding), 0)``, in [0, 2.5]. The
caption is truncated to the text tower's context (77 tokens for CLIP): long captions are scored on their
start. A row whose image cannot be decoded or scored gets its error instead of a score.
"""

from __future__ import annotations

import io

import pyarrow as pa

CLIP_WEIGHT = 2.5
BOUNDS = (0.0, CLIP_WEIGHT)
CLIP_SCHEMA = pa.schema(
    [("image_id", pa.string()), ("clip_score", pa.float64()), ("error", pa.string()), ("attempt", pa.int64())]
)


class ClipScorer:
    """Loads a CLIP-family checkpoint once per actor; a batch of (image_id, image) rows -> CLIP_SCHEMA rows."""

    def __init__(
        self,
        model_path: str,
        captions: dict[str, str],
        attempt: int = 0,
        threads: int | None = 1,
        device: str = "cpu",
    ):
        """``threads``: torch's on CPU (an actor's one CPU), None to leave them (torch applies it to the calling
        thread's later work, so a scorer built in one thread and called in another sets nothing)."""
        import torch
        from transformers import AutoImageProcessor, AutoTokenizer, CLIPModel

        if device == "cpu" and threads:
            torch.set_num_threads(threads)
        self.torch, self.device = torch, device
        self.model = CLIPModel.from_pretrained(model_path).eval().to(device)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.images = AutoImageProcessor.from_pretrained(model_path)
        self.max_len = min(int(self.model.config.text_config.max_position_embeddings), 77)
        self.captions, self.attempt = captions, attempt

    def __call__(self, batch: pa.Table) -> pa.Table:
        ids = batch.column("image_id").to_pylist()
        images, errors = self.decode(ids, batch.column("image").to_pylist())
        rows = [self._row(i, None, e) for i, e in errors.items()]
        ok = [i for i in ids if i in images]
        if ok:
            img = self.embed_images([images[i] for i in ok])
            txt = self.embed_texts([self.captions.get(i, "") for i in ok])
            rows += [self._row(i, s, "") for i, s in zip(ok, clip_scores(img, txt))]
        return pa.Table.from_pylist(rows, schema=CLIP_SCHEMA)

    @staticmethod
    def decode(ids: list[str], data: list[bytes]) -> tuple[dict, dict[str, str]]:
        """image id -> its RGB image, and image id -> why it could not be decoded."""
        from PIL import Image

        images, errors = {}, {}
        for image_id, raw in zip(ids, data):
            try:
                with Image.open(io.BytesIO(raw)) as im:
                    images[image_id] = im.convert("RGB")
            except Exception as e:  # a shard image is already checked: this is a surprise, kept as the row's error
                errors[image_id] = f"cannot decode the preprocessed image: {e}"
        return images, errors

    def embed_images(self, images: list):
        """The image tower's embeddings (one row per image)."""
        pixels = self.images(images=images, return_tensors="pt")["pixel_values"].to(self.device)
        with self.torch.inference_mode():
            img = self.model.get_image_features(pixel_values=pixels)
        return getattr(img, "pooler_output", img)

    def embed_texts(self, captions: list[str]):
        """The text tower's embeddings (one row per caption, truncated to the tower's context)."""
        text = self.tokenizer(captions, padding=True, truncation=True, max_length=self.max_len, return_tensors="pt")
        ids, mask = text["input_ids"].to(self.device), text["attention_mask"].to(self.device)
        with self.torch.inference_mode():
            txt = self.model.get_text_features(input_ids=ids, attention_mask=mask)
        return getattr(txt, "pooler_output", txt)

    def _row(self, image_id: str, score, error: str) -> dict:
        return {"image_id": image_id, "clip_score": score, "error": error, "attempt": self.attempt}


def clip_scores(image_embeddings, text_embeddings) -> list[float]:
    """CLIPScore of each (image, caption) row pair: 2.5 x max(cosine, 0)."""
    import torch

    cos = torch.nn.functional.cosine_similarity(image_embeddings, text_embeddings, dim=-1)
    return [CLIP_WEIGHT * max(float(c), 0.0) for c in cos.tolist()]
