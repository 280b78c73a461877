"""The built-in reference-free scorer: a tiny, randomly initialised CLIP checkpoint built locally.

Like the built-in VLM, nothing is downloaded and the same captionflow version writes the same bytes: a
Hugging Face ``CLIPModel`` (2-layer text and vision towers, 64 px images), a byte-level BPE tokenizer trained
on the same text as the VLM's (with CLIP's start and end tokens), and a ``CLIPImageProcessor`` config. Its
scores are meaningless by construction; the machinery (``captionflow/stages/clip_score.py``) is real and
takes any CLIP-family checkpoint folder (``--clip-model``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from captionflow.data.cache import build_once, default_cache_dir

BUILTIN_CLIP = "builtin"
BUILDER_VERSION = "1"
BOS, EOS = "<|startoftext|>", "<|endoftext|>"
VOCAB_SIZE = 1024
MAX_TOKENS = 77
IMAGE_PX = 64


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _build_tokenizer(out: Path) -> dict[str, int]:
    from tokenizers import processors

    from captionflow.builtin.model import _training_text, train_bpe

    tok = train_bpe([t.lower() for t in _training_text()], [EOS, BOS], VOCAB_SIZE)
    ids = {t: tok.token_to_id(t) for t in (BOS, EOS)}
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A {EOS}", special_tokens=[(BOS, ids[BOS]), (EOS, ids[EOS])]
    )
    tok.save(str(out / "tokenizer.json"))
    _write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS,
            "eos_token": EOS,
            "pad_token": EOS,
            "model_max_length": MAX_TOKENS,
            "clean_up_tokenization_spaces": False,
        },
    )
    return ids


def build_builtin_clip(out_dir: str | os.PathLike, seed: int = 0) -> Path:
    """Write the built-in CLIP into ``out_dir`` (created; must not exist yet). Returns it."""
    import torch
    from transformers import CLIPConfig, CLIPModel

    out = Path(out_dir)
    out.mkdir(parents=True)
    ids = _build_tokenizer(out)
    config = CLIPConfig(
        text_config={
            "vocab_size": VOCAB_SIZE,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "max_position_embeddings": MAX_TOKENS,
            "bos_token_id": ids[BOS],
            "eos_token_id": ids[EOS],
            "pad_token_id": ids[EOS],
        },
        vision_config={
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": IMAGE_PX,
            "patch_size": 16,
        },
        projection_dim=32,
    )
    torch.manual_seed(seed)
    CLIPModel(config).save_pretrained(out, safe_serialization=True)
    _write_json(
        out / "preprocessor_config.json",
        {
            "image_processor_type": "CLIPImageProcessor",
            "do_resize": True,
            "size": {"shortest_edge": IMAGE_PX},
            "do_center_crop": True,
            "crop_size": {"height": IMAGE_PX, "width": IMAGE_PX},
            "do_rescale": True,
            "rescale_factor": 0.00392156862745098,
            "do_normalize": True,
            "image_mean": [0.48145466, 0.4578275, 0.40821073],
            "image_std": [0.26862954, 0.26130258, 0.27577711],
            "do_convert_rgb": True,
            "resample": 3,
        },
    )
    _write_json(
        out / "captionflow_clip.json",
        {"name": BUILTIN_CLIP, "builder_version": BUILDER_VERSION, "seed": seed, "note": "random weights"},
    )
    return out


def ensure_builtin_clip(cache_dir: str | os.PathLike | None = None) -> Path:
    """The folder of the built-in CLIP, built on first use."""
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    return build_once(
        cache / "models" / f"clip-{BUILTIN_CLIP}-v{BUILDER_VERSION}", "captionflow_clip.json", build_builtin_clip
    )
