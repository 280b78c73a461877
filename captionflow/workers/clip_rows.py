"""The CLIPScore actor of the reference-free pass, run in Ray workers (no Prefect, no Ray imports).

CLIPScore (Hessel et al., 2021): ``2.5 * max(cos(image embedding, caption embedding), 0)``, in [0, 2.5]. The
caption is truncated to the text tower's context (77 tokens for CLIP): long captions are scored on their
start. A row whose image cannot be decoded or scored gets its error instead of a score.
"""

from __future__ import annotations

import io

import pyarrow as pa

CLIP_WEIGHT = 2.5
CLIP_SCHEMA = pa.schema(
    [("image_id", pa.string()), ("clip_score", pa.float64()), ("error", pa.string()), ("attempt", pa.int64())]
)


class ClipScorer:
    """Loads a CLIP-family checkpoint once per actor; a batch of (image_id, image) rows -> CLIP_SCHEMA rows."""

    def __init__(self, model_path: str, captions: dict[str, str], attempt: int = 0, threads: int = 1):
        import torch
        from transformers import AutoImageProcessor, AutoTokenizer, CLIPModel

        torch.set_num_threads(threads)
        self.torch = torch
        self.model = CLIPModel.from_pretrained(model_path).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.images = AutoImageProcessor.from_pretrained(model_path)
        self.max_len = min(int(self.model.config.text_config.max_position_embeddings), 77)
        self.captions, self.attempt = captions, attempt

    def __call__(self, batch: pa.Table) -> pa.Table:
        from PIL import Image

        ids = batch.column("image_id").to_pylist()
        rows, images, ok = [], [], []
        for image_id, data in zip(ids, batch.column("image").to_pylist()):
            try:
                with Image.open(io.BytesIO(data)) as im:
                    images.append(im.convert("RGB"))
                ok.append(image_id)
            except Exception as e:  # a shard image is already checked: this is a surprise, kept as the row's error
                rows.append(self._row(image_id, None, f"cannot decode the preprocessed image: {e}"))
        if ok:
            torch = self.torch
            text = self.tokenizer(
                [self.captions.get(i, "") for i in ok],
                padding=True,
                truncation=True,
                max_length=self.max_len,
                return_tensors="pt",
            )
            pixels = self.images(images=images, return_tensors="pt")["pixel_values"]
            with torch.inference_mode():
                img = self.model.get_image_features(pixel_values=pixels)
                txt = self.model.get_text_features(input_ids=text["input_ids"], attention_mask=text["attention_mask"])
                img = getattr(img, "pooler_output", img)
                txt = getattr(txt, "pooler_output", txt)
                cos = torch.nn.functional.cosine_similarity(img, txt, dim=-1)
            rows += [self._row(i, CLIP_WEIGHT * max(float(c), 0.0), "") for i, c in zip(ok, cos.tolist())]
        return pa.Table.from_pylist(rows, schema=CLIP_SCHEMA)

    def _row(self, image_id: str, score, error: str) -> dict:
        return {"image_id": image_id, "clip_score": score, "error": error, "attempt": self.attempt}
